"""train.py's command line: Args (one field per flag, each with its default and help), the paper's presets
(Appendix B.1, Tables B.1-B.2) and check_args, which turns a bad flag into one line (its rules: plumbing/checks.py).

Estimator hyperparameters (`--tau`, `--eps`, ...) and the loss's options (`--clip-low`, `--beta`, `--ratio`, ...) are
not listed here: Args gets one field per entry of advantage.estimator_params() and one per option of
loss.policy_loss (`loss_options`), so a new hyperparameter or loss option is a flag without editing this file.

    python train.py --help
"""

import argparse
import inspect
import os
from dataclasses import asdict, dataclass, field, fields, make_dataclass, replace

import torch

from advantage import ESTIMATORS, compute_advantages, estimator_params, hyperparameter_ranges, hyperparameters
from loss import OPTION_CHOICES, REFERENCES, ROW_FILTERS, policy_loss
from plumbing import checks
from plumbing.checkpoint import find_checkpoint, resume_error
from plumbing.cli import OneLineParser, first_line, option_help
from plumbing.eval_sets import parse_eval_tasks
from plumbing.models import has_bf16_units
from plumbing.run_folder import run_dir, run_folder_error  # noqa: F401 (config.run_dir)
from plumbing.sync import SYNC_TOLERANCE
from rewards import REWARD_TERMS


def arg(default, help):
    return field(default=default, metadata={"help": help})


