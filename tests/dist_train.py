"""Helpers for tests/test_train.py: a toy task the tiny model learns in seconds, and the two jobs the
tests run both in one process and under `torchrun --nproc_per_node 2` (FSDP2 over gloo on CPU):

    python tests/dist_train.py parity OUT.pt MODEL_DIR REF_DIR [LOSS_AGG [DTYPE [RECAST]]]   # one ppo_update
    torchrun --nproc_per_node 2 tests/dist_train.py parity OUT.pt MODEL_DIR REF_DIR
    torchrun --nproc_per_node 2 tests/dist_train.py e2e OUT_DIR MODEL_DIR [vllm]   # train.main on the toy task
    python tests/dist_train.py bf16-sync MODEL_DIR   # FSDP2 on one rank: the weight sync gathered in bf16
    torchrun --nproc_per_node 2 tests/dist_train.py lora-parity OUT.pt MODEL_DIR   # one LoRA ppo_update (test_lora)
    torchrun --nproc_per_node 2 tests/dist_train.py lora-e2e OUT_DIR MODEL_DIR   # train.main --lora-rank 4
"""

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]  # the repo root

import rollout  # noqa: E402
import tasks  # noqa: E402
import train  # noqa: E402

DIGITS = "0123456789"


class DigitTask:
    """A bandit: reward 1 when the completion starts with a digit (about 1 in 10 for a random tiny model)."""

    name, has_verifier, hub_id = "digits", True, None

    def load(self, split="train", *, data_file=None, limit=None, seed=0):
        n = limit or (16 if split == "train" else 8)
        return [
            tasks.Example(
                prompt=[{"role": "user", "content": f"say something {split} {i}"}],
                gold="digit",
                reference="7",
                meta={},
                uid=f"{split}-{i}",
            )
            for i in range(n)
        ]

    def reward(self, completion, example, kind="exact"):
        return float(completion[:1] in DIGITS) if completion else 0.0

    def extract(self, completion):
        return completion[:1]


