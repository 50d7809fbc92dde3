"""SoftmaxGRPO training (Section 4, Appendix B.1): sample a group, score it, softmax advantages, PPO-clip.

Each step: M completions per prompt from the colocated sampler, scored (rollout.py: ROLLOUTS[--rollout]; `dapo`
refills the groups without signal) -> group advantages (advantage.py; `--advantage softmax` is Eq. 1) -> PPO-clip +
reference-KL loss (loss.py) over minibatches -> AdamW step -> weights into the sampler -> sampler/trainer agreement
check -> metrics. Around the loop: config.py (flags), the stage files, plumbing/ (FSDP2, checkpoints, the run log)
and speed/.

    python train.py                                   # CPU demo: SmolLM2-135M learns arith, eval before/after
    python train.py --advantage grpo                  # the same demo with GRPO's advantages
    python train.py --task gsm8k                      # Table B.1 preset: Qwen2.5-1.5B, M=8, tau=0.1
    torchrun --nproc_per_node 8 train.py --task countdown                 # one node, FSDP2
    torchrun --nnodes 2 --nproc_per_node 8 --node_rank R --master_addr HOST --master_port 29500 \
        train.py --task deepmath                      # two nodes, as Table B.1's DeepMath run
    python train.py --task gsm8k --resume runs/gsm8k-softmax-s0           # continue from the newest checkpoint
    python train.py --help                            # every flag, with its default (config.py)

How this departs from the paper's VeRL runs (colocated sampler, bf16 master weights, warmup, eval cadence):
docs/training.md, "Departures from the paper".
"""

import os
import sys
import time
from dataclasses import asdict
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.nn.utils.rnn import pad_sequence
from tqdm import tqdm

import config
from advantage import compute_advantages
from config import Args, check_args, parse_args
from grad_alloc import allocation_metrics
from loss import REFERENCES, ROW_FILTERS, Share, TokenMean, loss_denominator, pad_batch, policy_loss, sequence_logprobs
from plumbing import run_log
from plumbing.checkpoint import (
    CheckpointError,
    changed_flags,
    find_checkpoint,
    kept_rng_state,
    load_checkpoint,
    remove_orphans,
    resume_hint,
    save_checkpoint,
)
from plumbing.checks import no_room_error, sampling_memory_error
from plumbing.cli import first_line
from plumbing.data import load_data
from plumbing.eval_sets import gather_samples, load_eval_sets
from plumbing.files import AppendError
from plumbing.models import ModelLoadError, SamplingError, load_model, load_tokenizer
from plumbing.parallel import all_reduce_sum, full_weights, init_distributed, local, shard
from plumbing.run_folder import RunFolderError, lock_run_folder, run_folder_error
from plumbing.sync import SyncError, check_sync, check_weights, weight_checksums
from speed.allocator import release_freed_memory
from speed.backward import configure_backward, store_linears_bf16
from speed.compile import compile_layers
from speed.micro_batches import micro_batch_rows
from tasks import DataError


# ---------------------------------------------------------------- main: the run, then the step loop (helpers below)
def main(args: Args, checked: bool = False) -> dict:
    """One run, holding its run folder until it ends (a second run there stops at once); `checked`: by parse_args."""
    if not checked and (error := check_args(args)):
        raise ValueError(error)
    out, resumed = config.run_dir(args), find_checkpoint(args.resume) if args.resume else None
    lock = lock_run_folder(out, hold=int(os.environ.get("RANK", 0)) == 0)  # rank 0 holds it for all
    try:  # held, the folder is checked again: a run that ended after check_args may have left its metrics there
        if lock.handle is not None and (error := run_folder_error(out, resumed)):
            raise RunFolderError(error)
        return train(args)
    finally:
        lock.release()