@dataclass
class _Args:
    task: str = arg("arith", "task name (tasks.py); also picks the preset of PRESETS")
    model: str = arg("smollm2-135m", "initial policy: HF folder, hub id or embedded alias (plumbing/models.py)")
    data_file: str = arg("", "local data file for the task instead of the hub dataset")
    reward: str = arg("exact", "exact: the task's verifier; sim: similarity to the demonstration (B.5)")
    reward_weights: str = arg("", "weighted reward terms instead of --reward alone, e.g. format=0.35,sim=0.65 "
                              "(exact, the verifier, or rewards.py: REWARD_TERMS); each logged as reward/TERM")
    demo_file: str = arg("", "countdown --reward sim: a local copy of HuggingFaceTB/Countdown-Task-GOLD's "
                         "demonstrations (same columns), joined to the puzzles by nums and target")
    advantage: str = arg("softmax", f"group advantage estimator: {', '.join(ESTIMATORS)}")
    M: int = arg(8, "rollouts per prompt (group size)")
    rollout_batch: int = arg(4, "prompts per step, over all ranks")
    micro_batch: int = arg(8, "sequences per forward/backward pass on one rank (gradient accumulation)")
    minibatches: int = arg(1, "optimizer steps per rollout batch and PPO epoch")
    ppo_epochs: int = arg(1, "passes over each rollout batch")
    steps: int = arg(20, "training steps (rollout batches)")
    max_tokens: int = arg(48, "max response tokens")
    temperature: float = arg(1.0, "rollout sampling temperature")
    top_p: float = arg(1.0, "rollout nucleus sampling; the paper presets use the official configs' 0.999, and the "
                       "sampler's log-probs renormalise over the nucleus while the trainer's span the whole "
                       "vocabulary, so sync/rollout_logprob_diff reads up to ~1e-3 by construction there")
    lr: float = arg(2e-5, "AdamW learning rate")
    warmup_steps: int = arg(2, "linear learning-rate warmup, in optimizer steps")
    weight_decay: float = arg(0.01, "AdamW weight decay")
    max_grad_norm: float = arg(1.0, "gradient clipping")
    reference: str = arg("frozen", "the KL term's reference policy (loss.py: REFERENCES): frozen, the initial "
                         "model (the paper's); ema, moved toward the policy after each optimizer step by --ref-ema; "
                         "reset, set to the policy every --ref-reset-every optimizer steps; a moving one is "
                         "checkpointed")
    ref_ema: float = arg(0.0, "--reference ema: ref <- (1 - ALPHA) ref + ALPHA policy, ALPHA in (0, 1]")
    ref_reset_every: int = arg(0, "--reference reset: ref <- policy every N optimizer steps")
    mask_truncated: bool = arg(False, "completions cut at --max-tokens get no loss weight and leave the loss "
                               "denominator (DAPO's overlong filtering); they still count in their group's "
                               "advantages")
    row_filter: str = arg("none", "mask-only batch filter (loss.py: ROW_FILTERS): the samples it drops get no loss "
                          "weight and leave the loss denominator, so the batch shrinks; they still count in their "
                          "group's advantages")
    rollout: str = arg("plain", "how a step fills its batch (rollout.py: ROLLOUTS): plain, the paper's; dapo, DAPO's "
                       "dynamic sampling: groups of equal rewards are dropped and refilled with new prompts")
    filter_std: float = arg(1e-6, "--rollout dapo: a group whose rewards' std is at most this has no signal")
    max_refill_rounds: int = arg(3, "--rollout dapo: at most this many extra rounds of --rollout-batch prompts per "
                                 "step (<= 15); past them the batch is topped up with zero-signal groups")
    overlong_buffer: int = arg(0, "the overlong reward term's L_cache (DAPO Eq. 13): its ramp's tokens below "
                               "--max-tokens; 0: a fifth of --max-tokens, DAPO's 4096 of 20480")
    dtype: str = arg("auto", "bfloat16 (autocast over float32 master weights), float32, or auto: bfloat16 where "
                     "the hardware has bf16 matrix units (GPUs, CPUs with AVX512-BF16/AMX), else float32")
    sampler: str = arg("auto", "auto (vllm on a GPU, where it must be installed; hf on CPU), hf or vllm")
    gpu_memory_utilization: float = arg(0.3, "vLLM's share of GPU memory")
    max_num_seqs: int = arg(0, "vLLM's max_num_seqs, the sequences it decodes at once (and captures CUDA graphs "
                            "for); 0: this rank's share of a step's samples, rollout_batch x M / ranks")
    sync_tolerance: float = arg(0.0, "stop when, after a weight sync, the sampler's probe log-probs differ from the "
                                "trainer's by more than this (mean over probe tokens, nats); 0: by precision, "
                                "plumbing/sync.py: SYNC_TOLERANCE")
    weight_check_every: int = arg(10, "every N steps after the sync, compare the engine's weights with the trainer's "
                                  "per family and stop naming one the sync missed (docs/sampler.md); 0: never")
    grad_checkpointing: bool = arg(False, "recompute each decoder layer in backward instead of keeping its "
                                   "activations, at a second forward per layer: on in the paper presets; off for "
                                   "the CPU demo, whose activations are small (docs/memory_plan.md)")
    compile: bool = arg(False, "torch.compile each decoder layer of the policy and the reference (speed/compile.py): "
                        "faster on CPU after a one-off compile, cached for later runs (docs/vs_trl.md); not "
                        "bit-identical to the eager layers (rounding only)")
    alloc_estimators: str = arg("", "Table 3's gradient allocation (alloc/EST/BIN) each step for these estimators "
                                "besides --advantage's: a comma list, or all; the paper presets log all")
    eval_every: int = arg(0, "greedy held-out score (eval/score in metrics.jsonl) every N steps; 0: only before and "
                          "after training; the paper presets use the official configs' 25")
    eval_examples: int = arg(64, "held-out prompts scored greedily before and after training and every "
                             "--eval-every steps (0: none)")
    eval_samples: int = arg(0, "K > 0: at each evaluation also sample every held-out prompt K times and log "
                            "eval/SET/mean@K with its 95 percent interval and eval/SET/pass@k (docs/eval.md); 0: "
                            "greedy only")
    eval_temperature: float = arg(0.6, "--eval-samples' sampling temperature (the official Qwen3 configs' 0.6)")
    eval_top_p: float = arg(1.0, "--eval-samples' nucleus")
    eval_tasks: str = arg("", "more held-out sets, each scored with its own verifier at every evaluation: a comma "
                          "list of tasks, each NAME (its hub dataset) or NAME=FILE (a local .jsonl/.parquet read "
                          "whole), e.g. math500,aime24=aime24.jsonl")
    seed: int = arg(0, "seed of data order and sampling")
    out_dir: str = arg("", "run folder (default runs/TASK-ADVANTAGE-sSEED)")
    save_every: int = arg(0, "checkpoint every N steps (0: only at the end)")
    final_save: bool = arg(True, "checkpoint at the last step; --no-final-save: only every --save-every steps, for "
                           "a run whose end nothing resumes (scripts/gpu_check.sh's resumed run)")
    keep_checkpoints: int = arg(0, "after each successful save keep only the newest K checkpoints (0: all); the "
                                "paper presets keep 2, as the official configs' max_actor_ckpt_to_keep")
    log_completions: int = arg(8, "each step, append up to N samples (prompt, completion, reward, advantage, ...) "
                               "to completions.jsonl in the run folder, and every evaluation's generations to "
                               "eval-STEP.jsonl (0: neither)")
    resume: str = arg("", "checkpoint folder, or run folder (its newest checkpoint), to continue from")
    resume_changed: bool = arg(False, "with --resume: continue although a flag of config.RESUME_KEEPS or the "
                               "estimator's hyperparameters differ from the checkpoint's (deliberately; never --model)")
    dist_timeout_s: float = arg(1800.0, "torchrun: seconds a rank waits in a collective before the run fails; it "
                                "must cover rank 0 writing a checkpoint's Hugging Face folder")
    wandb: bool = arg(False, "also log to Weights & Biases (if installed)")
    plan: bool = arg(False, "print one rank's GPU memory plan (tools/memory_plan.py) and exit; loads nothing")
    plan_gpus: int = arg(8, "--plan: ranks, one GPU each")
    plan_gpu_gb: float = arg(80.0, "--plan: memory per GPU, GiB")