def parity(out_path, model_dir, ref_dir, loss_agg="token-mean", dtype="float32", recast="no", cut="plain"):
    """One PPO update (2 epochs x 2 minibatches, micro-batches of 3, KL to a different model) on a fixed batch, with
    plain SGD: runs compared with each other differ by rounding, which AdamW's division by sqrt(v) would amplify;
    recast="yes": the policy reruns its norms and MLP gates and recasts its linear weights in backward
    (speed/backward.py), as train.load_models does under bf16; cut="uneven": rank 1 cuts one row a micro-batch, as a
    fork's cutter might, so the ranks cut different counts (speed/micro_batches.py: agreed); cut="pack": --pack."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    args = train.Args(
        M=4,
        rollout_batch=4,
        micro_batch=3,
        minibatches=2,
        ppo_epochs=2,
        beta=0.1,
        lr=0.3,
        warmup_steps=0,
        max_grad_norm=0.5,
        dtype=dtype,
        loss_agg=loss_agg,
        pack=cut == "pack",
    )
    if cut == "uneven" and rank == 1:
        plain = train.micro_batch_rows
        train.micro_batch_rows = lambda prompts, completions, rows, size, budget: plain(prompts, completions, rows, 1)
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(4, 90, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        for _ in range(args.rollout_batch)
    ]
    completions = [
        [
            torch.randint(4, 90, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(args.M)
        ]
        for _ in range(args.rollout_batch)
    ]
    adv = torch.randn(args.rollout_batch, args.M, generator=g)  # (G, M)
    mine = list(range(args.rollout_batch))[rank::world]  # train.main's sharding: groups r::world
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if recast == "yes":  # as train.load_models under bf16
        train.configure_backward(model, bf16=True, checkpointing=False)
    ref_model = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval().requires_grad_(False)
    if dist.is_initialized():
        bf16 = dtype == "bfloat16"  # FSDP2's mixed precision, as train.load_models shards under bf16
        model = train.shard(model, torch.device("cpu"), bf16=bf16)
        ref_model = train.shard(ref_model, torch.device("cpu"), bf16=bf16)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    flat = [(prompts[i], c) for i in mine for c in completions[i]]
    metrics = train.ppo_update(
        model,
        ref_model,
        optimizer,
        scheduler,
        [p for p, _ in flat],
        [c for _, c in flat],
        [[0.0] * len(c) for _, c in flat],
        adv[mine].reshape(-1),
        args,
        pad_id=0,
    )
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({"state": state, "metrics": metrics}, out_path)


def lora_parity(out_path, model_dir):
    """One LoRA PPO update (2 epochs x 2 minibatches, KL to the base model: the adapters off) with plain SGD, the model
    built by train.load_models (under torchrun: FSDP2 shards of the base and the adapters); saves the merged weights
    full_weights sends a sampler, and the metrics."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    args = train.Args(
        M=4,
        rollout_batch=4,
        micro_batch=3,
        minibatches=2,
        ppo_epochs=2,
        beta=0.1,
        lr=0.3,
        warmup_steps=0,
        max_grad_norm=0.5,
        dtype="float32",
        lora_rank=4,
        lora_alpha=8,
    )
    torch.manual_seed(0)  # peft draws A from the global RNG (train.py: init_distributed seeds it); rank 0's is sent
    _, model, ref_model = train.load_models(args, None, model_dir, torch.device("cpu"))
    assert ref_model is model  # the reference is the base: no second model
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # B = 0 at init: a step away from it, so the KL term and the adapters' A have gradients
        for name, p in model.named_parameters():
            if "lora_B" in name:
                train.local(p).copy_((0.05 * torch.randn(p.shape, generator=g)).chunk(world)[rank])  # FSDP2's shard
    prompts = [
        torch.randint(4, 90, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        for _ in range(args.rollout_batch)
    ]
    completions = [
        [
            torch.randint(4, 90, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(args.M)
        ]
        for _ in range(args.rollout_batch)
    ]
    adv = torch.randn(args.rollout_batch, args.M, generator=g)  # (G, M)
    mine = list(range(args.rollout_batch))[rank::world]
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    flat = [(prompts[i], c) for i in mine for c in completions[i]]
    metrics = train.ppo_update(
        model,
        ref_model,
        optimizer,
        scheduler,
        [p for p, _ in flat],
        [c for _, c in flat],
        [[0.0] * len(c) for _, c in flat],
        adv[mine].reshape(-1),
        args,
        pad_id=0,
    )
    merged = {name: t.clone() for name, t in train.full_weights(model)}
    if rank == 0:
        torch.save({"state": merged, "metrics": metrics}, out_path)


def e2e(out_dir, model_dir, sampler="hf", lora_rank="0"):
    tasks.TASKS["digits"] = DigitTask()
    args = train.Args(
        task="digits",
        model=model_dir,
        M=4,
        rollout_batch=4,
        micro_batch=4,
        steps=3,
        max_tokens=4,
        lr=1e-2,
        eval_examples=4,
        dtype="float32",
        out_dir=out_dir,
        save_every=2,
        sampler=sampler,
        log_completions=16,  # both ranks' samples: rank 1's come from the gather
        weight_check_every=1,  # each rank's engine against the gathered weights, every step
        lora_rank=int(lora_rank),
    )
    train.main(args)


def tools_run(out_dir, model_dir, sampler, steps, resume=""):
    """--rollout tools on the tiny model, its calls closed by "q" (tests/test_tools.py: common_character_calls)."""
    tasks.TASKS["digits"] = DigitTask()
    rollout.TOOL_TAGS = ("{}", "{}")
    rollout.TOOLS = {"q": lambda text: "7"}
    args = train.Args(
        task="digits",
        model=model_dir,
        M=4,
        rollout_batch=4,
        micro_batch=8,
        steps=int(steps),
        max_tokens=64,
        eval_examples=0,
        dtype="float32",
        out_dir=out_dir,
        sampler=sampler,
        rollout="tools",
        log_completions=16,
        resume=resume,
    )
    train.main(args)


def bf16_sync(model_dir):
    """FSDP2 over a world of one: the sync gathers each shard in the engine's bf16, and the weight check is exact."""
    from torch.distributed.tensor import DTensor

    from plumbing.sync import check_weights, weight_checksums

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = train.shard(train.load_model(model_dir), torch.device("cpu"), bf16=True)
    with torch.no_grad():
        for p in model.parameters():  # the step the engine must receive
            train.local(p).add_(0.01)
    sampler, gathered, full_tensor = rollout.make_sampler("hf", model_dir, dtype="bfloat16"), [], DTensor.full_tensor
    DTensor.full_tensor = lambda self, **kw: gathered.append(str(self.dtype)) or full_tensor(self, **kw)
    sampler.update_weights(train.full_weights(model, sampler.dtype))
    print(
        json.dumps(
            {
                "gathered": sorted(set(gathered)),
                **check_weights(weight_checksums(sampler, model), 1, torch.device("cpu")),
            }
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    job, *rest = sys.argv[1:]
    if job == "bf16-sync":
        bf16_sync(*rest)
    elif job in ("parity", "lora-parity"):
        if "RANK" in os.environ:
            dist.init_process_group("gloo")
        (parity if job == "parity" else lora_parity)(*rest)
        if dist.is_initialized():
            dist.barrier()  # rank 0 may still be saving: tearing gloo down under it aborts the other rank
            dist.destroy_process_group()
            sys.stdout.flush()
            os._exit(0)  # the result is saved: skip C++ teardown, where a gloo thread once aborted a loaded CI rank
    elif job == "lora-e2e":
        e2e(*rest, "hf", "4")
    elif job == "tools":
        tools_run(*rest)
    else:
        e2e(*rest)  # train.main sets up and tears down the process group itself
    if "RANK" in os.environ:  # as train.py's __main__: skip C++ teardown, where a gloo thread once aborted a rank
        sys.stdout.flush()
        os._exit(0)
