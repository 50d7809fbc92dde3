"""SoftmaxGRPO training (Section 4, Appendix B.1): sample a group, score it, softmax advantages, PPO-clip.

Each step: M completions per prompt from the colocated sampler -> task rewards -> group advantages
(advantage.py; `--advantage softmax` is Eq. 1) -> PPO-clip + reference-KL loss (loss.py) over
minibatches -> AdamW step -> weights into the sampler -> sampler/trainer agreement check -> metrics.

    python train.py                                   # CPU demo: SmolLM2-135M learns arith, eval before/after
    python train.py --advantage grpo                  # the same demo with GRPO's advantages
    python train.py --task gsm8k                      # Table B.1 preset: Qwen2.5-1.5B, M=8, tau=0.1
    torchrun --nproc_per_node 8 train.py --task countdown                 # one node, FSDP2
    torchrun --nnodes 2 --nproc_per_node 8 --node_rank R --master_addr HOST --master_port 29500 \
        train.py --task deepmath                      # two nodes, as Table B.1's DeepMath run
    python train.py --task gsm8k --resume runs/gsm8k-softmax-s0           # continue from the newest checkpoint

Departures from the paper's VeRL runs:
1. The sampler (vLLM, or HF generate on CPU) lives inside every training process and receives the full
   weights after each step; there is no separate rollout worker group.
2. bfloat16 autocast over float32 master weights (VeRL: FSDP bf16 mixed precision); either way
   AdamW's 1e-6 updates are not rounded away. `--dtype auto` uses it where the hardware has bf16
   matrix units and float32 elsewhere, where bf16 would only add rounding.
3. A linear warmup over `--warmup-steps` optimizer steps; the paper presets use 0 (VeRL's default).
4. The CPU demo (`--task arith`, the default) trains a 135M model with lr 2e-5: the paper's 1e-6 is
   tuned for 1.5B models and does not move a 135M model within a 20-minute run.
"""

import argparse
import importlib.util
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace
from functools import lru_cache

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.utils.rnn import pad_sequence
from tqdm import tqdm

from advantage import ESTIMATORS, compute_advantages
from checkpoint import CheckpointError, find_checkpoint, load_checkpoint, read_trainer_state, save_checkpoint
from hardware import has_bf16_units, keep_freed_memory, load_model, store_linears_bf16
from loss import pad_batch, policy_loss, sequence_logprobs

# Largest healthy sampler-vs-trainer probe difference measured on CPU was MEASURED_MAX (README, "Training for
# real"); a sampler that missed an update differs by the size of a step's change, or not at all (caught
# separately: its log-probs stay bit-identical while the trainer's move).
SYNC_TOLERANCE = 0.5


class SyncError(RuntimeError):
    """The sampler no longer computes the trainer's policy: the run stops rather than train on stale samples."""


def arg(default, help):
    return field(default=default, metadata={"help": help})


