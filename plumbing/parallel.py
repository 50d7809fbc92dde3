"""Data parallelism over torchrun ranks (FSDP2, gathers); the identity outside torchrun.
torchrun --nproc_per_node 2 tests/dist_train.py parity OUT.pt MODEL_DIR REF_DIR
"""

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from speed.allocator import keep_freed_memory


def all_reduce_sum(values: list[float], device, op=dist.ReduceOp.SUM) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=op)
    return t.tolist()


def gather_rows(t: torch.Tensor, device) -> torch.Tensor:
    """(G_local, M) -> (G, M), rank-major, on every rank."""
    if not dist.is_initialized():
        return t
    parts = [torch.empty_like(t, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.to(device))
    return torch.cat(parts).cpu()


def gather_objects(items: list) -> list:
    """All ranks' items, rank-major, on every rank."""
    if not dist.is_initialized():
        return items
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, items)
    return [item for part in parts for item in part]


def per_rank(values: dict[str, float]) -> dict[str, float]:
    """{"name/rank0": ..., "name/rank1": ...}."""
    tables = gather_objects([values])
    return {f"{name}/rank{r}": table[name] for name in values for r, table in enumerate(tables)}


def shard(model, device, bf16: bool = False):
    """FSDP2 per layer, weights from rank 0 (the others may build `model` empty); `bf16`: verl's mixed precision."""
    full = get_model_state_dict(model) if dist.get_rank() == 0 else {}  # one read from disk, broadcast to all
    empty = any(p.is_meta for p in model.parameters())
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    )
    for layer in model.get_decoder().layers:  # per layer: one layer's full weights live at a time, and comms overlap
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=True)  # no-grad forwards: no backward
    if empty:  # this rank's shards allocated, the built buffers kept
        buffers = [(m, name, b) for m in model.modules() for name, b in m._buffers.items() if b is not None]
        model.to_empty(device=device)
        for m, name, b in buffers:
            m._buffers[name] = b.to(device)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return model


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard (a writable view)."""
    return t.to_local() if isinstance(t, DTensor) else t


def hf_name(name: str) -> str:
    """The base model's name of a parameter peft's LoRA wrapped (base_model.model.*.base_layer.weight)."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


@torch.no_grad()
def full_weights(model, dtype=None):
    """(HF name, full tensor), one at a time, gathered in `dtype` (the engine's: bf16 halves it); all ranks iterate.
    LoRA: each adapted weight merged, W + s B A (peft's get_delta_weight), under the base model's name."""
    for name, param in model.named_parameters():
        if name.endswith(".base_layer.weight"):
            param = param + model.get_submodule(name.removesuffix(".base_layer.weight")).get_delta_weight("default")
        param = param.detach().to(dtype or param.dtype)
        if ".lora_" not in name:
            yield hf_name(name), param.full_tensor() if isinstance(param, DTensor) else param


def tied_names(model) -> dict[str, str]:
    """{name: the name that holds its tensor} for each parameter that is another's (a tied head)."""
    first = {}
    kept = {name: first.setdefault(id(param), name) for name, param in model.named_parameters(remove_duplicate=False)}
    return {name: other for name, other in kept.items() if name != other}


def init_distributed(seed: int, timeout_s: float = 1800):
    """(distributed, rank, world, device), seeded."""
    from accelerate.utils import set_seed
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    cuda = torch.cuda.is_available()
    if not cuda:  # CPU: glibc would page-fault each step's activations in afresh (speed/allocator.py)
        keep_freed_memory()
    if distributed := "RANK" in os.environ:
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    set_seed(seed)  # random, numpy and torch
    return distributed, rank, world, device
