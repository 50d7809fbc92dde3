"""Data parallelism over torchrun ranks, as train.py uses it: FSDP2 sharding, the full weights streamed to
the sampler, and the gathers and all-reduces behind every logged number. Outside torchrun (no process
group) each is the single-process identity.

    torchrun --nproc_per_node 2 tests/dist_train.py parity OUT.pt MODEL_DIR REF_DIR   # equals one process
"""

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule


def all_reduce_sum(values: list[float], device, op=dist.ReduceOp.SUM) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=op)
    return t.tolist()


def gather_rows(t: torch.Tensor, device) -> torch.Tensor:
    """(G_local, M) on every rank -> (G, M), rank-major, on every rank."""
    if not dist.is_initialized():
        return t
    parts = [torch.empty_like(t, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.to(device))
    return torch.cat(parts).cpu()


def per_rank(values: dict[str, float], device) -> dict[str, float]:
    """Each rank's own numbers, gathered: {"name/rank0": ..., "name/rank1": ...} on every rank."""
    table = gather_rows(torch.tensor([list(values.values())], dtype=torch.float64), device)  # (world, len(values))
    return {f"{name}/rank{r}": table[r, i].item() for i, name in enumerate(values) for r in range(len(table))}


def shard(model, device, bf16: bool = False):
    """FSDP2 data parallelism: each decoder layer is one all-gather unit, the root holds the rest.

    With `bf16`, mixed precision as in the paper's verl runs (param_dtype bfloat16, reduce_dtype float32): each
    layer is gathered and computed in bfloat16, half the bytes of a float32 gather, and its gradients are reduced
    in float32 into the float32 master shards that AdamW updates."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def full_weights(model):
    """(HF name, full tensor), one parameter at a time, gathered only when asked for: the sync holds one full
    parameter at once (tests/test_rollout.py::test_the_weight_sync_holds_one_gathered_parameter_at_a_time).
    All-gathering FSDP2 shards is a collective: every rank iterates in the same order."""
    sharded = isinstance(model, FSDPModule)  # shard() ran: each parameter is an FSDP2 DTensor shard
    for name, param in model.named_parameters():
        yield name, (param.full_tensor() if sharded else param).detach()