@dataclass
class Args:
    task: str = arg("arith", "task name (tasks.py); also picks the preset of PRESETS")
    model: str = arg("smollm2-135m", "initial policy: HF folder, hub id or embedded alias (rollout.resolve_model)")
    data_file: str = arg("", "local data file for the task instead of the hub dataset")
    reward: str = arg("exact", "exact: the task's verifier; sim: similarity to the demonstration (B.5)")
    advantage: str = arg("softmax", f"group advantage estimator: {', '.join(ESTIMATORS)}")
    tau: float = arg(0.1, "SoftmaxGRPO temperature (Eq. 1)")
    M: int = arg(8, "rollouts per prompt (group size)")
    rollout_batch: int = arg(4, "prompts per step, over all ranks")
    micro_batch: int = arg(8, "sequences per forward/backward pass on one rank (gradient accumulation)")
    minibatches: int = arg(1, "optimizer steps per rollout batch and PPO epoch")
    ppo_epochs: int = arg(1, "passes over each rollout batch")
    steps: int = arg(20, "training steps (rollout batches)")
    max_tokens: int = arg(48, "max response tokens")
    temperature: float = arg(1.0, "rollout sampling temperature")
    top_p: float = arg(1.0, "rollout nucleus sampling")
    lr: float = arg(2e-5, "AdamW learning rate")
    warmup_steps: int = arg(2, "linear learning-rate warmup, in optimizer steps")
    weight_decay: float = arg(0.01, "AdamW weight decay")
    max_grad_norm: float = arg(1.0, "gradient clipping")
    clip_low: float = arg(0.2, "PPO clip: ratio >= 1 - clip_low")
    clip_high: float = arg(0.28, "PPO clip: ratio <= 1 + clip_high")
    beta: float = arg(1e-3, "reference KL coefficient (k3); 0 skips the reference model")
    dtype: str = arg("auto", "bfloat16 (autocast over float32 master weights), float32, or auto: bfloat16 where "
                     "the hardware has bf16 matrix units (GPUs, CPUs with AVX512-BF16/AMX), else float32")
    sampler: str = arg("auto", "auto (vllm on a GPU when installed, else hf), hf or vllm")
    gpu_memory_utilization: float = arg(0.3, "vLLM's share of GPU memory")
    sync_tolerance: float = arg(SYNC_TOLERANCE, "stop when the sampler's probe log-probs differ from the trainer's "
                                "by more than this (nats, largest over probe tokens), after any weight sync")
    eval_examples: int = arg(64, "held-out prompts scored greedily before and after training (0: none)")
    seed: int = arg(0, "seed of data order and sampling")
    out_dir: str = arg("", "run folder (default runs/TASK-ADVANTAGE-sSEED)")
    save_every: int = arg(0, "checkpoint every N steps (0: only at the end)")
    resume: str = arg("", "checkpoint folder, or run folder (its newest checkpoint), to continue from")
    wandb: bool = arg(False, "also log to Weights & Biases (if installed)")


PAPER = dict(model="Qwen/Qwen2.5-1.5B", lr=1e-6, warmup_steps=0, micro_batch=4, save_every=100,
             eval_examples=500)  # Tables B.1-B.2: shared rows
PRESETS = {  # explicit flags override these
    "arith": {},  # the defaults above: the CPU demo
    "countdown24": dict(max_tokens=128),
    "gsm8k": dict(PAPER, tau=0.1, M=8, rollout_batch=64, steps=1000, max_tokens=256),  # Table B.1
    "countdown": dict(PAPER, tau=0.1, M=8, rollout_batch=64, steps=2000, max_tokens=256),
    "deepmath": dict(PAPER, tau=0.3, M=16, rollout_batch=512, micro_batch=8, steps=3220, max_tokens=1024),
    "poetry": dict(PAPER, tau=0.3, M=8, rollout_batch=64, steps=1350, max_tokens=1024, reward="sim"),  # B.2
    "meetingbank": dict(PAPER, tau=0.3, M=8, rollout_batch=512, steps=3220, max_tokens=4096, reward="sim"),
}


def run_dir(args: Args) -> str:
    if args.out_dir:
        return args.out_dir
    ckpt = find_checkpoint(args.resume) if args.resume else None
    return os.path.dirname(os.path.abspath(ckpt)) if ckpt else f"runs/{args.task}-{args.advantage}-s{args.seed}"


