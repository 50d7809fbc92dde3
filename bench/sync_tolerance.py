"""The sampler-vs-trainer probe difference of a healthy sampler, which train.py's --sync-tolerance must clear.

For each backend and precision, the sampler and the trainer hold the same weights and train.py's probe
(plumbing/sync.py: probe_sync: 4 seeded tokens per prompt, four prompts per check, the trainer under bf16
autocast when the run is bf16) runs over the demo's held-out arith prompts. Prints, over the checks,
the largest and the median of the checked statistic (mean |difference| over a probe's tokens) and the
largest single-token difference. The vLLM rows need vLLM (on CPU: scripts/setup_vllm_cpu.sh):

    python bench/sync_tolerance.py --backends hf                            # main environment
    .venv-vllm/bin/python bench/sync_tolerance.py --backends vllm          # vLLM's environment
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from plumbing.models import load_model  # noqa: E402
from plumbing.sync import probe_sync  # noqa: E402
from rollout import make_sampler, resolve_model  # noqa: E402
from tasks import (
    encode_prompts,  # noqa: E402
    get_task,  # noqa: E402
)


def measure(backend, dtype, model_path, prompts):
    sampler = make_sampler(backend, model_path, dtype=dtype, max_model_len=256, seed=0)
    trainer = load_model(model_path, torch.float32, "cpu").eval()
    diffs = []
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
        for i in range(0, len(prompts) - 3, 4):
            probe = probe_sync(sampler, trainer, prompts[i : i + 4])
            gaps = (probe.sampler_logp - probe.trainer_logp).abs() * probe.mask  # (B, K)
            diffs.append((probe.diff, gaps.max().item()))
    sampler.close()
    return torch.tensor(diffs)  # (checks, 2)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", nargs="+", default=["hf"], choices=["hf", "vllm"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=64)
    cli = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    path = resolve_model(cli.model)
    tokenizer = make_sampler("hf", path, dtype="float32").tokenizer
    prompts = encode_prompts(tokenizer, get_task("arith").load("test", limit=cli.prompts))
    print(
        f"{'backend':8} {'dtype':9} {'checks':>6} {'mean: max':>10} {'median':>9} {'token max':>10}   model {cli.model}"
    )
    for backend in cli.backends:
        for dtype in cli.dtypes:
            d = measure(backend, dtype, path, prompts)
            print(
                f"{backend:8} {dtype:9} {len(d):6d} {d[:, 0].max():10.2e} {d[:, 0].median():9.2e} "
                f"{d[:, 1].max():10.2e}",
                flush=True,
            )


if __name__ == "__main__":
    main()