def train(args: Args) -> dict:
    from plumbing.prompts import encode_prompts
    from rollout import ROLLOUTS, make_sampler, resolve_model, sync_check
    from tasks import TASKS, get_task, reward_weights

    # ---- setup: derived values, processes, data, models, sampler, log, held-out score before training
    out_dir, cuda, args = config.run_dir(args), torch.cuda.is_available(), config.resolve_auto(args)
    distributed, rank, world, device = init_distributed(args.seed, args.dist_timeout_s)
    master = rank == 0
    remove_orphans(out_dir, master)  # what killed saves left, with a note
    task = get_task(args.task)
    weights = reward_weights(task, args.reward, args.reward_weights)  # {term: weight}, r = sum_k w_k r_k
    train_set, test_set = load_data(args, task, weights, master)
    eval_sets = load_eval_sets(args, task, test_set, TASKS)  # {name: (task, rows)}: its own, then --eval-tasks'
    ckpt, init_path = find_checkpoint(args.resume) if args.resume else None, resolve_model(args.model)
    if ckpt and master and (changed := changed_flags(ckpt, asdict(args))):  # each applies from here on
        print(f"resume: continuing {ckpt} with changed flags: {changed}")
    tokenizer, model, ref_model = load_models(args, ckpt, init_path, device)
    moving_ref = ref_model if REFERENCES[args.reference] else None  # --reference: checkpointed with the policy
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    optimizer = make_optimizer(model, args)
    scheduler = make_scheduler(optimizer, args)
    start_step = load_checkpoint(ckpt, model, optimizer, scheduler, rank, args.lr, args.weight_decay,
                                 moving_ref) if ckpt else 0
    n_params = run_log.model_flops_per_token(model)
    n_forwards = 1 + 3 * args.ppo_epochs + (ref_model is not None) + (not reuses_training_logprobs(args))
    if error := no_room_error(args.max_tokens, model.config.max_position_embeddings):  # a hub model's, known now
        raise DataError(error)
    room = model.config.max_position_embeddings - args.max_tokens  # the longest prompt the context holds
    train_ids, test_ids = (encode_prompts(tokenizer, rows, max_len=room)
                           for rows in (train_set, [ex for _, rows in eval_sets.values() for ex in rows]))
    max_prompt = max(len(p) for p in train_ids + test_ids)
    if error := sampling_memory_error(args, model.config, max_prompt, world, device):  # before a batch asks for it
        raise SamplingError(error)
    memory = run_log.PhaseMemory(device)  # per phase, this rank's GPU memory (CUDA only), the engine's told apart
    with kept_rng_state():  # vLLM seeds the global RNGs: load_checkpoint's (or init_distributed's) states stay
        sampler = memory.build(make_sampler, args.sampler, ckpt or init_path, dtype=args.dtype, device=device,
                               max_model_len=max_prompt + args.max_tokens, seed=args.seed + rank,
                               gpu_memory_utilization=args.gpu_memory_utilization,  # its own copy of the policy
                               max_num_seqs=args.max_num_seqs or args.rollout_batch // world * args.M)
    probe_prompts = train_ids[:4]  # the same probe at every check: a sampler that never updates repeats itself
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")
    with autocast:
        probe = sync_check(sampler, model, probe_prompts)
    check_sync(probe, None, start_step, args.sync_tolerance, device)  # the sampler loaded the same weights
    log = run_log.MetricsLog(out_dir, start_step, args, master)
    samples = run_log.SampleLog(out_dir, start_step, args.log_completions, master)  # completions, eval-STEP.jsonl
    held_out = partial(evaluate_held_out, sampler, eval_sets, args, rank, world, device, samples)  # (step) -> dict
    evals = run_log.read_evals(out_dir) if ckpt else {}  # a resumed run keeps its "before" score
    if eval_sets and start_step == 0:
        run_log.add_eval(evals, "before", held_out(0))
        run_log.report_eval(evals, out_dir, task, len(test_set), master)

    metrics, n_local = {}, args.rollout_batch // world
    rollout_step = partial(ROLLOUTS[args.rollout], sampler=sampler, task=task, train_set=train_set,
                           train_ids=train_ids, weights=weights, args=args, rank=rank, world=world, device=device)
    bar = tqdm(range(start_step, args.steps), initial=start_step, total=args.steps, disable=not master,
               desc=f"{args.advantage} on {args.task}")
    for step in bar:
        t0 = time.perf_counter()
        memory.start()
        # -- rollout: this rank's G_local prompts, M samples each, scored and gathered (rollout.py: ROLLOUTS)
        batch = rollout_step(step)
        examples, prompts, groups, rollout = batch.examples, batch.prompts, batch.groups, batch.scores  # (G, M) each
        memory.sleep(sampler)  # its weights are dead until the sync: their memory goes to training
        if not cuda:  # and sampling's free pages back to the OS, so training starts from a compact heap
            release_freed_memory()
        t1 = time.perf_counter()
        memory.end("rollout")
        # -- advantages over the gathered batch, so batch-level baselines see all of it
        adv_all = compute_advantages(args.advantage, rollout["rewards"], **config.estimator_hparams(args))  # Eq. (1)
        cut = rollout["cut"].bool()  # (G, M): which samples the loss keeps, from the whole batch (loss.py)
        keep = ROW_FILTERS[args.row_filter](rollout["rewards"], cut) & (~cut if args.mask_truncated else True)
        adv, keep = (t[rank * n_local:(rank + 1) * n_local].reshape(-1) for t in (adv_all, keep.expand_as(cut)))
        t2 = time.perf_counter()
        # -- train
        flat = [(p, c) for p, g in zip(prompts, groups) for c in g]
        train_metrics = ppo_update(model, ref_model, optimizer, scheduler, [p for p, _ in flat],
                                   [c.token_ids for _, c in flat], [c.logprobs for _, c in flat], adv, args, pad_id,
                                   keep=keep)
        t3 = time.perf_counter()
        memory.end("train")
        # -- weight sync and check: the sampler must now compute the trainer's log-probs
        sampler.update_weights(full_weights(model))  # streamed; wakes a sleeping engine in two steps around it
        checksums = weight_checksums(sampler, model, step + 1, args.weight_check_every)  # per family; None: not due
        with autocast:
            probe, before = sync_check(sampler, model, probe_prompts), probe
        t4 = time.perf_counter()
        memory.end("sync")
        # -- log and checkpoint: the same numbers on every rank, written by rank 0
        tokens = all_reduce_sum([sum(map(len, prompts)) * args.M, sum(len(c.token_ids) for g in groups for c in g)],
                                device)  # prompt, completion
        times = {"rollout": t1 - t0, "reward": t2 - t1, "train": t3 - t2, "sync": t4 - t3, "step": t4 - t0}
        metrics = {**run_log.step_metrics(step, task.has_verifier, rollout, adv_all, train_metrics, times, tokens,
                                          n_params, n_forwards), **batch.metrics,  # and Table 3 for the estimators:
                   **allocation_metrics(rollout["rewards"], rollout["lengths"], config.alloc_estimators(args),
                                        must=args.advantage, **config.estimator_hparams(args))}  # --alloc-estimators
        samples.write(step + 1, task, examples, groups, rollout, adv_all, rank)
        metrics.update(memory.metrics())  # each rank's own GPU memory, per phase (CUDA only)
        if eval_sets and args.eval_every and (step + 1) % args.eval_every == 0:  # absolute steps: resume keeps them
            t5 = time.perf_counter()
            metrics.update(held_out(step + 1))  # eval/score (greedy), eval/SET/... (--eval-samples, --eval-tasks)
            metrics["time/eval"] = time.perf_counter() - t5
        try:  # the step's metrics reach the log either way; a failed check saves no checkpoint
            metrics.update(check_sync(probe, before, step + 1, args.sync_tolerance, device))
            metrics.update(check_weights(checksums, step + 1, device))  # {} when not checking
        finally:
            log.write(metrics)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}")
        if args.save_every and (step + 1) % args.save_every == 0 or step + 1 == args.steps and args.final_save:
            save_checkpoint(out_dir, step + 1, model, optimizer, scheduler, tokenizer, args,  # --keep-checkpoints
                            moving_ref)

    # ---- the end: held-out score after training, curves, cleanup
    if eval_sets:  # a score of the last step is this one: the same weights, greedy
        run_log.add_eval(evals, "after", run_log.eval_metrics(metrics) or held_out(args.steps))
        metrics.update({f"eval/{k}": v for k, v in evals.items() if k in ("before", "after")})
        run_log.report_eval(evals, out_dir, task, len(test_set), master)
    if master and os.path.exists(log.path):  # the curves: tools/ sits above plumbing/, so train.py draws them
        try:  # after the final save: a machine without matplotlib still ends its run, with the curves left to draw
            from tools.figures import plot_training_curves
        except ImportError as err:
            print(f"curves: skipped ({err}); draw them elsewhere: python -m tools.figures curves {log.path}")
        else:
            print(f"curves: {plot_training_curves([log.path], os.path.join(out_dir, 'curves.png'))}")
    log.finish()
    if distributed:
        dist.barrier()  # leave together: a rank tearing down gloo while another still works can abort it
    sampler.close()  # before the process group: a vLLM engine under torchrun shuts it down itself
    if dist.is_initialized():
        dist.destroy_process_group()
    return metrics


