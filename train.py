"""SoftmaxGRPO training loop (Section 4, Appendix B.1): sample, score, softmax advantages (Eq. 1), PPO update, sync.

python train.py                  # CPU demo: SmolLM2-135M on arith
python train.py --task gsm8k     # Table B.1 preset
torchrun --nproc_per_node 8 train.py --task countdown
"""

import contextlib
import json
import math
import os
import signal
import sys
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.nn.utils.rnn import pad_sequence
from tqdm import tqdm

import config
from advantage import compute_advantages
from config import Args, parse_args
from eval import eval_seed, evaluate, gather_samples, sampled_scores
from grad_alloc import allocation_metrics
from loss import REFERENCES, Share, kept_samples, loss_denominator, policy_loss
from plumbing import run_log
from plumbing.checkpoint import (
    CheckpointError,
    find_checkpoint,
    kept_rng_state,
    load_checkpoint,
    lock_run_folder,
    remove_orphans,
    resume_hint,
    run_dir,
    run_folder_error,
    save_checkpoint,
)
from plumbing.cli import first_line
from plumbing.files import WriteError, write_json
from plumbing.models import ModelLoadError, SamplingError, load_model, load_tokenizer
from plumbing.parallel import all_reduce_sum, full_weights, init_distributed, local, shard, tied_names
from plumbing.sync import SyncError, check_probe, check_weights, probe_sync, weight_checksums
from rewards import reward_options
from rollout import EVAL_TURN_STREAMS, ROLLOUTS, ToolSampler, make_sampler, resolve_model, sampling_memory_error
from speed.backward import configure_backward, store_linears_bf16
from speed.compile import compile_layers
from speed.logprobs import pack_batch, packed_logprobs, packing_error, pad_batch, sequence_logprobs
from speed.micro_batches import agreed, micro_batch_rows
from tasks import DataError, encode_prompts, get_task, load_data, reward_weights


def main(args: Args) -> dict:
    """One run of flags that parse_args (config.check_args) has checked."""
    out_dir = run_dir(args)  # before resolve_auto: the folder's name is the flags as given
    ckpt = find_checkpoint(args.resume) if args.resume else None
    with lock_run_folder(out_dir, hold=int(os.environ.get("RANK", 0)) == 0) as held:
        # again under the lock: another run may have taken the folder since check_args looked
        if held and (error := run_folder_error(out_dir, ckpt)):
            raise CheckpointError(error)
        return train(config.resolve_auto(args), out_dir, ckpt)