def check_args(args: Args) -> str | None:
    """The first problem with `args` as one line, or None; reads nothing but small files."""
    from tasks import get_task

    try:
        task = get_task(args.task)
    except ValueError as err:
        return str(err)
    world = int(os.environ.get("WORLD_SIZE", 1))
    rules = [
        (args.advantage in ESTIMATORS, f"--advantage must be one of {', '.join(ESTIMATORS)}"),
        (args.reward in ("exact", "sim"), "--reward must be exact or sim"),
        (args.reward == "sim" or task.has_verifier, f"task {args.task} has no verifier: use --reward sim"),
        (math.isfinite(args.tau) and args.tau > 0, "--tau must be a finite number > 0"),
        (min(args.M, args.rollout_batch, args.micro_batch, args.minibatches, args.ppo_epochs, args.steps,
             args.max_tokens) >= 1, "--M, --rollout-batch, --micro-batch, --minibatches, --ppo-epochs, "
                                    "--steps and --max-tokens must be >= 1"),
        (args.rollout_batch % (world * args.minibatches) == 0,
         f"--rollout-batch ({args.rollout_batch}) must divide evenly by ranks x minibatches ({world} x "
         f"{args.minibatches})"),
        (args.lr > 0 and args.max_grad_norm > 0, "--lr and --max-grad-norm must be > 0"),
        (min(args.warmup_steps, args.save_every, args.eval_examples, args.weight_decay, args.beta) >= 0,
         "--warmup-steps, --save-every, --eval-examples, --weight-decay and --beta must be >= 0"),
        (args.temperature > 0 and 0 < args.top_p <= 1, "--temperature must be > 0 and --top-p in (0, 1]"),
        (0 <= args.clip_low < 1 and args.clip_high >= 0, "--clip-low must be in [0, 1), --clip-high >= 0"),
        (args.dtype in ("auto", "bfloat16", "float32"), "--dtype must be auto, bfloat16 or float32"),
        (args.sampler in ("auto", "hf", "vllm"), "--sampler must be auto, hf or vllm"),
        (0 < args.gpu_memory_utilization < 1, "--gpu-memory-utilization must be in (0, 1)"),
        (args.sync_tolerance > 0, "--sync-tolerance must be > 0"),
        (not args.data_file or os.path.isfile(args.data_file), f"--data-file {args.data_file} does not exist"),
    ]
    for ok, message in rules:
        if not ok:
            return message
    if args.resume:
        ckpt = find_checkpoint(args.resume)
        if ckpt is None:
            return f"--resume {args.resume}: no checkpoint there"
        try:
            saved = read_trainer_state(ckpt)["args"]
        except CheckpointError as err:
            return str(err)
        if (saved["task"], saved["model"]) != (args.task, args.model):
            return (f"checkpoint {ckpt} is from task {saved['task']} / model {saved['model']}, not task "
                    f"{args.task} / model {args.model}; pass the same --task and --model to resume")
    out = run_dir(args)
    taken = os.path.isdir(out) and any(f == "metrics.jsonl" or f.startswith("checkpoint-") for f in os.listdir(out))
    if taken and not args.resume:
        return f"{out} already holds a run: continue it with --resume {out}, or pick another --out-dir"
    return None


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit status 2, no usage dump
        print(f"train.py: error: {message}", file=sys.stderr)
        sys.exit(2)


def parse_args(argv=None) -> Args:
    """Args from the command line: the --task preset first, then the flags actually given."""
    parser = _Parser(description=__doc__.split("\n")[0])
    for f in fields(Args):
        flag, kind = "--" + f.name.replace("_", "-"), f.type
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                                help=f.metadata["help"])
        else:
            parser.add_argument(flag, type=kind, default=argparse.SUPPRESS, help=f"{f.metadata['help']} "
                                f"(default {f.default!r}, unless the task's preset sets it)")
    given = vars(parser.parse_args(argv))
    args = Args(**{**PRESETS.get(given.get("task", Args.task), {}), **given})
    error = check_args(args)
    if error:
        parser.error(error)
    return args