# ---------------------------------------------------------------- the PPO update (Section 4)
def reuses_training_logprobs(args: Args) -> bool:
    """One epoch, one minibatch: nothing has moved since sampling, so pi_old recomputed by the trainer equals
    logp of the training forward; logp.detach() stands in for it and saves a forward pass
    (tests/test_train.py::test_on_policy_shortcut_equals_recomputing_old_logprobs)."""
    return args.ppo_epochs == 1 and args.minibatches == 1


def ppo_update(model, ref_model, optimizer, scheduler, prompts, completions, sampler_logps, adv, args, pad_id,
               keep=None):
    """PPO epochs over minibatches of this rank's sequences, one optimizer step per minibatch (Section 4).
    `keep` (bool per sequence; None keeps all): False takes a sequence out of the loss and its denominator.

    Loss denominator (`--loss-agg`, loss.AGGREGATIONS; token-mean in Appendix B.1): summed over every
    micro-batch of the optimizer minibatch on all ranks before the first backward, so neither the micro-batch
    size nor the number of ranks changes the loss. FSDP averages gradients over ranks, so each rank's loss
    is multiplied by the world size.
    """
    distributed = dist.is_initialized()  # also in one process, when vLLM made its own process group
    sharded = isinstance(model, FSDPModule)  # shard() ran: torchrun's FSDP2, the mode of every rank
    device, world = next(model.parameters()).device, dist.get_world_size() if distributed else 1
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")
    per_minibatch = len(prompts) // args.minibatches
    minibatches = []
    for start in range(0, len(prompts), per_minibatch):
        micro = []
        for idx in micro_batch_rows(prompts, completions, range(start, start + per_minibatch), args.micro_batch):
            input_ids, attention_mask, mask = pad_batch([prompts[i] for i in idx], [completions[i] for i in idx],
                                                        pad_id)  # (B, P+K) x2, (B, K)
            sampler_logp = pad_sequence([torch.tensor(sampler_logps[i]) for i in idx], batch_first=True)  # (B, K)
            if keep is not None and not keep.all():  # zero loss weight, out of every denominator (loss.py)
                mask = mask * keep[idx].to(mask.dtype)[:, None]
            micro.append(dict(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                              mask=mask.to(device), adv=adv[idx].to(device), sampler_logp=sampler_logp.to(device)))
        minibatches.append(micro)
    on_policy = reuses_training_logprobs(args)
    with torch.no_grad(), autocast:
        for mb in (mb for micro in minibatches for mb in micro):
            inputs = (mb["input_ids"], mb["attention_mask"], mb["mask"].shape[1], args.temperature)
            mb["ref_logp"] = sequence_logprobs(ref_model, *inputs) if ref_model is not None else None
            mb["old_logp"] = None if on_policy else sequence_logprobs(model, *inputs)
    sums = dict.fromkeys(["tokens", "entropy", "sampler_diff", "grad_norm"], 0.0)
    kinds = {}  # loss/NAME: Share or TokenMean, as policy_loss returned it; its sum is in sums[loss/NAME]
    options = config.loss_options(args)  # every loss flag, by name: --clip-low, --beta, --kl-estimator, ...
    for epoch in range(args.ppo_epochs):
        for micro in minibatches:
            denominator = torch.stack([loss_denominator(mb["mask"], args.loss_agg, args.max_tokens)
                                       for mb in micro]).sum()  # this rank's share
            if distributed:
                dist.all_reduce(denominator)  # the whole minibatch's: one shared denominator
            for i, mb in enumerate(micro):
                if sharded:  # FSDP2: reduce-scatter the gradients once per minibatch, after its last micro-batch
                    model.set_requires_gradient_sync(i == len(micro) - 1)
                with autocast:
                    logp, entropy = sequence_logprobs(model, mb["input_ids"], mb["attention_mask"],
                                                      mb["mask"].shape[1], args.temperature, entropy=True,
                                                      entropy_grad=args.entropy_coef != 0)  # (B, K) each
                old_logp = logp.detach() if on_policy else mb["old_logp"]
                loss, m = policy_loss(logp, old_logp, mb["adv"], mb["mask"], ref_logp=mb["ref_logp"],
                                      sampler_logp=mb["sampler_logp"], entropy=entropy, denominator=denominator,
                                      norm_len=args.max_tokens, **options)
                (loss * world).backward()
                n = mb["mask"].sum().item()
                sums["entropy"] += (entropy.detach() * mb["mask"]).sum().item()  # policy/entropy: a token mean
                for key, value in m.items():  # each of policy_loss's metrics, reduced as it says: loss/KEY
                    if type(value) not in (Share, TokenMean):
                        raise TypeError(f"policy_loss metric {key!r} must be a loss.Share or a loss.TokenMean")
                    kinds[f"loss/{key}"] = type(value)
                    sums[f"loss/{key}"] = sums.get(f"loss/{key}", 0.0) + (value if type(value) is Share else value * n)
                sums["tokens"] += n
                if epoch == 0:  # sampler vs trainer log-probs of the same tokens, before any update
                    sums["sampler_diff"] += ((old_logp - mb["sampler_logp"]).abs() * mb["mask"]).sum().item()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            sums["grad_norm"] += float(grad_norm.full_tensor() if sharded else grad_norm)  # FSDP2: a DTensor
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            update_reference(ref_model, model, scheduler.last_epoch, args)  # --reference (REFERENCES)
            optimizer.zero_grad(set_to_none=True)
    total = dict(zip(sums, all_reduce_sum(list(sums.values()), device)))
    updates, tokens = args.ppo_epochs * len(minibatches), max(total["tokens"], 1)
    return {**{key: total[key] / (updates if kind is Share else tokens) for key, kind in kinds.items()},
            "policy/entropy": total["entropy"] / tokens,
            "grad/norm": total["grad_norm"] / (updates * world),  # the same on every rank: undo the sum
            "lr": lr, "sync/rollout_logprob_diff": total["sampler_diff"] * args.ppo_epochs / tokens}


