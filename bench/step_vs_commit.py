"""Seconds per training step of this tree against another commit's, interleaved in one invocation.

Each repeat runs bench/ours_step.py once from this tree and once from a worktree at --commit (made and removed
here), in alternating order, each in a fresh process; every step after the first counts. It prints each phase's
median [min-max] per side and the ratio of medians (this tree / --commit). A ratio whose two sides' ranges overlap
is within run-to-run noise. Run it on an otherwise idle machine.

    python bench/step_vs_commit.py --commit 5882e4c --repeats 3 -- --steps 4
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ("step_s", "gen_s", "train_s")


def one_run(tree: str, extra: list[str]) -> list[dict]:
    proc = subprocess.run([sys.executable, "bench/ours_step.py", *extra], cwd=tree, capture_output=True, text=True)
    results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not results:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"step_vs_commit.py: bench/ours_step.py in {tree} failed (exit {proc.returncode}): {tail}")
    return json.loads(results[-1][len("RESULT ") :])["steps"][1:]  # the first step pays one-time set-up


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--commit", required=True, help="the baseline commit")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("extra", nargs="*", help="after --: flags for bench/ours_step.py")
    opts = parser.parse_args()
    base = tempfile.mkdtemp(prefix="step-vs-commit-")
    subprocess.run(
        ["git", "-C", REPO, "worktree", "add", "--detach", base, opts.commit], check=True, capture_output=True
    )
    steps = {"this tree": [], opts.commit: []}
    try:
        for i in range(opts.repeats):
            order = [("this tree", REPO), (opts.commit, base)]
            for side, tree in order if i % 2 == 0 else order[::-1]:
                steps[side] += one_run(tree, opts.extra)
    finally:
        subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", base], capture_output=True)
    for phase in PHASES:
        ours, theirs = ([s[phase] for s in steps[side]] for side in steps)
        print(
            f"{phase:8s} this tree {spread(ours)}  {opts.commit} {spread(theirs)}  "
            f"ratio {statistics.median(ours) / statistics.median(theirs):.3f} over {len(ours)} steps each"
        )


if __name__ == "__main__":
    main()