HPARAM_HELP = {"tau": "SoftmaxGRPO temperature (Eq. 1)"}  # the others say which estimators read them


def _estimator_fields():
    for name, (default, kind) in estimator_params().items():
        users = [est for est, fn in ESTIMATORS.items() if name in hyperparameters(fn)]
        yield name, kind, arg(default, HPARAM_HELP.get(name, f"hyperparameter of --advantage {'/'.join(users)}"))


def loss_option_defaults() -> dict:
    """loss.policy_loss's options, {name: default}: its keyword-only parameters whose default is not None (the
    others, ref_logp, entropy, denominator, ..., are tensors and sizes train.py passes)."""
    return {p.name: p.default for p in inspect.signature(policy_loss).parameters.values()
            if p.kind is p.KEYWORD_ONLY and p.default is not None}


def _loss_option_help() -> dict:
    """{option: help} from policy_loss's docstring, its "Options" block (plumbing/cli.py: option_help)."""
    return option_help(policy_loss, loss_option_defaults())


def _loss_option_fields():
    helps = _loss_option_help()
    for name, default in loss_option_defaults().items():
        choices = f" (loss.py: {', '.join(OPTION_CHOICES[name])})" if name in OPTION_CHOICES else ""
        yield name, type(default), arg(default, helps.get(name, "an option of loss.policy_loss") + choices)


def loss_options(args) -> dict:
    """What ppo_update passes policy_loss: every option, by name, from the flags."""
    return {name: getattr(args, name) for name in loss_option_defaults()}


Args = make_dataclass("Args", [*_estimator_fields(), *_loss_option_fields()], bases=(_Args,))
Args.__module__, Args.__doc__ = __name__, ("train.py's flags: _Args's, then one per estimator hyperparameter and one "
                                           "per option of loss.policy_loss.")


def resolve_auto(args: Args) -> Args:
    """--dtype auto and --sampler auto made concrete for this machine."""
    if args.dtype == "auto":
        args = replace(args, dtype="bfloat16" if has_bf16_units() else "float32")
    if args.sampler == "auto":  # vLLM on a GPU (check_args stops a GPU run without it), HF generate on CPU
        args = replace(args, sampler="vllm" if torch.cuda.is_available() else "hf")
    if args.sync_tolerance == 0:
        args = replace(args, sync_tolerance=SYNC_TOLERANCE[args.dtype])
    return args


def alloc_estimators(args: Args) -> list[str]:
    """Whose Table 3 allocation train.py logs: all (in ESTIMATORS' order), or --advantage's and the named ones."""
    if args.alloc_estimators.strip() == "all":
        return list(ESTIMATORS)
    return list(dict.fromkeys([args.advantage, *filter(None, map(str.strip, args.alloc_estimators.split(",")))]))


def estimator_hparams(args: Args) -> dict:
    """Every estimator's hyperparameters, as given: compute_advantages hands each estimator its own."""
    return {name: getattr(args, name) for name in estimator_params()}


PAPER = dict(model="Qwen/Qwen2.5-1.5B", lr=1e-6, warmup_steps=0, save_every=100,
             eval_examples=500,  # Tables B.1-B.2: shared rows; then the official configs' (base.yaml) ...
             top_p=0.999, eval_every=25, grad_checkpointing=True,  # ... top_p, test_freq, gradient checkpointing,
             keep_checkpoints=2,  # ... and max_actor_ckpt_to_keep
             alloc_estimators="all")  # Table 3 for every estimator on the same rollouts
# micro_batch and gpu_memory_utilization: sized by tools/memory_plan.py for 80 GB GPUs (docs/memory_plan.md)
PRESETS = {  # explicit flags override these
    "arith": dict(alloc_estimators="all"),  # the CPU demo: the defaults above, and Table 3 for every estimator
    "countdown24": dict(max_tokens=128),
    "gsm8k": dict(PAPER, tau=0.1, M=8, rollout_batch=64, steps=1000, max_tokens=256,  # Table B.1
                  micro_batch=64, gpu_memory_utilization=0.12),
    "countdown": dict(PAPER, tau=0.1, M=8, rollout_batch=64, steps=2000, max_tokens=256,
                      micro_batch=64, gpu_memory_utilization=0.12),
    "deepmath": dict(PAPER, tau=0.3, M=16, rollout_batch=512, steps=3220, max_tokens=1024,
                     micro_batch=32, gpu_memory_utilization=0.45),
    "poetry": dict(PAPER, tau=0.3, M=8, rollout_batch=64, steps=1350, max_tokens=1024, reward="sim",  # B.2
                   micro_batch=32, gpu_memory_utilization=0.12),
    "meetingbank": dict(PAPER, tau=0.3, M=8, rollout_batch=512, steps=3220, max_tokens=4096, reward="sim",
                        micro_batch=8, gpu_memory_utilization=0.6),
    "openthoughts": dict(PAPER, tau=0.3, M=8, rollout_batch=512, steps=3220, max_tokens=6144, reward="sim",
                         reward_weights="format=0.35,sim=0.65",  # the official openthoughts reward
                         micro_batch=8, gpu_memory_utilization=0.78),
}


