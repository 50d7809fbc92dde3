"""Weight-sync checks (Section 4): a seeded log-prob probe each step, per-tensor checksums every few (trl#3189).

python -m pytest tests/test_rollout.py tests/test_train.py -k "sync or weight"
"""

import functools
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.utils.rnn import pad_sequence

from plumbing.parallel import all_reduce_sum, full_weights, hf_name, per_rank, tied_names
from speed.logprobs import pad_batch, sequence_logprobs

# Sampler and trainer run different kernels, so log-probs never agree exactly; a broken sync is far above these
SYNC_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.5}  # far above a healthy gap (bench/sync_tolerance.py)


class SyncError(RuntimeError):
    """The sampler no longer computes the trainer's policy."""


@dataclass
class SyncProbe:
    """Sampler and trainer log-probs of the same seeded probe completions."""

    token_ids: list[list[int]]
    sampler_logp: torch.Tensor  # (B, K)
    trainer_logp: torch.Tensor  # (B, K)
    mask: torch.Tensor  # (B, K)

    @property
    def diff(self) -> float:
        """Mean |sampler - trainer| log-prob (in bf16 one token can be half a nat off)."""
        gap = (self.sampler_logp - self.trainer_logp).abs() * self.mask
        return gap.sum().item() / self.mask.sum().item()

    def sampler_moved(self, before: "SyncProbe") -> float:
        """Mean |sampler log-prob now - at `before`| up to each row's first differing token."""
        moved = 0.0
        count = 0
        for i, (now, then) in enumerate(zip(self.token_ids, before.token_ids)):
            same = os.path.commonprefix([now, then])  # any sequences, not only paths
            k = min(len(same) + 1, len(now), len(then))  # through the first differing token
            moved += (self.sampler_logp[i, :k] - before.sampler_logp[i, :k]).abs().sum().item()
            count += k
        return moved / max(count, 1)


@torch.no_grad()
def probe_sync(sampler, model, prompts, max_tokens=4) -> SyncProbe:
    """A short seeded sample from the sampler, scored by the trainer."""
    completions = [group[0] for group in sampler.generate(prompts, n=1, max_tokens=max_tokens, seed=1234)]
    token_ids = [c.token_ids for c in completions]
    input_ids, attention_mask, completion_mask = pad_batch(prompts, token_ids, 0)
    device = next(model.parameters()).device
    logp = sequence_logprobs(model, input_ids.to(device), attention_mask.to(device), completion_mask.shape[1])
    # right-padded with zeros as pad_batch pads the tokens: every completion holds a token, so the widths agree
    sampler_logp = pad_sequence([torch.tensor(c.logprobs) for c in completions], batch_first=True)
    return SyncProbe(token_ids, sampler_logp, logp.float().cpu(), completion_mask.float())  # (B, K) each


def check_probe(probe, before, step: int, tolerance: float, device) -> dict:
    """SyncError on every rank unless each probe is within `tolerance` and the sampler moved with the trainer."""
    moved_alone = 0.0  # the trainer's log-probs moved while the sampler's did not
    engine_moved = 0.0
    if before is not None:  # the start's probe has no earlier one to compare with
        engine_moved = probe.sampler_moved(before)
        if before.token_ids == probe.token_ids and torch.equal(before.sampler_logp, probe.sampler_logp):
            moved = (probe.trainer_logp - before.trainer_logp).abs() * probe.mask
            moved_alone = moved.max().item()
    local = [probe.diff, moved_alone, -engine_moved]  # the last: -min over ranks
    worst_diff, worst_moved, least_engine_moved = all_reduce_sum(local, device, op=dist.ReduceOp.MAX)
    if worst_diff > tolerance:
        raise SyncError(
            f"step {step}: the sampler's log-probs differ from the trainer's by {worst_diff:.3g} nats "
            f"> --sync-tolerance {tolerance:g}; the weight sync is broken"
        )
    if worst_moved > 0:
        raise SyncError(
            f"step {step}: the trainer's log-probs moved by {worst_moved:.3g} nats and the "
            f"sampler's did not change (difference {worst_diff:.3g}, --sync-tolerance {tolerance:g}): "
            f"the weight sync never reached the sampler"
        )
    return {
        "sync/logprob_diff": worst_diff,
        "sync/sampler_moved": -least_engine_moved,
        **per_rank({"sync/logprob_diff": probe.diff}),
    }


