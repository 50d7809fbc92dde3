"""How our cost grows with the work: tokens/s and peak memory as prompts per step and response length double.

One axis at a time around the vs_trl.py setting (4 prompts x M = 8, at most 64 new tokens): prompts
per step in {2, 4, 8} at 64 tokens, then the response cap in {32, 64, 128} at 4 prompts. Each point
is train.py's main() for --steps steps (bench/ours_step.py) in its own process, so its peak resident
memory is its own; the first --warmup steps are left out of the times. The response cap is an upper
bound: the model stops at EOS, so the measured mean response length is printed beside it.

    python bench/scaling.py                                          # 5 points x 3 steps (~10 min)
    python bench/scaling.py --prompts 2 4 8 16 --lengths 32 64 128 256
    python bench/scaling.py --model /tmp/tiny --steps 2 --prompts 1 2 --lengths 4 8 --base-prompts 1 --base-length 4
"""

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from vs_trl import load_note, run_side, summarise  # noqa: E402  (bench/ is this script's own folder)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--task", default="arith")
    parser.add_argument("--prompts", type=int, nargs="+", default=[2, 4, 8], help="prompts per step (axis 1)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 64, 128], help="max new tokens (axis 2)")
    parser.add_argument("--base-prompts", type=int, default=4, help="prompts per step on the length axis")
    parser.add_argument("--base-length", type=int, default=64, help="max new tokens on the prompts axis")
    parser.add_argument("--M", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="steps per point, warm-up included")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", default=os.path.join(REPO, "runs", "bench", "scaling.json"))
    opts = parser.parse_args()
    if not 0 <= opts.warmup < opts.steps:
        parser.error("--warmup must be in [0, --steps)")

    from rollout import resolve_model

    model_path = resolve_model(opts.model)
    points = [(p, opts.base_length) for p in opts.prompts] + [(opts.base_prompts, n) for n in opts.lengths]
    points = list(dict.fromkeys(points))  # the shared base point runs once
    print(load_note(), flush=True)
    rows = []
    for prompts, length in points:
        cmd = [
            sys.executable,
            "bench/ours_step.py",
            "--model",
            model_path,
            "--task",
            opts.task,
            "--steps",
            str(opts.steps),
            "--prompts",
            str(prompts),
            "--M",
            str(opts.M),
            "--max-tokens",
            str(length),
            "--micro-batch",
            str(opts.micro_batch),
            "--seed",
            str(opts.seed),
        ]
        result = run_side(cmd, opts.timeout)
        result.update(batch=prompts * opts.M, prompts=prompts, max_tokens=length)
        result["summary"] = s = summarise(result, opts.warmup)
        rows.append(result)
        print(
            f"{prompts} prompts, <= {length} tokens: {s['step_s']:.2f} s/step, peak RSS {s['peak_rss_gb']:.2f} GB",
            flush=True,
        )
    os.makedirs(os.path.dirname(opts.out), exist_ok=True)
    with open(opts.out, "w") as f:
        json.dump({"options": vars(opts), "model_path": model_path, "points": rows}, f, indent=1)

    header = (
        "axis",
        "prompts",
        "max tok",
        "seqs",
        "resp len",
        "tok/step",
        "s/step",
        "gen s",
        "train s",
        "train tok/s",
        "e2e tok/s",
        "gen tok/s",
        "peak RSS GB",
    )
    print(f"\nours, M = {opts.M}, micro-batch {opts.micro_batch}, steps {opts.warmup + 1}-{opts.steps} of each point")
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for axis, keep in (
        ("prompts", lambda r: r["max_tokens"] == opts.base_length),
        ("length", lambda r: r["prompts"] == opts.base_prompts),
    ):
        for r in sorted(filter(keep, rows), key=lambda r: (r["prompts"], r["max_tokens"])):
            s, n = r["summary"], len(r["steps"]) - opts.warmup
            tok_step = sum(x["tokens"] for x in r["steps"][opts.warmup :]) / n
            cells = (
                axis,
                r["prompts"],
                r["max_tokens"],
                r["batch"],
                f"{s['resp_len']:.1f}",
                f"{tok_step:.0f}",
                f"{s['step_s']:.2f}",
                f"{s['gen_s']:.2f}",
                f"{s['train_s']:.2f}",
                f"{s['train_tok_s']:.0f}",
                f"{s['e2e_tok_s']:.0f}",
                f"{s['gen_tok_s']:.1f}",
                f"{s['peak_rss_gb']:.2f}",
            )
            print("| " + " | ".join(map(str, cells)) + " |")
    print(f"\nraw results: {opts.out}")


if __name__ == "__main__":
    main()
