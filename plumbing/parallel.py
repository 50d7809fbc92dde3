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


def shard(model, device):
    """FSDP2 data parallelism: each decoder layer is one all-gather unit, the root holds the rest."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def full_weights(model):
    """(HF name, full tensor), one parameter at a time; all-gathering FSDP2 shards is a collective."""
    sharded = isinstance(model, FSDPModule)  # shard() ran: each parameter is an FSDP2 DTensor shard
    for name, param in model.named_parameters():
        yield name, (param.full_tensor() if sharded else param).detach()