# ---------------------------------------------------------------- setup
def update_reference(ref_model, model, step: int, args: Args):
    """After optimizer step `step`, the --reference entry (loss.py: REFERENCES) on each pair of parameters, this
    rank's shards (FSDP2 shards the two models alike); a moving reference is checkpointed with the policy."""
    if (update := REFERENCES[args.reference]) is None or ref_model is None:
        return
    with torch.no_grad():
        for ref, policy in zip(ref_model.parameters(), model.parameters()):
            update(local(ref), local(policy), step, ref_ema=args.ref_ema, ref_reset_every=args.ref_reset_every)


def load_reference(path, args: Args, device):
    """The reference policy for the KL term, in no-grad mode. Frozen under bf16, its linears are stored in bf16;
    a moving one stays float32, so that a small EMA step does not round away."""
    ref_model = load_model(path, torch.float32, device).eval().requires_grad_(False)
    if args.dtype == "bfloat16" and not dist.is_initialized() and REFERENCES[args.reference] is None:
        store_linears_bf16(ref_model)  # FSDP2 wants one dtype per sharded layer
    return compile_layers(ref_model) if args.compile else ref_model


def load_models(args: Args, ckpt, init_path, device):
    """Tokenizer, policy (float32 master weights; `ckpt` on resume), frozen reference (the initial model)."""
    try:
        tokenizer = load_tokenizer(ckpt or init_path)
        model = load_model(ckpt or init_path, torch.float32, device)
    except Exception as err:  # OSError, SafetensorError, ...: whatever a damaged file raises
        if ckpt is None:
            raise
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: {first_line(err, limit=200)}") from None
    # what backward keeps (speed/backward.py), before shard(): FSDP2 must wrap the checkpointed layers
    configure_backward(model, bf16=args.dtype == "bfloat16", checkpointing=args.grad_checkpointing,
                       compiled=args.compile)
    ref_model = load_reference(init_path, args, device) if args.beta > 0 else None
    if dist.is_initialized():  # FSDP2; under bf16 it gathers and computes the layers in bf16 (plumbing/parallel.py)
        model = shard(model, device, bf16=args.dtype == "bfloat16")
        ref_model = shard(ref_model, device, bf16=args.dtype == "bfloat16") if ref_model is not None else None
    return tokenizer, model, ref_model


