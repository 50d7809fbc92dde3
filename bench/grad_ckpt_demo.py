"""The CPU demo's micro-batch with and without gradient checkpointing: seconds and peak memory per forward + backward.

SmolLM2-135M (the embedded `smollm2-135m`) under bf16 autocast over float32 weights, eager attention (as
load_model picks on CPU), 8 sequences of 40 prompt + 48 completion tokens, speed/logprobs.py: sequence_logprobs and
loss.policy_loss as train.ppo_update runs them. Each mode runs in its own process: one warm-up pass, then
`--repeats` timed passes; the peak is the resident-set high-water mark (VmHWM, reset after the warm-up) above
the resident set after the warm-up, gradients included in neither, with glibc returning every large block at
free so that the resident set follows the live tensors. train.py's own allocator setting
(speed/allocator.py: keep_freed_memory) keeps freed pages instead, which trades this accuracy for speed.

    python bench/grad_ckpt_demo.py [--repeats 5]
"""

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

BATCH, PROMPT, COMPLETION = 8, 40, 48


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def run(checkpointing: bool, repeats: int) -> dict:
    import ctypes

    import torch

    from plumbing.models import enable_grad_checkpointing, load_model

    # Every block over 64 KiB gets its own mapping, returned at free: the resident set follows the live
    # tensors (as in bench/plan_check.py), so the warm-up's freed heap cannot hide the measured pass's peak.
    mallopt = ctypes.CDLL("libc.so.6").mallopt
    mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    mallopt(-1, 64 * 1024)  # M_TRIM_THRESHOLD
    from loss import policy_loss
    from rollout import resolve_model
    from speed.logprobs import sequence_logprobs

    model = load_model(resolve_model("smollm2-135m"), torch.float32, "cpu")
    if checkpointing:
        enable_grad_checkpointing(model)
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, model.config.vocab_size, (BATCH, PROMPT + COMPLETION), generator=g)
    attention_mask, mask = torch.ones_like(input_ids), torch.ones(BATCH, COMPLETION)
    adv = torch.randn(BATCH, generator=g)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logp = sequence_logprobs(model, input_ids, attention_mask, COMPLETION)  # (B, K)
        loss, _ = policy_loss(logp, logp.detach(), adv, mask, ref_logp=logp.detach() + 0.1)
        loss.backward()
        return loss.item()

    step()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _kib("VmRSS:")
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters())).item()
    return {"times": times, "peak_extra": (_kib("VmHWM:") - base) * 1024, "grad_norm": grad_norm}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mode", choices=["plain", "ckpt"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(run(args.mode == "ckpt", args.repeats)))
        return
    results = {}
    for mode in ("plain", "ckpt"):
        cmd = [sys.executable, __file__, "--mode", mode, "--repeats", str(args.repeats)]
        results[mode] = json.loads(
            subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        )
    load = os.getloadavg()[0]
    print(
        f"{BATCH} x ({PROMPT} + {COMPLETION}) tokens, SmolLM2-135M, bf16 autocast; load average {load:.1f} "
        f"on {os.cpu_count()} cores"
    )
    for mode, r in results.items():
        times = sorted(r["times"])
        print(
            f"{mode:<6} forward+backward median {times[len(times) // 2]:.2f} s (min {times[0]:.2f}, "
            f"max {times[-1]:.2f}); peak above resident {r['peak_extra'] / 2**20:.0f} MiB"
        )
    med = {m: sorted(r["times"])[len(r["times"]) // 2] for m, r in results.items()}
    print(
        f"ratio ckpt / plain: time {med['ckpt'] / med['plain']:.2f}x, "
        f"peak {results['ckpt']['peak_extra'] / results['plain']['peak_extra']:.2f}x; "
        f"grad norms after {args.repeats + 1} passes: {results['plain']['grad_norm']:.6g} vs "
        f"{results['ckpt']['grad_norm']:.6g}"
    )


if __name__ == "__main__":
    main()
