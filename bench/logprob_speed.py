"""Seconds of speed/logprobs.py's chunked_token_logprobs forward and backward on CPU, by row-chunk size, against
the GPU's chunk size; and at the CPU's chunk size with the per-token entropy the training forward also computes
(policy/entropy).

One training micro-batch's logits as bench/vs_trl.py makes them: bfloat16, (8, 65, 49152) (8 sequences, 64
completion tokens + 1 kept position, SmolLM2's vocabulary). Each repeat times every chunk size once, in turn,
after one untimed call each; prints median [min-max] over the repeats and each size's ratio to the baseline
(speed.logprobs.CHUNK_ELEMENTS, the GPU's size and the CPU's before), and checks that every size gives the same bits.
glibc keeps freed memory, as train.py sets it on CPU (speed/allocator.py: keep_freed_memory).

    python bench/logprob_speed.py                     # 2 threads, 5 repeats
    python bench/logprob_speed.py --shape 8 1025 151936 --repeats 3    # a Qwen2.5 vocabulary, longer answers
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from speed import logprobs  # noqa: E402
from speed.allocator import keep_freed_memory  # noqa: E402


def timed(logits, targets, elements, entropy=False):
    logprobs.CPU_CHUNK_ELEMENTS = elements
    t0 = time.perf_counter()
    logp = logprobs.chunked_token_logprobs(logits, targets, entropy=entropy)
    logp = logp[0] if entropy else logp
    t1 = time.perf_counter()
    logp.sum().backward()
    t2 = time.perf_counter()
    grad, logits.grad = logits.grad, None
    return t1 - t0, t2 - t1, logp.detach(), grad


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", type=int, nargs=3, default=[8, 65, 49152], metavar=("B", "T", "V"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    keep_freed_memory()  # as train.py on CPU: blocks come back from glibc's heap, not page-faulted afresh
    B, T, V = opts.shape
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(B, T, V, generator=g) * 3).bfloat16().requires_grad_()
    targets = torch.randint(0, V, (B, T), generator=g)
    sizes = {"baseline: CHUNK_ELEMENTS": logprobs.CHUNK_ELEMENTS, "CPU_CHUNK_ELEMENTS": logprobs.CPU_CHUNK_ELEMENTS}
    sizes.update({f"{1 << k} elements": 1 << k for k in (18, 20, 22) if (1 << k) not in sizes.values()})
    entropy = "CPU chunks + entropy (train.py's)"  # the training forward also returns policy/entropy
    sizes[entropy] = logprobs.CPU_CHUNK_ELEMENTS
    outputs = {name: timed(logits, targets, n, name == entropy)[2:] for name, n in sizes.items()}  # untimed
    want = outputs["baseline: CHUNK_ELEMENTS"]
    same = {name: torch.equal(out[0], want[0]) and torch.equal(out[1], want[1]) for name, out in outputs.items()}
    times = {name: [] for name in sizes}
    for _ in range(opts.repeats):
        for name, n in sizes.items():
            times[name].append(timed(logits, targets, n, name == entropy)[:2])
    print(f"logits {B}x{T}x{V} bf16, {opts.threads} threads, {opts.repeats} repeats: median [min-max] seconds")
    base = [f + b for f, b in times["baseline: CHUNK_ELEMENTS"]]
    for name, n in sizes.items():
        fwd, bwd = ([t[i] for t in times[name]] for i in (0, 1))
        total = [f + b for f, b in times[name]]
        ratio = [t / b for t, b in zip(total, base)]  # paired by repeat
        print(
            f"{name:32s} {n:>9d} ({max(1, n // V):>4d} rows)  forward {statistics.median(fwd):.4f} "
            f"[{min(fwd):.4f}-{max(fwd):.4f}]  backward {statistics.median(bwd):.4f} [{min(bwd):.4f}-{max(bwd):.4f}]"
            f"  both / baseline {statistics.median(ratio):.2f} [{min(ratio):.2f}-{max(ratio):.2f}]"
            f"  bit-identical: {same[name]}"
        )


if __name__ == "__main__":
    main()