def train(args: Args, out_dir: str, ckpt: str | None) -> dict:
    """The run in `out_dir`, from checkpoint `ckpt` or from --model."""
    distributed, rank, world, device = init_distributed(args.seed, args.dist_timeout_s)
    master = rank == 0
    remove_orphans(out_dir, master)
    task = get_task(args.task)
    weights = reward_weights(task, args.reward, args.reward_weights)  # r = sum_k w_k r_k
    train_set, test_set, eval_sets = load_data(args, task, weights, master)
    init_path = resolve_model(args.model)
    tokenizer, model, ref_model = load_models(args, ckpt, init_path, device)
    moving_ref = ref_model if REFERENCES[args.reference] else None
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    optimizer = make_optimizer(model, args)
    scheduler = make_scheduler(optimizer, args)
    rollout = ROLLOUTS[args.rollout]
    if isinstance(rollout, type):  # a rollout that keeps state: one instance a run, saved with each checkpoint
        rollout = rollout()
    start_step = 0
    if ckpt:
        start_step = load_checkpoint(ckpt, model, optimizer, scheduler, rank, args, moving_ref, rollout)
    n_params = run_log.param_counts(model)
    n_forwards = 1 + 3 * args.ppo_epochs + (ref_model is not None) + (not reuses_training_logprobs(args))
    context = model.config.max_position_embeddings
    train_ids = encode_prompts(tokenizer, train_set, args.max_tokens, context)
    test_rows = [ex for _, rows in eval_sets.values() for ex in rows]
    test_ids = encode_prompts(tokenizer, test_rows, args.max_tokens, context)
    max_prompt = max(len(p) for p in train_ids + test_ids)
    n_local = args.rollout_batch // world  # prompts a rank samples a step
    eval_shard = -(-len(test_ids) // world)  # held-out prompts a rank scores
    n_samples = n_local * args.M
    eval_batch = min(eval_shard, 64) * max(args.eval_samples, 1)  # evaluate: 64 prompts at once
    eval_total = eval_shard * (args.eval_samples + 1)
    at = dict(max_tokens=args.max_tokens, dtype=args.dtype, hf=args.sampler == "hf", device=device)
    sampling = (
        (n_samples, n_samples, "--M or --rollout-batch"),
        (eval_batch, eval_total, "--eval-samples or --eval-examples"),
    )
    # too little memory fails here, in one line, not as an out-of-memory error mid-run
    for rows, kept, lower in sampling:
        if error := sampling_memory_error(model.config, rows, kept, max_prompt, **at, lower=lower):
            raise SamplingError(error)
    sampler_context = max_prompt + args.max_tokens  # the longest prompt and a whole completion
    if args.sampler == "vllm" and device.type == "cuda":  # else vLLM fails to start on every rank (docs/memory_plan.md)
        from tools.memory_plan import engine_share_error, shape_from_config

        gpu = dict(gpu_bytes=torch.cuda.mem_get_info(device)[1], utilization=args.gpu_memory_utilization)
        shape = shape_from_config(model.config.to_dict())
        if error := engine_share_error(shape, dtype=args.dtype, **gpu, length=sampler_context):
            raise SamplingError(error)
    phase = run_log.Phases(device)
    with kept_rng_state():  # vLLM reseeds the global RNGs
        sampler = phase.build(
            make_sampler,
            args.sampler,
            ckpt or init_path,
            dtype=args.dtype,
            device=device,
            max_model_len=sampler_context,
            seed=args.seed + rank,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_num_seqs=args.max_num_seqs or n_samples,
        )
    probe_prompts = train_ids[:4]  # a sampler that never updates repeats itself
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")
    with autocast:
        probe = probe_sync(sampler, model, probe_prompts)
    check_probe(probe, None, start_step, args.sync_tolerance, device)
    log = run_log.MetricsLog(out_dir, start_step, args, master)
    samples = run_log.SampleLog(out_dir, start_step, args.log_completions, master)
    eval_sampler = sampler
    if args.rollout == "tools":  # held-out completions may call the tools too
        eval_sampler = ToolSampler(sampler, args.max_tool_calls, EVAL_TURN_STREAMS)
    held_out = partial(evaluate_held_out, eval_sampler, eval_sets, args, rank, world, device, samples)
    evals = run_log.read_evals(out_dir) if ckpt else {}  # a resumed run keeps its "before" score
    if eval_sets and start_step == 0:
        run_log.report_eval(evals, "before", held_out(0), out_dir, task, len(test_set), master)
    if master and train_set[0].revision:  # the data's sha256 or hub commit, as the official prepare_data.py's manifest
        revisions = {"train": train_set[0].revision}
        revisions.update({name: rows[0].revision for name, (_, rows) in eval_sets.items()})
        data_path = os.path.join(out_dir, "data.json")
        if ckpt and os.path.isfile(data_path):  # the same --data-file path may hold other rows now
            with open(data_path) as f:
                recorded = json.load(f)
            changed = [name for name, revision in revisions.items() if recorded.get(name) != revision]
            if changed:
                print(
                    f"note: the {', '.join(changed)} data changed since {data_path} recorded it; the run resumes on it"
                )
        write_json(data_path, revisions)

    metrics = {}
    hparams = config.estimator_hparams(args)
    estimators = config.alloc_estimators(args)
    mine = slice(rank * n_local, (rank + 1) * n_local)  # this rank's groups of the gathered batch
    rollout_step = partial(
        rollout,
        sampler=sampler,
        task=task,
        train_set=train_set,
        train_ids=train_ids,
        weights=weights,
        args=args,
        rank=rank,
        world=world,
        device=device,
    )
    bar = tqdm(
        range(start_step, args.steps),
        initial=start_step,
        total=args.steps,
        disable=not master,
        desc=f"{args.advantage} on {args.task}",
    )
    for step in bar:
        # rollout: M completions per prompt, scored; the sampler then frees its memory for training
        with phase("rollout"):
            batch = rollout_step(step)  # (G, M) each
            phase.sleep(sampler)
        # reward: advantages over the gathered batch, so batch-level baselines see all of it
        with phase("reward"):
            # per-term rewards, for an estimator that normalises each term (GDPO); the others read the sum
            terms = {term: (weight, batch.scores["terms"][term]) for term, weight in weights.items()}
            adv_all = compute_advantages(args.advantage, batch.scores["rewards"], terms=terms, **hparams)  # Eq. (1)
            keep = kept_samples(batch.scores["rewards"], batch.scores["cut"], args.row_filter, args.mask_truncated)
            adv = adv_all[mine].reshape(-1)
            keep = keep[mine].reshape(-1)
        # train: PPO epochs over this rank's sequences
        with phase("train"):
            update = ppo_update(
                model, ref_model, optimizer, scheduler, *sequences(batch), adv, args, pad_id, keep, policy_of(batch)
            )
        # sync: the sampler gets the new weights, and a probe shows it really has them
        with phase("sync"):
            sampler.update_weights(full_weights(model, sampler.dtype))
            checksums = weight_checksums(sampler, model, step + 1, args.weight_check_every)
            before = probe
            with autocast:
                probe = probe_sync(sampler, model, probe_prompts)
        # log: the step's metrics, its samples, and every eval-every steps the held-out scores
        metrics = {
            **run_log.step_metrics(
                step, task.has_verifier, batch, adv_all, update, phase.seconds(), n_params, n_forwards, device
            ),
            **batch.metrics,
            **allocation_metrics(  # Table 3
                batch.scores["rewards"],
                batch.scores["lengths"],
                estimators,
                must=args.advantage,
                terms=terms,
                **hparams,
            ),
        }
        samples.write(step + 1, task, batch, adv_all, rank)
        # eval: absolute steps, so a resumed run scores at the same ones
        if eval_sets and args.eval_every and (step + 1) % args.eval_every == 0:
            with phase("eval"):
                metrics.update(held_out(step + 1))
        metrics.update(phase.metrics())
        try:  # a failed sync check saves no checkpoint, but its metrics still reach the log
            metrics.update(check_probe(probe, before, step + 1, args.sync_tolerance, device))
            metrics.update(check_weights(checksums, step + 1, device))
        finally:
            log.write(metrics)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}")
        # save: every --save-every steps, and at the last
        if args.save_every and (step + 1) % args.save_every == 0 or step + 1 == args.steps and args.final_save:
            save_checkpoint(out_dir, step + 1, model, optimizer, scheduler, tokenizer, args, moving_ref, rollout)

    if eval_sets:
        scores = {key: value for key, value in metrics.items() if key.startswith("eval/")}
        run_log.report_eval(evals, "after", scores or held_out(args.steps), out_dir, task, len(test_set), master)
        metrics.update({f"eval/{k}": v for k, v in evals.items() if k in ("before", "after")})
    if master and os.path.exists(log.path):
        try:
            from tools.figures import plot_training_curves
        except ImportError as err:
            print(f"curves: skipped ({err}); draw them elsewhere: python -m tools.figures curves {log.path}")
        else:
            print(f"curves: {plot_training_curves([log.path], os.path.join(out_dir, 'curves.png'))}")
    log.finish()
    if distributed:
        dist.barrier()  # a rank tearing down gloo while another works can abort it
    sampler.close()  # before the process group: vLLM under torchrun shuts it down itself
    if dist.is_initialized():
        dist.destroy_process_group()
    return metrics


