"""Helper for tests/test_grad_checkpointing.py: loss and gradients of one fixed PPO batch, with and without
gradient checkpointing and compiled layers, in one process or under `torchrun --nproc_per_node 2` (FSDP2 over
gloo on CPU):

    python tests/grad_ckpt_worker.py OUT.pt MODEL_DIR REF_DIR [MODES]
    torchrun --nproc_per_node 2 tests/grad_ckpt_worker.py OUT.pt MODEL_DIR REF_DIR [MODES]

MODES: comma list of plain, ckpt (checkpointing), compiled (speed/compile.py: compile_layers on the policy and the
reference), compiled+ckpt; default plain,ckpt.

Each rank takes its half of the batch in two micro-batches, reduce-scatter only after the second (as
train.ppo_update does), with the token-mean denominator of the whole batch; rank 0 saves the full gradients.
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]  # the repo root

import train  # noqa: E402
from loss import policy_loss  # noqa: E402
from plumbing.models import enable_grad_checkpointing, load_model  # noqa: E402
from speed.compile import compile_layers  # noqa: E402
from speed.logprobs import pad_batch, sequence_logprobs  # noqa: E402


def fixed_batch(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(4, 90, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]
    completions = [
        torch.randint(4, 90, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]
    return prompts, completions, torch.randn(n, generator=g)


def loss_and_grads(model_dir, ref_dir, checkpointing: bool, compiled: bool = False):
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    device = torch.device("cpu")
    model = load_model(model_dir, torch.float32, device)
    ref_model = load_model(ref_dir, torch.float32, device).eval().requires_grad_(False)
    calls = []
    model.model.layers[0].register_forward_pre_hook(lambda *_: calls.append(1))  # twice when recomputed
    if checkpointing:
        enable_grad_checkpointing(model)
    if compiled:
        compile_layers(model)
        compile_layers(ref_model)
    if dist.is_initialized():
        model, ref_model = train.shard(model, device), train.shard(ref_model, device)
    prompts, completions, adv = fixed_batch()
    mine = list(range(len(prompts)))[rank::world]
    micro = [mine[: len(mine) // 2], mine[len(mine) // 2 :]]
    num_tokens = torch.tensor(float(sum(len(c) for c in completions)))  # the whole batch: one denominator
    total = torch.zeros(())
    for i, idx in enumerate(micro):
        if dist.is_initialized():
            model.set_requires_gradient_sync(i == len(micro) - 1)
        input_ids, attention_mask, mask = pad_batch([prompts[j] for j in idx], [completions[j] for j in idx], 0)
        with torch.no_grad():
            ref_logp = sequence_logprobs(ref_model, input_ids, attention_mask, mask.shape[1])  # (B, K)
        logp = sequence_logprobs(model, input_ids, attention_mask, mask.shape[1])  # (B, K)
        loss, _ = policy_loss(
            logp, logp.detach() + 0.1, adv[idx], mask, ref_logp=ref_logp, beta=0.1, denominator=num_tokens
        )  # old_logp shifted: both clip branches and the KL live
        (loss * world).backward()
        total += loss.detach()
    if dist.is_initialized():
        dist.all_reduce(total)
    grads = {
        name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
        for name, p in model.named_parameters()
    }
    return total.item(), grads, len(calls)


if __name__ == "__main__":
    out_path, model_dir, ref_dir = sys.argv[1:4]
    modes = sys.argv[4].split(",") if len(sys.argv) > 4 else ["plain", "ckpt"]
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    results = {}
    for mode in modes:
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        results[mode] = dict(
            zip(
                ("loss", "grads", "layer0_calls"),
                loss_and_grads(model_dir, ref_dir, "ckpt" in mode, "compiled" in mode),
            )
        )
        results[mode]["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs  # compiled
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(results, out_path)
    if dist.is_initialized():
        dist.barrier()  # rank 0 may still be saving: tearing gloo down under it aborts the other rank
        dist.destroy_process_group()