# The probe misses a partial sync (a stale lm_head moves log-probs little): checksum each tensor.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}  # vLLM's, in order
FAMILIES = {
    "embed_tokens": "embedding rows",
    "lm_head": "lm_head rows (the embedding's, when tied)",
    "norm": "norms",
    "bias": "biases",
    **dict.fromkeys(FUSED["qkv_proj"], "q/k/v rows"),
    **dict.fromkeys(FUSED["gate_up_proj"], "gate/up rows"),
    "rest": "other weights",
}
RELATIVE_TOLERANCE = 1e-10  # float64 reorderings agree to ~1e-15


@functools.lru_cache(maxsize=8)
def _fixed_vector(n: int, device) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(n), dtype=torch.float64).to(device)


@torch.no_grad()
def checksum(t: torch.Tensor, dtype) -> tuple[float, float, int]:
    """(u . W v, sum of squares, count) of `t` cast to `dtype`, in float64; u, v fixed random vectors."""
    height = t.shape[0] if t.dim() > 1 else 1  # a vector is one row
    rows = t.reshape(height, -1)
    u = _fixed_vector(rows.shape[0], rows.device)
    v = _fixed_vector(rows.shape[1], rows.device)
    projected = 0.0
    squares = 0.0
    block = max(1, (1 << 22) // rows.shape[1])  # rows of ~4M elements at a time: small float64 copies
    for start in range(0, rows.shape[0], block):
        x = rows[start : start + block].to(dtype)  # the engine's rounding first, then exact sums
        x = x.to(torch.float64, memory_format=torch.contiguous_format)
        projected += torch.dot(u[start : start + block], x @ v).item()
        squares += torch.dot(x.view(-1), x.view(-1)).item()
    return projected, squares, t.numel()


def weight_checksums(sampler, model, step: int = 0, every: int = 1) -> tuple[dict, dict] | None:
    """(engine, trainer) checksums (a collective under FSDP2); None unless `step` is a multiple of `every` > 0.
    The trainer's side comes from full_weights, the stream that fed the engine: the check sees a weight lost, cut
    or mis-loaded on the way (a transport, a reload, a packed copy that did not follow), not a wrong gather or a
    wrong LoRA merge, which both sides would share; the probe's log-probs (check_probe) are the check of those."""
    if not every or step % every:  # every weight gathered and summed: only every few steps
        return None
    shapes = {
        hf_name(name): tuple(p.shape)
        for name, p in model.named_parameters(remove_duplicate=False)
        if ".lora_" not in name
    }  # LoRA: the engine holds the merged weights alone
    engine = sampler.weight_checksums(shapes)
    trainer = {name: checksum(tensor, sampler.dtype) for name, tensor in full_weights(model, sampler.dtype)}
    for name, other in tied_names(model).items():  # a tied head: the engine may hold it under its own name
        trainer[hf_name(name)] = trainer[hf_name(other)]
    return engine, trainer


def check_weights(sums, step: int, device) -> dict:
    """SyncError on every rank unless each engine holds every family of the trainer's weights; None passes."""
    if sums is None:  # not a checksum step
        return {}
    engine, trainer = sums
    worst = dict.fromkeys(FAMILIES.values(), 0.0)  # a label each (q/k/v share one), in FAMILIES' order
    example = {}
    names = [*trainer, *(engine.keys() - trainer.keys())]  # a name on one side only is a missed tensor
    for name in names:
        ours = trainer.get(name)
        theirs = engine.get(name)
        module = name.split(".")[-2]  # its family, as errors name it (every name is module.parameter):
        family = "norm" if "norm" in module else module
        label = FAMILIES["bias"] if name.endswith(".bias") else FAMILIES.get(family, FAMILIES["rest"])
        diff = math.inf
        where = ", on one side only"
        if ours and theirs:  # relative to the tensor's norm: one tolerance for every size and dtype
            scale = max(ours[1], theirs[1], 1e-30)
            projected = abs(ours[0] - theirs[0]) / math.sqrt(scale * ours[2])
            diff = max(projected, abs(ours[1] - theirs[1]) / scale)
            where = ""
        if diff > RELATIVE_TOLERANCE and diff >= worst[label]:
            worst[label] = diff
            example[label] = f"e.g. {name}{where}"
    capped = [min(v, 1e300) for v in worst.values()]  # inf: NaN-free
    verdicts = all_reduce_sum(capped, device, op=dist.ReduceOp.MAX)
    bad = [f for f, v in zip(worst, verdicts) if v > RELATIVE_TOLERANCE]
    if bad:
        also = "; also " + ", ".join(bad[1:]) if bad[1:] else ""
        where = example.get(bad[0], "on another rank")  # this rank's example, if its own tensors differ
        raise SyncError(
            f"the engine's {bad[0]} differ from the trainer's after the step-{step} sync "
            f"({where}){also}: the sync skipped them, or the engine did not load them"
        )
    return {"sync/weight_diff": max(verdicts)}