@lru_cache(maxsize=2)
def epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def batch_indices(step: int, batch: int, n: int, seed: int) -> list[int]:
    """Prompts of `step`: a seeded permutation of the training set per epoch, read in order (no state)."""
    return [int(epoch_order(seed, pos // n, n)[pos % n]) for pos in range(step * batch, (step + 1) * batch)]


def all_reduce_sum(values: list[float], device, op=dist.ReduceOp.SUM) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=op)
    return t.tolist()


def check_sync(probe, before, step: int, tolerance: float, device) -> dict:
    """Stop the run (SyncError on every rank) unless every rank's sampler now computes its trainer's log-probs.

    Two failures: the probe log-probs disagree by more than `tolerance`, or the trainer's moved since the
    last check while the sampler's stayed bit-identical (an update that never arrived, too small to exceed
    the tolerance on its own). Returns the sync metrics, one difference per rank.
    """
    moved_alone = probe.trainer_moved_alone(before) if before is not None else 0.0
    worst_diff, worst_moved = all_reduce_sum([probe.diff, moved_alone], device, op=dist.ReduceOp.MAX)
    if worst_diff > tolerance:
        raise SyncError(f"step {step}: the sampler's log-probs differ from the trainer's by {worst_diff:.3g} nats "
                        f"> --sync-tolerance {tolerance:g}; the weight sync is broken")
    if worst_moved > 0:
        raise SyncError(f"step {step}: the trainer's log-probs moved by {worst_moved:.3g} nats and the "
                        f"sampler's did not change (difference {worst_diff:.3g}, --sync-tolerance {tolerance:g}): "
                        f"the weight sync never reached the sampler")
    return {"sync/logprob_diff": worst_diff, **per_rank({"sync/logprob_diff": probe.diff}, device)}


def per_rank(values: dict[str, float], device) -> dict[str, float]:
    """Each rank's own numbers, gathered: {"name/rank0": ..., "name/rank1": ...} on every rank."""
    table = gather_rows(torch.tensor([list(values.values())], dtype=torch.float64), device)  # (world, len(values))
    return {f"{name}/rank{r}": table[r, i].item() for i, name in enumerate(values) for r in range(len(table))}


def gather_rows(t: torch.Tensor, device) -> torch.Tensor:
    """(G_local, M) on every rank -> (G, M), rank-major, on every rank."""
    if not dist.is_initialized():
        return t
    parts = [torch.empty_like(t, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.to(device))
    return torch.cat(parts).cpu()


def full_weights(model):
    """(HF name, full tensor), one parameter at a time; all-gathering FSDP2 shards is a collective."""
    for name, param in model.named_parameters():
        yield name, (param.full_tensor() if hasattr(param, "full_tensor") else param).detach()


def shard(model, device):
    """FSDP2 data parallelism: each decoder layer is one all-gather unit, the root holds the rest."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def micro_batch_rows(prompts, completions, rows, size) -> list[list[int]]:
    """`rows` cut into micro-batches of at most `size`, sorted by length so that similar lengths share one.

    A micro-batch is padded to its longest prompt + longest completion; grouping by length sends little
    compute to padding. The loss is a sum over the minibatch's tokens with one shared denominator, so the
    grouping does not change it (tests/test_train.py::test_micro_batch_grouping_keeps_the_update).
    """
    rows = sorted(rows, key=lambda i: (len(completions[i]), len(prompts[i])))
    return [rows[a:a + size] for a in range(0, len(rows), size)]


def reuses_training_logprobs(args: Args) -> bool:
    """One epoch, one minibatch: nothing has moved since sampling, so pi_old recomputed by the trainer equals
    logp of the training forward; logp.detach() stands in for it and saves a forward pass
    (tests/test_train.py::test_on_policy_shortcut_equals_recomputing_old_logprobs)."""
    return args.ppo_epochs == 1 and args.minibatches == 1


def ppo_update(model, ref_model, optimizer, scheduler, prompts, completions, sampler_logps, adv, args, pad_id):
    """PPO epochs over minibatches of this rank's sequences, one optimizer step per minibatch (Section 4).

    Loss denominator (token-mean, Appendix B.1): the number of completion tokens in the whole optimizer
    minibatch on all ranks, so neither the micro-batch size nor the number of ranks changes the loss.
    FSDP averages gradients over ranks, so each rank's loss is multiplied by the world size.
    """
    device, world = next(model.parameters()).device, dist.get_world_size() if dist.is_initialized() else 1
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")
    per_minibatch = len(prompts) // args.minibatches
    minibatches = []
    for start in range(0, len(prompts), per_minibatch):
        micro = []
        for idx in micro_batch_rows(prompts, completions, range(start, start + per_minibatch), args.micro_batch):
            input_ids, attention_mask, mask = pad_batch([prompts[i] for i in idx], [completions[i] for i in idx],
                                                        pad_id)  # (B, P+K) x2, (B, K)
            sampler_logp = pad_sequence([torch.tensor(sampler_logps[i]) for i in idx], batch_first=True)  # (B, K)
            micro.append(dict(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                              mask=mask.to(device), adv=adv[idx].to(device), sampler_logp=sampler_logp.to(device)))
        minibatches.append(micro)
    on_policy = reuses_training_logprobs(args)
    with torch.no_grad(), autocast:
        for mb in (mb for micro in minibatches for mb in micro):
            inputs = (mb["input_ids"], mb["attention_mask"], mb["mask"].shape[1], args.temperature)
            mb["ref_logp"] = sequence_logprobs(ref_model, *inputs) if ref_model is not None else None
            mb["old_logp"] = None if on_policy else sequence_logprobs(model, *inputs)
    keys = ["pg_loss", "kl", "clip_frac_low", "clip_frac_high", "ratio_mean", "tokens", "sampler_diff", "grad_norm"]
    sums = dict.fromkeys(keys, 0.0)
    for epoch in range(args.ppo_epochs):
        for micro in minibatches:
            num_tokens = torch.stack([mb["mask"].sum() for mb in micro]).sum()  # this rank's share
            if dist.is_initialized():
                dist.all_reduce(num_tokens)  # the whole minibatch's token count: one shared denominator
            for i, mb in enumerate(micro):
                if hasattr(model, "set_requires_gradient_sync"):  # FSDP2: reduce-scatter once per minibatch
                    model.set_requires_gradient_sync(i == len(micro) - 1)
                with autocast:
                    logp = sequence_logprobs(model, mb["input_ids"], mb["attention_mask"], mb["mask"].shape[1],
                                             args.temperature)  # (B, K) float32
                old_logp = logp.detach() if on_policy else mb["old_logp"]
                loss, m = policy_loss(logp, old_logp, mb["adv"], mb["mask"], clip_low=args.clip_low,
                                      clip_high=args.clip_high, ref_logp=mb["ref_logp"], beta=args.beta,
                                      num_tokens=num_tokens)
                (loss * world).backward()
                n = mb["mask"].sum().item()
                for key in keys[:2]:
                    sums[key] += m[key]  # already divided by the minibatch's token count: the shares add up
                for key in keys[2:5]:
                    sums[key] += m[key] * n  # per-microbatch means, weighted by tokens
                sums["tokens"] += n
                if epoch == 0:  # sampler vs trainer log-probs of the same tokens, before any update
                    sums["sampler_diff"] += ((old_logp - mb["sampler_logp"]).abs() * mb["mask"]).sum().item()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            sums["grad_norm"] += float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
    total = dict(zip(keys, all_reduce_sum([sums[k] for k in keys], device)))
    updates, tokens = args.ppo_epochs * len(minibatches), max(total["tokens"], 1)
    return {"loss/pg": total["pg_loss"] / updates, "loss/kl": total["kl"] / updates,
            **{f"loss/{key}": total[key] / tokens for key in keys[2:5]},
            "grad/norm": total["grad_norm"] / (updates * world),  # the same on every rank: undo the sum
            "lr": lr, "sync/rollout_logprob_diff": total["sampler_diff"] * args.ppo_epochs / tokens}


def load_reference(path, args: Args, device):
    """The frozen reference policy for the KL term, in no-grad mode and the training precision."""
    ref_model = load_model(path, torch.float32, device).eval().requires_grad_(False)
    if args.dtype == "bfloat16" and not dist.is_initialized():  # FSDP2 wants one dtype per sharded layer
        store_linears_bf16(ref_model)
    return ref_model


def make_optimizer(model, args: Args):
    """AdamW over float32 master weights. Fused (one kernel per step instead of a dozen passes over the
    weights; equal to the default to 1e-6, tests/test_train.py::test_fused_adamw_matches_default) except
    on FSDP2's sharded parameters, which keep the default implementation."""
    return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                             fused=not dist.is_initialized())


def main(args: Args) -> dict:
    error = check_args(args)
    if error:
        raise ValueError(error)
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from eval import encode_prompts, evaluate
    from rollout import make_sampler, resolve_model, step_seed, sync_check
    from tasks import get_task

    # ---- derived values
    out_dir = run_dir(args)
    ckpt = find_checkpoint(args.resume) if args.resume else None
    cuda = torch.cuda.is_available()
    if args.dtype == "auto":
        args = replace(args, dtype="bfloat16" if has_bf16_units() else "float32")
    if args.sampler == "auto":  # vLLM where it runs well, HF generate elsewhere
        args = replace(args, sampler="vllm" if cuda and importlib.util.find_spec("vllm") else "hf")
    if not cuda:  # CPU tensors come from malloc: keep their pages instead of faulting them in again
        keep_freed_memory()
    hf_logging.disable_progress_bar()

    # ---- distributed init: torchrun sets RANK, WORLD_SIZE, LOCAL_RANK
    if "RANK" in os.environ:
        dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    master = rank == 0
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    # ---- data
    task = get_task(args.task)
    train_set = task.load("train", data_file=args.data_file or None, seed=args.seed)
    test_set = task.load("test", data_file=args.data_file or None, limit=args.eval_examples,
                         seed=args.seed) if args.eval_examples else []
    eval_kind = "exact" if task.has_verifier else "sim"  # held-out accuracy uses the verifier when there is one
    eval_name = "greedy pass@1" if task.has_verifier else "greedy similarity reward"

    # ---- models: the policy (float32 master weights), the frozen reference, FSDP2 when distributed
    init_path = resolve_model(args.model)
    policy_path = ckpt or init_path  # the reference is always the initial model, also on resume
    try:
        tokenizer = AutoTokenizer.from_pretrained(policy_path)
        model = load_model(policy_path, torch.float32, device)
    except Exception as err:  # OSError, SafetensorError, ...: whatever a damaged file raises
        if ckpt is None:
            raise
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: {str(err).splitlines()[0][:200]}") from None
    ref_model = load_reference(init_path, args, device) if args.beta > 0 else None
    if dist.is_initialized():
        model = shard(model, device)
        ref_model = shard(ref_model, device) if ref_model is not None else None
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    optimizer = make_optimizer(model, args)
    scheduler = torch.optim.lr_scheduler.LambdaLR(  # linear warmup, then constant (Appendix B.1)
        optimizer, lambda s: min(1.0, (s + 1) / args.warmup_steps) if args.warmup_steps else 1.0)
    start_step = load_checkpoint(ckpt, model, optimizer, scheduler, rank) if ckpt else 0
    n_params = sum(p.numel() for p in model.parameters())
    n_head = model.get_output_embeddings().weight.numel()  # FLOPs only where logits are computed
    n_body = n_params - model.get_input_embeddings().weight.numel() - (
        0 if model.config.tie_word_embeddings else n_head)

    # ---- sampler: its own copy of the policy in this process, seeded per rank
    train_ids, test_ids = encode_prompts(tokenizer, train_set), encode_prompts(tokenizer, test_set)
    max_prompt = max(len(p) for p in train_ids + test_ids)
    sampler = make_sampler(args.sampler, policy_path, dtype=args.dtype, max_model_len=max_prompt + args.max_tokens,
                           seed=args.seed + rank, gpu_memory_utilization=args.gpu_memory_utilization, device=device)
    probe_prompts = train_ids[:4]  # the same probe at every check: a sampler that never updates repeats itself
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")
    with autocast:
        probe = sync_check(sampler, model, probe_prompts)
    check_sync(probe, None, start_step, args.sync_tolerance, device)  # the sampler loaded the same weights

    def held_out_score() -> float:
        """Greedy pass@1 (or similarity) on this rank's share of the test prompts, averaged over ranks."""
        summary = evaluate(sampler, task, test_set[rank::world], max_tokens=args.max_tokens, seed=args.seed,
                           reward_kind=eval_kind, progress=master)["summary"]
        score, n = all_reduce_sum([summary.get("pass@1", summary.get("sim_reward", 0.0)) * summary["n"],
                                   summary["n"]], device)
        return score / max(n, 1)

    # ---- logging
    if master:
        os.makedirs(out_dir, exist_ok=True)
    metrics_path, eval_path = os.path.join(out_dir, "metrics.jsonl"), os.path.join(out_dir, "eval.json")
    if master and os.path.exists(metrics_path):  # drop lines logged after the checkpoint we resume from
        lines = [line for line in open(metrics_path) if json.loads(line)["step"] <= start_step]
        with open(metrics_path, "w") as f:
            f.writelines(lines)
    wandb = importlib.import_module("wandb") if master and args.wandb and importlib.util.find_spec("wandb") else None
    if wandb:
        wandb.init(project="softmax-grpo", name=os.path.basename(out_dir), config=asdict(args))
    elif master and args.wandb:
        print("note: wandb is not installed; logging to metrics.jsonl only")
    evals = json.load(open(eval_path)) if ckpt and os.path.exists(eval_path) else {}
    if test_set and start_step == 0:
        evals["before"] = held_out_score()
        if master:
            print(f"held-out {eval_name} before training: {evals['before']:.3f} ({len(test_set)} prompts)")
            with open(eval_path, "w") as f:  # now, so that a resumed run still reports it at the end
                json.dump(evals, f)

    # ---- the loop
    metrics, bar = {}, tqdm(range(start_step, args.steps), initial=start_step, total=args.steps, disable=not master,
                            desc=f"{args.advantage} on {args.task}")
    for step in bar:
        t0 = time.perf_counter()
        # -- rollout: this rank's share of the step's prompts, M samples each
        per_rank = args.rollout_batch // world
        mine = batch_indices(step, args.rollout_batch, len(train_set), args.seed)[rank * per_rank:][:per_rank]
        examples, prompts = [train_set[i] for i in mine], [train_ids[i] for i in mine]
        seed = step_seed(args.seed, step, rank * per_rank, args.rollout_batch, args.M)  # own stream per sample
        groups = sampler.generate(prompts, n=args.M, max_tokens=args.max_tokens, temperature=args.temperature,
                                  top_p=args.top_p, seed=seed)  # G_local lists of M completions
        freed = sampler.sleep()  # GPU memory goes to training: the bytes it gave back
        t1 = time.perf_counter()
        # -- reward and advantages: gathered over ranks, so batch-level baselines see the whole batch
        rewards = torch.tensor([[task.reward(c.text, ex, kind=args.reward) for c in g]
                                for ex, g in zip(examples, groups)])  # (G_local, M)
        passed = torch.zeros_like(rewards)  # verifier passes, for reward/pass_rate
        if task.has_verifier:
            passed = rewards if args.reward == "exact" else torch.tensor(
                [[task.reward(c.text, ex, kind="exact") for c in g] for ex, g in zip(examples, groups)])
        lengths = torch.tensor([[len(c.token_ids) for c in g] for g in groups], dtype=torch.float32)  # (G_local, M)
        cut = torch.tensor([[c.finish_reason == "length" for c in g] for g in groups], dtype=torch.float32)
        table = gather_rows(torch.stack([rewards, (passed >= 0.5).float(), lengths, cut]).transpose(0, 1), device)
        all_rewards, all_passed, all_lengths, all_cut = table.transpose(0, 1)  # each (G, M)
        adv_all = compute_advantages(args.advantage, all_rewards, args.tau)  # (G, M); Eq. (1) for softmax
        adv = adv_all[rank * len(mine):(rank + 1) * len(mine)].reshape(-1)  # (G_local * M,), this rank's rows
        t2 = time.perf_counter()
        # -- train
        flat = [(p, c) for p, g in zip(prompts, groups) for c in g]
        train_metrics = ppo_update(model, ref_model, optimizer, scheduler, [p for p, _ in flat],
                                   [c.token_ids for _, c in flat], [c.logprobs for _, c in flat], adv, args, pad_id)
        t3 = time.perf_counter()
        # -- weight sync, then check that the sampler now computes the trainer's log-probs
        sampler.wake()
        sampler.update_weights(full_weights(model))
        with autocast:
            probe, before = sync_check(sampler, model, probe_prompts), probe
        t4 = time.perf_counter()
        # -- metrics: identical on all ranks (gathered / all-reduced), written by rank 0
        prompt_tokens, completion_tokens = all_reduce_sum([sum(map(len, prompts)) * args.M, lengths.sum().item()],
                                                          device)
        forwards = 1 + 3 * args.ppo_epochs + (ref_model is not None) + (not reuses_training_logprobs(args))
        flops = forwards * (2 * n_body * (prompt_tokens + completion_tokens) + 2 * n_head * completion_tokens)
        metrics = {"step": step + 1, "reward/mean": all_rewards.mean().item(),
                   "reward/std": all_rewards.std(correction=0).item(),
                   **({"reward/pass_rate": all_passed.mean().item()} if task.has_verifier else {}),
                   "adv/zero_group_frac": (adv_all.abs().amax(-1) < 1e-6).float().mean().item(),
                   "response/len_mean": all_lengths.mean().item(), "response/len_max": all_lengths.max().item(),
                   "response/trunc_frac": all_cut.mean().item(), **train_metrics,
                   "time/rollout": t1 - t0, "time/reward": t2 - t1, "time/train": t3 - t2, "time/sync": t4 - t3,
                   "time/step": t4 - t0, "perf/tokens_per_s": completion_tokens / (t4 - t0),
                   "perf/tflops": flops / (t4 - t0) / 1e12}  # model FLOPs estimate, all devices
        if cuda:  # what each rank's sampler gave back on sleep, and its trainer's peak (scripts/gpu_check.sh)
            metrics.update(per_rank({"mem/sleep_freed_gb": freed / 1e9,
                                     "mem/trainer_peak_gb": torch.cuda.max_memory_reserved(device) / 1e9}, device))
        if importlib.util.find_spec("grad_alloc"):  # Table 3's allocation, every estimator on these rollouts
            from grad_alloc import allocation_metrics

            metrics.update(allocation_metrics(all_rewards, all_lengths, list(ESTIMATORS), tau=args.tau))
        try:  # the step's metrics reach the log either way; a failed check saves no checkpoint
            metrics.update(check_sync(probe, before, step + 1, args.sync_tolerance, device))
        finally:
            if master:
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(metrics) + "\n")
                if wandb:
                    wandb.log(metrics, step=step + 1)
                bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}")
        if args.save_every and (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            save_checkpoint(out_dir, step + 1, model, optimizer, scheduler, tokenizer, args)

    # ---- the end: held-out score after training, curves, cleanup
    if test_set:
        evals["after"] = held_out_score()
        metrics.update({f"eval/{k}": v for k, v in evals.items()})
    if master:
        if test_set:
            with open(eval_path, "w") as f:
                json.dump(evals, f)
            print(f"held-out {eval_name}: before {evals.get('before', float('nan')):.3f}, "
                  f"after {evals['after']:.3f} ({len(test_set)} prompts)")
        if importlib.util.find_spec("figures") and os.path.exists(metrics_path):
            from figures import plot_training_curves

            print(f"curves: {plot_training_curves([metrics_path], os.path.join(out_dir, 'curves.png'))}")
        if wandb:
            wandb.finish()
    if dist.is_initialized():
        dist.barrier()  # leave together: a rank tearing down gloo while another still works can abort it
    sampler.close()  # before the process group: a vLLM engine under torchrun shuts it down itself
    if dist.is_initialized():
        dist.destroy_process_group()
    return metrics


if __name__ == "__main__":
    cli_args = parse_args()
    from rollout import SamplingError
    from tasks import DataError

    try:
        main(cli_args)
    except (CheckpointError, DataError, SamplingError, SyncError) as err:  # missing data, bad checkpoint, diverged
        # policy, stale sampler. The same on every rank but a sampling error: one rank speaks for all.
        if int(os.environ.get("RANK", 0)) == 0 or isinstance(err, SamplingError):
            print(f"train.py: error: {err}", file=sys.stderr)
        sys.exit(1)