def make_optimizer(model, args: Args):
    """AdamW over float32 master weights; fused (one kernel per step) except on FSDP2's sharded parameters."""
    return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                             fused=not dist.is_initialized())


def make_scheduler(optimizer, args: Args):
    return torch.optim.lr_scheduler.LambdaLR(  # linear warmup, then constant (Appendix B.1)
        optimizer, lambda s: min(1.0, (s + 1) / args.warmup_steps) if args.warmup_steps else 1.0)


def evaluate_held_out(sampler, eval_sets, args: Args, rank: int, world: int, device, samples, step) -> dict:
    """Each held-out set scored at `step`: greedy pass@1 (similarity without a verifier) as eval/score for the task's
    own and eval/SET/greedy for --eval-tasks', and with --eval-samples K, eval/SET/mean@K with its 95% interval and
    eval/SET/pass@k (eval.sampled_scores, as eval.py). Each rank scores a contiguous block of each set, drawing the
    samples one process would (eval.eval_seed); the blocks gather in order. Generations: eval-STEP.jsonl."""
    from eval import eval_seed, evaluate, sampled_scores

    scores, records = {}, []
    for name, (task, rows) in eval_sets.items():
        size = -(-len(rows) // world)  # ceil: rank r scores rows [r * size, (r + 1) * size)
        result = evaluate(sampler, task, rows[rank * size:(rank + 1) * size], samples=args.eval_samples,
                          max_tokens=args.max_tokens, seed=eval_seed(args.seed, step), first=rank * size,
                          reward_kind="exact" if task.has_verifier else "sim", temperature=args.eval_temperature,
                          top_p=args.eval_top_p, progress=rank == 0)
        records.append([{"set": name, **r} for r in result["examples"]] if len(eval_sets) > 1 else result["examples"])
        summary = result["summary"]
        score, n = all_reduce_sum([summary.get("pass@1", summary.get("sim_reward", 0.0)) * summary["n"],
                                   summary["n"]], device)
        scores["eval/score" if name == args.task else f"eval/{name}/greedy"] = score / max(n, 1)
        if args.eval_samples:  # every prompt's K rewards and passes, all ranks' blocks in the set's order
            rewards = gather_samples(result["examples"], "reward", size, args.eval_samples, device)  # (n, K)
            passed = gather_samples(result["examples"], "passed", size, args.eval_samples, device).bool()
            found = sampled_scores(rewards.tolist(), passed.tolist() if task.has_verifier else None)
            scores.update({f"eval/{name}/{k}": v for k, v in found.items() if k != "pass@k"})
            scores.update({f"eval/{name}/pass@{k}": v for k, v in found.get("pass@k", {}).items()})
    samples.write_eval(step, *records)
    return scores


# ---------------------------------------------------------------- command line (flags: config.py)
if __name__ == "__main__":
    cli_args = parse_args()
    if cli_args.plan:  # one rank's GPU memory for these flags, and exit
        from tools.memory_plan import print_plan
        sys.exit(print_plan(cli_args))
    try:
        main(cli_args, checked=True)
    except KeyboardInterrupt:  # Ctrl-C: a save is atomic, so the newest complete checkpoint is whole
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"train.py: interrupted; {resume_hint(config.run_dir(cli_args))}", file=sys.stderr)
        sys.exit(130)
    except (AppendError, CheckpointError, DataError, ModelLoadError, RunFolderError, SamplingError, SyncError) as err:
        # One line, from one rank (a sampling error is that rank's own); an unloadable model exits 2 as in eval.py.
        if int(os.environ.get("RANK", 0)) == 0 or isinstance(err, SamplingError):
            print(f"train.py: error: {err}", file=sys.stderr)
        sys.exit(2 if isinstance(err, ModelLoadError) else 1)
