"""What plumbing/sync.py's weight check costs (train.py --weight-check-every): both sides' checksums after a full sync,
against the sync itself, on one sampler and model (docs/sampler.md, "The weight check").

    python bench/weight_check_cost.py hf smollm2-135m bfloat16 [--repeats 5]
    .venv-vllm/bin/python bench/weight_check_cost.py vllm smollm2-135m bfloat16   # after scripts/setup_vllm_cpu.sh
"""

import argparse
import os
import sys
import tempfile
import time

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]  # the repo root

import torch  # noqa: E402

from speed.allocator import keep_freed_memory  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("backend", choices=("hf", "vllm"))
    parser.add_argument("model", help="tiny (the tests' random model) or a model of rollout.resolve_model")
    parser.add_argument("dtype", choices=("bfloat16", "float32"))
    parser.add_argument("--repeats", type=int, default=5)
    cli = parser.parse_args()
    keep_freed_memory()  # as train.py has it on CPU: freed pages are reused, not faulted in again
    from transformers import AutoModelForCausalLM

    from plumbing.sync import check_weights, weight_checksums
    from rollout import make_sampler, resolve_model
    from tools.tiny_model import build_tiny_model

    path = build_tiny_model(tempfile.mkdtemp()) if cli.model == "tiny" else resolve_model(cli.model)
    sampler = make_sampler(
        cli.backend, path, dtype=cli.dtype, seed=0, **(dict(max_model_len=256) if cli.backend == "vllm" else {})
    )
    trainer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    syncs, checks = [], []
    for _ in range(cli.repeats):
        start = time.perf_counter()
        sampler.update_weights(trainer.named_parameters())
        syncs.append(time.perf_counter() - start)
        start = time.perf_counter()
        sums = weight_checksums(sampler, trainer)
        checks.append(time.perf_counter() - start)
        assert check_weights(sums, 1, torch.device("cpu")) == {"sync/weight_diff": 0.0}
    print(
        f"{cli.backend} {cli.model} {cli.dtype}: weight check best {min(checks):.3f} s, all "
        f"{[round(t, 3) for t in checks]}; one sync best {min(syncs):.3f} s, all {[round(t, 3) for t in syncs]}"
    )
    sampler.close()


if __name__ == "__main__":
    main()