# What a resume keeps unless --resume-changed (with the estimator's own hyperparameters, --tau for softmax): the
# run's identity and its data stream. Every other flag applies from the resumed step on (train.py says which).
RESUME_KEEPS = ("task", "advantage", "M", "seed", "rollout_batch", "data_file")


def choices() -> dict:
    """Each string flag's registry, whose keys are its valid values: a fork's new entry is a valid value at once."""
    from rollout import ROLLOUTS, SAMPLERS  # imports transformers: only when checking

    return {"advantage": ESTIMATORS, "reward": ("exact", *REWARD_TERMS), **OPTION_CHOICES, "row_filter": ROW_FILTERS,
            "sampler": ("auto", *SAMPLERS), "dtype": ("auto", "bfloat16", "float32"), "rollout": ROLLOUTS,
            "reference": REFERENCES}


def check_args(args: Args) -> str | None:
    """The first problem with `args` as one line, or None; reads nothing but small files."""
    from rollout import MAX_REFILLS
    from tasks import TASKS, get_task, reward_weights

    try:
        task = get_task(args.task)
    except ValueError as err:
        return str(err)
    if error := checks.number_error(args, hyperparameter_ranges()) or checks.choice_error(args, choices()):
        return error
    world = args.plan_gpus if args.plan else int(os.environ.get("WORLD_SIZE", 1))  # --plan: the ranks it plans
    if error := (checks.train_flag_error(args, task=task, world=world, estimators=ESTIMATORS,
                                         alloc=alloc_estimators(args), max_refills=MAX_REFILLS,
                                         dapo_defaults=(_Args.filter_std, _Args.max_refill_rounds))
                 or checks.train_sampling_error(args, world)):
        return error
    try:  # --eval-tasks, and --reward-weights' terms and weights or --reward alone (tasks.py: reward_weights)
        parse_eval_tasks(args.eval_tasks, TASKS)
        weights = reward_weights(task, args.reward, args.reward_weights)
    except ValueError as err:
        return str(err)
    if args.overlong_buffer and "overlong" not in weights:
        return "--overlong-buffer is read by the overlong reward term only: add it to --reward-weights"
    try:  # the estimator checks its own hyperparameters (advantage.py) on a dummy group
        compute_advantages(args.advantage, torch.zeros(1, 2), **estimator_hparams(args))
    except ValueError as err:
        return f"--advantage {args.advantage}: {first_line(err, limit=None)}"
    try:  # the loss checks its own options (loss.py: --loss-terms, --is-cap for a mask) on a dummy batch
        zeros = torch.zeros(1, 2)
        policy_loss(zeros, zeros, torch.zeros(1), torch.ones(1, 2), ref_logp=zeros, sampler_logp=zeros, entropy=zeros,
                    norm_len=args.max_tokens, **loss_options(args))
    except ValueError as err:
        return first_line(err, limit=None)
    if args.plan:  # a plan reads no file and does not care whether the run folder is taken
        return None
    # ---- what the run reads and writes: files, installed tools, the model, the run folder
    splits = ("train", "test") if args.eval_examples else ("train",)
    if error := (checks.tool_error(args) or checks.data_file_error(args, splits) or checks.model_flag_error(args)
                 or checks.demo_file_error(args, task, weights)):
        return error
    keeps = (*RESUME_KEEPS, *hyperparameters(ESTIMATORS[args.advantage]))
    if args.resume and (error := resume_error(args.resume, run_dir(args), asdict(args), keeps)):
        return error
    return run_folder_error(run_dir(args), find_checkpoint(args.resume) if args.resume else None)


def parse_args(argv=None) -> Args:
    """Args from the command line: the --task preset first, then the flags actually given."""
    parser = OneLineParser("train.py", description="SoftmaxGRPO training (Section 4, Appendix B.1); flags override "
                           "the task's preset")
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
    error = check_args(args)  # with --plan, the flags only: train.py prints the plan (tools/memory_plan.py)
    if error:
        parser.error(error)
    return args