def reuses_training_logprobs(args: Args) -> bool:
    """One epoch, one minibatch: pi_old = logp.detach() saves a forward pass."""
    return args.ppo_epochs == 1 and args.minibatches == 1


def sequences(batch) -> tuple[list, list, list]:
    """This rank's (prompt ids, completion ids, sampler log-probs) per sequence."""
    flat = [(p, c) for p, g in zip(batch.prompts, batch.groups) for c in g]
    return [p for p, _ in flat], [c.token_ids for _, c in flat], [c.logprobs for _, c in flat]


def policy_of(batch) -> list | None:
    """Which completion tokens the policy sampled, a list of bools a sequence; None when it sampled them all (every
    rollout but tools)."""
    policy = [c.policy for g in batch.groups for c in g]
    if all(mask is None for mask in policy):
        return None
    return policy


def ppo_update(
    model,
    ref_model,
    optimizer,
    scheduler,
    prompts,
    completions,
    sampler_logps,
    adv,
    args,
    pad_id,
    keep=None,
    policy=None,
):
    """PPO epochs, one optimizer step per minibatch (Section 4); `keep` False drops a sequence from the loss, and
    `policy` (a list of bools a sequence) False a token the policy did not sample, such as a tool's output: it stays in
    the context of every log-prob but gets no policy-gradient, KL or entropy term, nor a place in the denominator.
    The denominator is summed over micro-batches and ranks first; FSDP averages over ranks, so the loss is x world."""
    distributed = dist.is_initialized()  # also in one process, when vLLM made its own group
    sharded = isinstance(model, FSDPModule)
    device = next(model.parameters()).device
    world = dist.get_world_size() if distributed else 1
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")

    on_policy = reuses_training_logprobs(args)

    def micro_batch(idx) -> dict:
        """One micro-batch on `device`, with its reference and pi_old log-probs (before any step)."""
        rows = [prompts[i] for i in idx]
        answers = [completions[i] for i in idx]
        input_ids, attention_mask, layout = pad_batch(rows, answers, pad_id)  # (B, P+K) x2, (B, K)
        mask = layout  # the loss's tokens
        if keep is not None:  # a dropped sequence stays in its micro-batch, its mask zeroed (x 1 is exact)
            mask = mask * keep[idx].to(mask.dtype)[:, None]
        if policy is not None:  # a tool's tokens: in the context, out of the loss
            sampled = [torch.tensor(policy[i], dtype=mask.dtype) for i in idx]
            mask = mask * pad_sequence(sampled, batch_first=True)
        sampler_logp = pad_sequence([torch.tensor(sampler_logps[i]) for i in idx], batch_first=True)
        tensors = dict(mask=mask, adv=adv[idx], sampler_logp=sampler_logp)
        mb = {key: value.to(device) for key, value in tensors.items()}
        if args.pack:  # one row of the sequences back to back: no pad position is computed
            packed = [t.to(device) for t in pack_batch(rows, answers)]
            # scattered back by the completions' layout: a dropped sequence's tokens are in the packed row too
            mb["logprobs"] = partial(
                packed_logprobs, packed=packed, mask=layout.to(device), temperature=args.temperature
            )
        else:
            inputs = dict(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device))
            mb["logprobs"] = partial(
                sequence_logprobs, **inputs, n_completion=mask.shape[1], temperature=args.temperature
            )
        with model.disable_adapter() if ref_model is model else contextlib.nullcontext():  # LoRA: the base
            mb["ref_logp"] = mb["logprobs"](ref_model) if ref_model is not None else None
        mb["old_logp"] = None if on_policy else mb["logprobs"](model)
        return mb

    size = len(prompts) // args.minibatches
    minibatches = []
    with torch.no_grad(), autocast:
        for start in range(0, len(prompts), size):
            span = range(start, start + size)
            cut = micro_batch_rows(prompts, completions, span, args.micro_batch, args.micro_batch_tokens)
            rows = agreed(cut, device)  # a fork's cutter may cut each rank's rows into more or fewer
            minibatches.append([micro_batch(idx) for idx in rows])
    entropy_grad = args.entropy_coef != 0  # the entropy's backward only for a bonus that trains it
    options = config.loss_options(args)
    sums = dict.fromkeys(["tokens", "entropy", "sampler_diff", "grad_norm"], 0.0)
    shares = {}
    for epoch in range(args.ppo_epochs):
        for micro in minibatches:
            parts = [loss_denominator(mb["mask"], args.loss_agg, args.max_tokens) for mb in micro]
            denominator = torch.stack(parts).sum()
            if distributed:
                dist.all_reduce(denominator)  # one shared denominator
            for i, mb in enumerate(micro):
                if sharded:  # FSDP2: reduce-scatter once per minibatch
                    model.set_requires_gradient_sync(i == len(micro) - 1)
                with autocast:
                    logp, entropy = mb["logprobs"](model, entropy=True, entropy_grad=entropy_grad)
                mask = mb["mask"]  # (B, K), like logp and entropy
                old_logp = logp.detach() if on_policy else mb["old_logp"]
                loss, m = policy_loss(
                    logp,
                    old_logp,
                    mb["adv"],
                    mask,
                    ref_logp=mb["ref_logp"],
                    sampler_logp=mb["sampler_logp"],
                    entropy=entropy,
                    denominator=denominator,
                    norm_len=args.max_tokens,
                    **options,
                )
                (loss * world).backward()
                n = mask.sum().item()
                sums["entropy"] += (entropy.detach() * mask).sum().item()
                for key, value in m.items():
                    name = f"loss/{key}"
                    shares[name] = isinstance(value, Share)  # summed as is; a token mean is weighed by its tokens
                    sums[name] = sums.get(name, 0.0) + (value if shares[name] else value * n)
                sums["tokens"] += n
                if epoch == 0:  # the sampler/trainer gap of pi_old, before any update moved the policy
                    gap = (old_logp - mb["sampler_logp"]).abs() * mask
                    sums["sampler_diff"] += gap.sum().item()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            sums["grad_norm"] += float(grad_norm.full_tensor() if sharded else grad_norm)
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            update_reference(ref_model, model, scheduler.last_epoch, args)
            optimizer.zero_grad(set_to_none=True)
    total = dict(zip(sums, all_reduce_sum(list(sums.values()), device)))
    updates = args.ppo_epochs * len(minibatches)
    tokens = max(total["tokens"], 1)
    means = {}
    for key, share in shares.items():
        means[key] = total[key] / (updates if share else tokens)  # a Share: a mean per optimizer step
    return {
        **means,
        "policy/entropy": total["entropy"] / tokens,
        "grad/norm": total["grad_norm"] / (updates * world),  # the same on every rank: undo the sum
        "lr": lr,
        "sync/rollout_logprob_diff": total["sampler_diff"] * args.ppo_epochs / tokens,
    }


