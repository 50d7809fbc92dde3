"""Peak extra memory of speed/logprobs.py's chunked_token_logprobs (alone, and with the per-token entropy train.py
logs as policy/entropy) against the naive log_softmax(...).gather(...).

Each method runs in its own process on bfloat16 logits of shape (8, 1024, 151936) (Qwen2.5's
vocabulary); the peak resident memory above the logits themselves is read from the kernel
(VmHWM after resetting it with /proc/self/clear_refs). Target: under 0.25 x the logits' size.

    python bench/logprob_memory.py [--shape 8 1024 151936]
"""

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def measure(method: str, shape) -> dict:
    import torch

    from speed.logprobs import chunked_token_logprobs

    B, T, V = shape
    g = torch.Generator().manual_seed(0)
    logits = torch.empty(B, T, V, dtype=torch.bfloat16).normal_(generator=g)  # (B, T, V)
    targets = torch.randint(0, V, (B, T), generator=g)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS counter: from here on VmHWM is this method's peak
    base = _rss_kib("VmRSS:")
    with torch.no_grad():
        if method == "naive":
            out = torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None]).squeeze(-1)
        elif method == "chunked":
            out = chunked_token_logprobs(logits, targets)
        else:  # as the training forward calls it: log-probs and entropies from the same chunks
            out, entropy = chunked_token_logprobs(logits, targets, entropy=True)
            out = out + 0 * entropy
    extra = (_rss_kib("VmHWM:") - base) * 1024
    return {
        "method": method,
        "extra_bytes": extra,
        "logits_bytes": logits.numel() * 2,
        "checksum": float(out.double().sum()),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", type=int, nargs=3, default=[8, 1024, 151936])
    parser.add_argument("--method", choices=["naive", "chunked", "entropy"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.method:  # child process
        print(json.dumps(measure(args.method, args.shape)))
        return
    results = {}
    for method in ["naive", "chunked", "entropy"]:
        cmd = [sys.executable, __file__, "--method", method, "--shape", *map(str, args.shape)]
        results[method] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    gib = 2**30
    logits_bytes = results["naive"]["logits_bytes"]
    print(f"logits {tuple(args.shape)} bfloat16: {logits_bytes / gib:.2f} GiB")
    for method, r in results.items():
        print(
            f"{method:<8} peak extra memory {r['extra_bytes'] / gib:6.2f} GiB "
            f"= {r['extra_bytes'] / logits_bytes:.3f} x logits"
        )
    print(f"ratio chunked / naive: {results['chunked']['extra_bytes'] / results['naive']['extra_bytes']:.3f}")
    print(f"ratio entropy / naive: {results['entropy']['extra_bytes'] / results['naive']['extra_bytes']:.3f}")
    naive_sum, chunked_sum = results["naive"]["checksum"], results["chunked"]["checksum"]
    print(f"checksums agree: {abs(naive_sum - chunked_sum) < 1e-2 * abs(naive_sum)}")


if __name__ == "__main__":
    main()
