"""Our side of the speed benchmarks: train.py's `main()` for a few steps, timed per step, in this process.

bench/vs_trl.py and bench/scaling.py run this file once per measurement, each in a fresh process, so
the peak resident memory it reports belongs to that run alone. Nothing in train.py is changed: the
sampler is wrapped to record each training rollout's prompts and completion lengths (the tokens
trained) and, with --expect-prompts, to check that they are exactly the prompts the TRL side gets;
checkpoint saving is switched off (TRL saves nothing either). The last line printed is
`RESULT {json}` with one record per step.

    python bench/ours_step.py --steps 3 --prompts 4 --M 8 --max-tokens 64
    python bench/ours_step.py --model /tmp/tiny --steps 2 --max-tokens 8     # smoke test on a tiny model

Per step (train.py's metrics.jsonl): gen_s = time/rollout (sampling), reward_s = time/reward, train_s =
time/train + time/sync (reference forward, PPO forward/backward, optimizer, weight sync into the
sampler: everything from sampled completions to a sampler holding the updated weights), step_s = time/step.
"""

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


class RecordingSampler:
    """Wraps a rollout sampler: logs each training rollout (n = M) and passes everything else through."""

    def __init__(self, inner, M, log):
        self._inner, self._M, self._log = inner, M, log

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def generate(self, prompts, *, n, **kwargs):
        start = time.perf_counter()
        groups = self._inner.generate(prompts, n=n, **kwargs)
        if n == self._M:  # probe_sync's probe uses n = 1
            self._log.append(
                {
                    "start": start,
                    "prompts": [list(p) for p in prompts],
                    "prompt_tokens": sum(map(len, prompts)) * n,
                    "completion_tokens": sum(len(c.token_ids) for g in groups for c in g),
                }
            )
        return groups


def run(opts) -> dict:
    import rollout
    import train

    if opts.M < 2:
        raise SystemExit("ours_step.py: --M must be >= 2 (n = 1 marks the sync probe)")
    log = []
    make_sampler = rollout.make_sampler
    rollout.make_sampler = lambda *a, **k: RecordingSampler(make_sampler(*a, **k), opts.M, log)
    train.make_sampler = rollout.make_sampler  # train.py imports it by name
    train.save_checkpoint = lambda *a, **k: None  # benchmark: write no checkpoint (TRL's side saves none)
    out_dir = tempfile.mkdtemp(prefix="ours-step-")
    args = train.Args(
        task=opts.task,
        model=opts.model,
        M=opts.M,
        rollout_batch=opts.prompts,
        micro_batch=opts.micro_batch,
        minibatches=1,
        ppo_epochs=1,
        steps=opts.steps,
        max_tokens=opts.max_tokens,
        lr=opts.lr,
        warmup_steps=0,
        beta=opts.beta,
        dtype=opts.dtype,
        sampler="hf",
        eval_examples=0,
        seed=opts.seed,
        out_dir=out_dir,
        compile=opts.compile,
        pack=opts.pack,
        micro_batch_tokens=opts.micro_batch_tokens,
    )
    t0 = time.perf_counter()
    train.main(args)
    total = time.perf_counter() - t0
    metrics = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    shutil.rmtree(out_dir, ignore_errors=True)
    if len(metrics) != len(log) or len(log) != opts.steps:
        raise SystemExit(f"ours_step.py: {len(metrics)} metric lines, {len(log)} rollouts, {opts.steps} steps")
    steps = []
    for m, r in zip(metrics, log):
        steps.append(
            {
                "step_s": m["time/step"],
                "gen_s": m["time/rollout"],
                "reward_s": m["time/reward"],
                "train_s": m["time/train"] + m["time/sync"],
                "sync_s": m["time/sync"],
                "tokens": r["prompt_tokens"] + r["completion_tokens"],
                "completion_tokens": r["completion_tokens"],
                "reward_mean": m["reward/mean"],
            }
        )
    result = {
        "side": "ours",
        "steps": steps,
        "setup_s": log[0]["start"] - t0,
        "total_s": total,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
    }
    if opts.expect_prompts:
        rows = [json.loads(line) for line in open(opts.expect_prompts)]
        expected = [
            [row["prompt_ids"] for row in rows[s * opts.prompts : (s + 1) * opts.prompts]] for s in range(opts.steps)
        ]
        result["prompts_match"] = [r["prompts"] for r in log] == expected
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="HF folder or embedded alias")
    parser.add_argument("--task", default="arith")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--M", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per forward/backward")
    parser.add_argument("--micro-batch-tokens", type=int, default=0, help="train.py's --micro-batch-tokens")
    parser.add_argument("--pack", action="store_true", help="train.py's --pack: packed rows, no padding")
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--beta", type=float, default=1e-3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_true", help="train.py --compile")
    parser.add_argument("--expect-prompts", default="", help="JSONL of the prompts each step must get, in order")
    print("RESULT " + json.dumps(run(parser.parse_args())))


if __name__ == "__main__":
    main()