def update_reference(ref_model, model, step: int, args: Args):
    """--reference's update after optimizer step `step`, on this rank's shards."""
    update = REFERENCES[args.reference]
    if update is None:  # a moving reference always has its model: check_args refuses one with --beta 0 or LoRA
        return
    with torch.no_grad():
        for ref, policy in zip(ref_model.parameters(), model.parameters()):
            update(local(ref), local(policy), step, ref_ema=args.ref_ema, ref_reset_every=args.ref_reset_every)


def load_reference(path, args: Args, device, empty=False):
    """The KL reference; a frozen one under bf16 keeps its linears in bf16 (an EMA step would round away)."""
    ref_model = load_model(path, torch.float32, device, empty, host=dist.is_initialized())
    ref_model = ref_model.eval().requires_grad_(False)
    if args.dtype == "bfloat16" and not dist.is_initialized() and REFERENCES[args.reference] is None:
        store_linears_bf16(ref_model)  # FSDP2 wants one dtype per sharded layer
    return compile_layers(ref_model) if args.compile else ref_model


def load_models(args: Args, ckpt, init_path, device):
    """Tokenizer, float32 policy (`ckpt` on resume), reference; under torchrun rank 0 alone reads the weights, into
    host memory (shard() sends each rank its shards: no GPU holds a whole float32 copy)."""
    empty = dist.is_initialized() and dist.get_rank() > 0
    bf16 = args.dtype == "bfloat16"
    # LoRA: the base, which a checkpoint does not hold, is --model's (the checkpoint: the merged policy)
    weights = init_path if args.lora_rank else ckpt or init_path
    try:
        tokenizer = load_tokenizer(ckpt or init_path)
        model = load_model(weights, torch.float32, device, empty, host=dist.is_initialized())
    except Exception as err:  # whatever a damaged file raises
        if ckpt is None:
            raise
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: {first_line(err, limit=200)}") from None
    if args.pack and (error := packing_error(model)):  # before a step attends across sequences
        raise ModelLoadError(error)
    # before shard(): FSDP2 must wrap the checkpointed layers
    configure_backward(model, bf16=bf16, checkpointing=args.grad_checkpointing, compiled=args.compile)
    if args.lora_rank:  # the reference is this model with its adapters off (ppo_update), as TRL's
        from peft import LoraConfig, get_peft_model

        if error := lora_error(model, args):  # before peft, which fails late, unclearly or not at all
            raise ModelLoadError(error)
        lora = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, target_modules=args.lora_targets.split(","))
        model = get_peft_model(model, lora)
    ref_model = load_reference(init_path, args, device, empty) if args.beta > 0 and not args.lora_rank else None
    if dist.is_initialized():
        model = shard(model, device, bf16=bf16)
        ref_model = shard(ref_model, device, bf16=bf16) if ref_model is not None else None
    if args.lora_rank and args.beta > 0:
        ref_model = model  # the policy with its adapters off (ppo_update)
    return tokenizer, model, ref_model


