"""Seconds per training step with --pack against padded micro-batches, interleaved in one invocation, this tree.

Each repeat runs bench/ours_step.py once padded and once with --pack, in alternating order, each in a fresh
process; every step after the first counts. It prints each phase's median [min-max] per side and the ratio of medians
(packed / padded). Run it on an otherwise idle machine.

    python bench/pack_vs_pad.py --repeats 3 -- --steps 4
"""

import argparse
import statistics

from step_vs_commit import PHASES, REPO, one_run, spread


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("extra", nargs="*", help="after --: flags for bench/ours_step.py, both sides")
    opts = parser.parse_args()
    steps = {"padded": [], "packed": []}
    for i in range(opts.repeats):
        order = [("padded", opts.extra), ("packed", [*opts.extra, "--pack"])]
        for side, extra in order if i % 2 == 0 else order[::-1]:
            steps[side] += one_run(REPO, extra)
    for phase in PHASES:
        padded, packed = ([s[phase] for s in steps[side]] for side in ("padded", "packed"))
        ratio = statistics.median(packed) / statistics.median(padded)
        print(
            f"{phase:8s} packed {spread(packed)}  padded {spread(padded)}  ratio {ratio:.3f} over {len(packed)} steps"
        )


if __name__ == "__main__":
    main()