def lora_error(model, args: Args) -> str | None:
    """Why --lora-targets or --lora-rank cannot adapt `model`, as one line, or None. A target is matched as peft
    matches it; each module it names must be a linear layer whose weight is its own (a tied head would come apart
    from its embedding at the first sync) and at least --lora-rank wide."""
    tied = {name.removesuffix(".weight") for name in tied_names(model)}
    given = f"--lora-targets {args.lora_targets}"
    for target in args.lora_targets.split(","):
        found = [(name, m) for name, m in model.named_modules() if name == target or name.endswith(f".{target}")]
        if not found:  # peft fails only when no target matches, and adapts the others silently
            return f"{given}: the model has no module {target!r}"
        for name, module in found:
            if not isinstance(module, torch.nn.Linear):
                return f"{given}: {name} is a {type(module).__name__}, not a linear layer, which LoRA here adapts"
            if name in tied:
                return f"{given}: {name}'s weight is tied to the embedding, which adapting it alone would untie"
            width = min(module.in_features, module.out_features)
            if args.lora_rank > width:  # B A would have more rank than the layer it adds to
                return f"--lora-rank {args.lora_rank} is above the width of {name} ({width}): pass at most {width}"
    return None


def make_optimizer(model, args: Args):
    """AdamW; fused except on FSDP2's sharded parameters."""
    fused = not dist.is_initialized()
    return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, fused=fused)


def make_scheduler(optimizer, args: Args):
    """Linear warmup (Appendix B.1), then constant, or a cosine to --min-lr-ratio x --lr at the last optimizer step."""
    warmup = args.warmup_steps
    low = args.min_lr_ratio
    span = max(1, args.steps * args.ppo_epochs * args.minibatches - 1 - warmup)  # optimizer steps the cosine spans

    def lr_factor(s: int) -> float:
        """--lr's multiplier at optimizer step `s`."""
        if s < warmup:
            return (s + 1) / warmup  # at most 1: s + 1 <= warmup
        if args.lr_schedule != "cosine":
            return 1.0
        progress = min(1.0, (s - warmup) / span)
        return low + (1 - low) * (1 + math.cos(math.pi * progress)) / 2

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


def evaluate_held_out(sampler, eval_sets, args: Args, rank: int, world: int, device, samples, step) -> dict:
    """Each held-out set's scores at `step`, each rank a block of rows."""
    scores, records = {}, []
    for name, (task, rows) in eval_sets.items():
        size = -(-len(rows) // world)
        first = rank * size
        mine = rows[first : first + size]
        seed = eval_seed(args.seed, step)
        reward_kind = "exact" if task.has_verifier else "sim"
        result = evaluate(
            sampler,
            task,
            mine,
            samples=args.eval_samples,
            max_tokens=args.max_tokens,
            seed=seed,
            first=first,
            reward_kind=reward_kind,
            temperature=args.eval_temperature,
            top_p=args.eval_top_p,
            progress=rank == 0,
            options=reward_options(args.max_tokens, args.overlong_buffer, args.reward_model),  # as the rollouts'
        )
        records.append(result["examples"])
        if len(eval_sets) > 1:  # one eval-STEP.jsonl for all sets: each row names its own
            records[-1] = [{"set": name, **r} for r in result["examples"]]
        summary = result["summary"]
        greedy = summary.get("pass@1", summary.get("sim_reward", 0.0))  # a verifier's pass@1, else similarity
        score, n = all_reduce_sum([greedy * summary["n"], summary["n"]], device)
        scores["eval/score" if name == args.task else f"eval/{name}/greedy"] = score / max(n, 1)
        if args.eval_samples:
            rewards = gather_samples(result["examples"], "reward", size, args.eval_samples, device)  # (n, K)
            passed = gather_samples(result["examples"], "passed", size, args.eval_samples, device).bool()
            found = sampled_scores(rewards.tolist(), passed.tolist() if task.has_verifier else None)
            passes = found.pop("pass@k", {})
            scores.update({f"eval/{name}/{k}": v for k, v in found.items()})
            scores.update({f"eval/{name}/pass@{k}": v for k, v in passes.items()})
    samples.write_eval(step, *records)
    return scores


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # Slurm's time limit, a preemption: as a Ctrl-C
    cli_args = parse_args()
    master = int(os.environ.get("RANK", 0)) == 0  # one rank prints what all of them meet
    if cli_args.plan:
        from tools.memory_plan import print_plan

        sys.exit(print_plan(cli_args))
    try:
        main(cli_args)
    except KeyboardInterrupt:  # a save is atomic: the newest checkpoint is whole
        if master:
            print(f"train.py: interrupted; {resume_hint(run_dir(cli_args))}", file=sys.stderr)
        sys.exit(130)
    except (CheckpointError, DataError, ModelLoadError, SamplingError, SyncError, WriteError) as err:
        if master or isinstance(err, SamplingError):  # each rank checks its own memory
            print(f"train.py: error: {err}", file=sys.stderr)
        sys.exit(2 if isinstance(err, ModelLoadError) else 1)
    if "RANK" in os.environ:  # the run is over and saved: skip C++ teardown, where a gloo thread once aborted a rank
        sys.stdout.flush()
        os._exit(0)
