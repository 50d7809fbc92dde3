"""train.py's flags (Args), the paper's presets (Appendix B.1, Tables B.1-B.2) and check_args.

python train.py --help
"""

import argparse
import importlib.util
import inspect
import math
import os
import shutil
from dataclasses import asdict, dataclass, field, fields, make_dataclass, replace

import torch

from advantage import ESTIMATORS, estimator_params, hyperparameter_ranges, hyperparameters
from eval import SAMPLING_RULES, SEED_LIMIT, demo_file_error, number_error
from loss import OPTION_CHOICES, REFERENCES, ROW_FILTERS, loss_term_coefs, policy_loss
from plumbing.checkpoint import find_checkpoint, resume_error, run_dir, run_folder_error
from plumbing.cli import OneLineParser, first_line, flag, number, unused_flag_error
from plumbing.data import data_file_error
from plumbing.models import has_bf16_units, model_context, model_error
from plumbing.sync import SYNC_TOLERANCE
from rewards import REWARD_TERMS, reward_model_error, reward_model_flag_error
from rollout import MAX_REFILLS, ROLLOUTS, SAMPLERS
from tasks import TASKS, get_task, no_room_error, parse_eval_tasks, reward_weights


def arg(default, help):
    return field(default=default, metadata={"help": help})


@dataclass
class _Args:
    task: str = arg("arith", "task (tasks.py); also picks its preset")
    model: str = arg("smollm2-135m", "initial policy: HF folder, hub id or embedded alias (plumbing/models.py)")
    data_file: str = arg("", "local data file for the task instead of the hub dataset")
    reward: str = arg("exact", "exact: the task's verifier; sim: similarity to the demonstration (B.5)")
    reward_weights: str = arg("", "weighted reward terms (rewards.py: REWARD_TERMS), e.g. format=0.35,sim=0.65")
    reward_model: str = arg("", "the rm term's AutoModelForSequenceClassification folder (num_labels=1), e.g. rm=0.5")
    demo_file: str = arg("", "countdown --reward sim: local Countdown-Task-GOLD demonstrations file")
    advantage: str = arg("softmax", f"group advantage estimator: {', '.join(ESTIMATORS)}")
    M: int = arg(8, "rollouts per prompt (group size)")
    rollout_batch: int = arg(4, "prompts per step, over all ranks")
    micro_batch: int = arg(8, "sequences per forward/backward pass on one rank (gradient accumulation)")
    micro_batch_tokens: int = arg(0, "also at most N tokens a micro-batch, as padded (rows x longest); 0: off")
    pack: bool = arg(False, "train on a micro-batch's sequences packed in one row, no padding (speed/logprobs.py)")
    minibatches: int = arg(1, "optimizer steps per rollout batch and PPO epoch")
    ppo_epochs: int = arg(1, "passes over each rollout batch")
    steps: int = arg(20, "training steps (rollout batches)")
    max_tokens: int = arg(48, "max response tokens")
    temperature: float = arg(1.0, "rollout sampling temperature")
    top_p: float = arg(1.0, "rollout nucleus sampling (paper presets: 0.999)")
    top_k: int = arg(0, "rollout top-k sampling, as vLLM's; 0: off")
    min_p: float = arg(0.0, "rollout min-p sampling: drop tokens below MIN_P x the likeliest's probability; 0: off")
    lr: float = arg(2e-5, "AdamW learning rate")
    warmup_steps: int = arg(2, "linear learning-rate warmup, in optimizer steps")
    lr_schedule: str = arg("constant", "after the warmup: constant (Appendix B.1), or cosine to --min-lr-ratio x --lr")
    min_lr_ratio: float = arg(0.0, "--lr-schedule cosine: the last optimizer step's lr, as a share of --lr")
    weight_decay: float = arg(0.01, "AdamW weight decay")
    max_grad_norm: float = arg(1.0, "gradient clipping")
    reference: str = arg("frozen", "KL reference policy (loss.py: REFERENCES): frozen, ema or reset")
    ref_ema: float = arg(0.0, "--reference ema: ref <- (1 - ALPHA) ref + ALPHA policy, ALPHA in (0, 1]")
    ref_reset_every: int = arg(0, "--reference reset: ref <- policy every N optimizer steps")
    mask_truncated: bool = arg(False, "no loss weight for completions cut at --max-tokens (DAPO)")
    row_filter: str = arg("none", "mask-only batch filter (loss.py: ROW_FILTERS)")
    rollout: str = arg("plain", "how a step fills its batch (rollout.py: ROLLOUTS): plain, dapo or tools")
    filter_std: float = arg(1e-6, "--rollout dapo: a group whose rewards' std is at most this has no signal")
    max_refill_rounds: int = arg(3, "--rollout dapo: max extra rounds of prompts per step (<= 15)")
    max_tool_calls: int = arg(2, "--rollout tools: tool calls a completion may make (rollout.py: TOOLS; <= 15)")
    overlong_buffer: int = arg(0, "overlong reward's L_cache, tokens (DAPO Eq. 13); 0: --max-tokens / 5")
    dtype: str = arg("auto", "bfloat16 (autocast), float32, or auto: bfloat16 where the hardware has bf16 units")
    sampler: str = arg("auto", "auto (vllm on a GPU, where it must be installed; hf on CPU), hf or vllm")
    gpu_memory_utilization: float = arg(0.3, "vLLM's share of GPU memory")
    max_num_seqs: int = arg(0, "vLLM's max_num_seqs; 0: this rank's share of rollout_batch x M")
    sync_tolerance: float = arg(0.0, "max sampler-trainer probe log-prob gap after a sync, nats; 0: by dtype")
    weight_check_every: int = arg(10, "compare the engine's weights with the trainer's every N steps; 0: never")
    grad_checkpointing: bool = arg(False, "recompute each decoder layer in backward (docs/memory_plan.md)")
    compile: bool = arg(False, "torch.compile each decoder layer (speed/compile.py)")
    lora_rank: int = arg(0, "LoRA rank r (peft; docs/training.md, LoRA); 0: train every weight")
    lora_alpha: float = arg(32.0, "LoRA: the adapters' update B A is scaled by alpha / r")
    lora_targets: str = arg("q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", "LoRA: the adapted modules")
    alloc_estimators: str = arg("", "also log Table 3's gradient allocation for these estimators: a comma list, or all")
    eval_every: int = arg(0, "greedy held-out score every N steps; 0: only before and after training")
    eval_examples: int = arg(64, "held-out prompts scored greedily at each evaluation (0: none)")
    eval_samples: int = arg(0, "K > 0: also sample each held-out prompt K times for mean@K, pass@k (docs/eval.md)")
    eval_temperature: float = arg(0.6, "--eval-samples' sampling temperature")
    eval_top_p: float = arg(1.0, "--eval-samples' nucleus")
    eval_tasks: str = arg("", "more held-out sets: a comma list of NAME or NAME=FILE, e.g. math500,aime24=a.jsonl")
    seed: int = arg(0, "seed of data order and sampling")
    out_dir: str = arg("", "run folder (default runs/TASK-ADVANTAGE-sSEED)")
    save_every: int = arg(0, "checkpoint every N steps (0: only at the end)")
    final_save: bool = arg(True, "checkpoint at the last step")
    keep_checkpoints: int = arg(0, "keep only the newest K checkpoints (0: all)")
    log_completions: int = arg(8, "samples a step logged to completions.jsonl, and eval-STEP.jsonl (0: neither)")
    resume: str = arg("", "checkpoint folder, or run folder (its newest checkpoint), to continue from")
    resume_changed: bool = arg(False, "with --resume: continue although a kept flag (RESUME_KEEPS) differs")
    dist_timeout_s: float = arg(1800.0, "torchrun: seconds a rank waits in a collective before the run fails")
    wandb: bool = arg(False, "also log to Weights & Biases (if installed)")
    plan: bool = arg(False, "print one rank's GPU memory plan (tools/memory_plan.py) and exit; loads nothing")
    plan_gpus: int = arg(8, "--plan: ranks, one GPU each")
    plan_gpu_gb: float = arg(80.0, "--plan: memory per GPU, GiB")


# Generated flags, here alone: --tau, --eps and --baseline come from the estimators' signatures (advantage.py:
# estimator_params), a parameter after `rewards` with a default each, so a new estimator's hyperparameter needs no
# edit here (docs/fork.md's first recipe). `python train.py --help` lists them with their defaults.
def _estimator_fields():
    for name, (default, kind) in estimator_params().items():
        users = "/".join(est for est, fn in ESTIMATORS.items() if name in hyperparameters(fn))
        text = f"hyperparameter of --advantage {users}"
        if name == "tau":
            text = "SoftmaxGRPO temperature (Eq. 1)"
        yield name, kind, arg(default, text)


_EstimatorArgs = make_dataclass("_EstimatorArgs", list(_estimator_fields()), bases=(_Args,))


@dataclass
class Args(_EstimatorArgs):
    """The flags; the fields below are loss.policy_loss's options, each with its signature's default."""

    clip_low: float = arg(0.2, "PPO clip: ratio >= 1 - clip_low")
    clip_high: float = arg(0.28, "PPO clip: ratio <= 1 + clip_high")
    beta: float = arg(1e-3, "reference KL coefficient (estimator: --kl-estimator); 0 skips the reference model")
    kl_estimator: str = arg(
        "k3",
        'per-token estimate of KL(pi_theta || pi_ref) (Schulman 2020, "Approximating KL divergence"): k3, the '
        "paper's; k1 (logp - ref_logp) or k2 (its square / 2) (loss.py: KL_ESTIMATORS)",
    )
    entropy_coef: float = arg(
        0.0, "entropy bonus: the loss subtracts this x the aggregated policy entropy, with its gradient; 0: off"
    )
    loss_terms: str = arg(
        "", "extra terms (loss.py: LOSS_TERMS), e.g. l2=0.1: each adds COEF x its aggregate, logged as loss/NAME"
    )
    loss_agg: str = arg(
        "token-mean",
        "loss aggregation: token-mean, the paper's; seq-mean-token-sum-norm, Dr. GRPO's (length max-tokens) "
        "(loss.py: AGGREGATIONS)",
    )
    ratio: str = arg(
        "token",
        "importance ratio the PPO clip acts on: token, the paper's; sequence, GSPO's (Zheng et al. 2025) "
        "(loss.py: RATIOS)",
    )
    is_correction: str = arg(
        "none",
        "detached weights of the policy-gradient term for the sampler/trainer gap, from pi_old / pi_sampler and "
        "--is-cap (docs/training.md): token-tis, seq-tis (truncated), token-mask, seq-mask (masked) "
        "(loss.py: IS_CORRECTIONS)",
    )
    is_cap: float = arg(2.0, "--is-correction: the cap C on pi_old / pi_sampler (the mask modes keep [1/C, C])")
    pg_loss: str = arg(
        "ppo", "the policy-gradient term (loss.py: PG_LOSSES): ppo, the paper's clip (Eq. 10); dual-clip, cispo, sapo"
    )
    top_entropy: float = arg(
        1.0, "keep the policy-gradient term on this share of tokens, highest entropy first (TRL's); 1: all"
    )


def loss_options(args: Args) -> dict:
    """policy_loss's options from `args`: its keyword-only parameters whose default is not None (not a tensor)."""
    params = inspect.signature(policy_loss).parameters.values()
    return {p.name: getattr(args, p.name) for p in params if p.kind is p.KEYWORD_ONLY and p.default is not None}


def resolve_auto(args: Args) -> Args:
    """--dtype auto, --sampler auto and --sync-tolerance 0 made concrete."""
    dtype = args.dtype
    if dtype == "auto":
        dtype = "bfloat16" if has_bf16_units() else "float32"
    tolerance = args.sync_tolerance or SYNC_TOLERANCE[dtype]  # 0: the dtype's own
    return replace(args, dtype=dtype, sampler=sampler_backend(args), sync_tolerance=tolerance)


def sampler_backend(args: Args) -> str:
    """--sampler, with auto made concrete: vllm on a GPU, hf on CPU."""
    if args.sampler == "auto":
        return "vllm" if torch.cuda.is_available() else "hf"
    return args.sampler


def alloc_estimators(args: Args) -> list[str]:
    """Estimators whose Table 3 allocation is logged: --advantage first."""
    if args.alloc_estimators.strip() == "all":
        return list(ESTIMATORS)
    named = [name.strip() for name in args.alloc_estimators.split(",") if name.strip()]
    return list(dict.fromkeys([args.advantage, *named]))


def estimator_hparams(args: Args) -> dict:
    return {name: getattr(args, name) for name in estimator_params()}


PAPER = dict(
    model="Qwen/Qwen2.5-1.5B",
    lr=1e-6,
    warmup_steps=0,
    save_every=100,
    eval_examples=500,  # Tables B.1-B.2; then the official configs' (base.yaml)
    top_p=0.999,
    eval_every=25,
    grad_checkpointing=True,
    keep_checkpoints=2,
    alloc_estimators="all",
)
TABLE_B1 = dict(
    PAPER, tau=0.1, M=8, rollout_batch=64, max_tokens=256, micro_batch=64, gpu_memory_utilization=0.12
)  # gsm8k and countdown: Table B.1
TABLE_B2 = dict(PAPER, tau=0.3, M=8, reward="sim")  # poetry, meetingbank and openthoughts: Table B.2's shared rows
PRESETS = {  # explicit flags override these; micro_batch, gpu_memory_utilization: tools/memory_plan.py, 80 GB
    "arith": dict(alloc_estimators="all"),  # the CPU demo
    "arith-calc": dict(alloc_estimators="all", rollout="tools"),  # the demo with a calculator (docs/training.md)
    "countdown24": dict(max_tokens=128),
    "gsm8k": dict(TABLE_B1, steps=1000),
    "countdown": dict(TABLE_B1, steps=2000),
    "deepmath": dict(
        PAPER,
        tau=0.3,
        M=16,
        rollout_batch=512,
        steps=3220,
        max_tokens=1024,
        micro_batch=32,
        gpu_memory_utilization=0.45,
    ),
    "poetry": dict(
        TABLE_B2, rollout_batch=64, steps=1350, max_tokens=1024, micro_batch=32, gpu_memory_utilization=0.12
    ),
    "meetingbank": dict(
        TABLE_B2, rollout_batch=512, steps=3220, max_tokens=4096, micro_batch=8, gpu_memory_utilization=0.6
    ),
    "openthoughts": dict(
        TABLE_B2,
        rollout_batch=512,
        steps=3220,
        max_tokens=6144,
        reward_weights="format=0.35,sim=0.65",
        micro_batch=8,
        gpu_memory_utilization=0.78,
    ),
    "polaris": dict(
        PAPER,
        model="Qwen/Qwen3-1.7B-Base",
        tau=0.3,
        M=16,  # qwen3_base.yaml: path, softmaxgrpo_tau, n
        rollout_batch=256,
        max_tokens=4096,
        steps=1040,  # train_batch_size, max_response_length, 5 epochs
        clip_high=0.2,
        max_grad_norm=0.3,
        beta=0.0,  # clip_ratio_high, grad_clip, use_kl_loss false
        top_p=1.0,
        gpu_memory_utilization=0.7,
        eval_every=50,  # top_p, gpu_memory_utilization, test_freq
        save_every=50,
        seed=79,
        eval_tasks="aime25,math500",  # save_freq, data.seed, val_files
        eval_samples=32,
        eval_temperature=0.6,
        eval_top_p=0.95,  # val_kwargs: n, temperature, top_p
        micro_batch=8,
        plan_gpus=32,
    ),  # the plan on 80 GB; trainer.nnodes 4 x n_gpus_per_node 8
}


RESUME_KEEPS = (
    "task",
    "advantage",
    "M",
    "seed",
    "rollout_batch",
    "data_file",  # kept unless --resume-changed
    "lora_rank",
    "lora_targets",
)  # the adapters' shapes


def choices() -> dict:
    """Each string flag's registry, whose keys are its valid values."""
    return {
        "advantage": ESTIMATORS,
        "reward": ("exact", *REWARD_TERMS),
        **OPTION_CHOICES,
        "row_filter": ROW_FILTERS,
        "sampler": ("auto", *SAMPLERS),
        "dtype": ("auto", "bfloat16", "float32"),
        "rollout": ROLLOUTS,
        "reference": REFERENCES,
        "lr_schedule": ("constant", "cosine"),
    }


TRAIN_RULES = [  # (flags, valid, what valid means); NaN breaks each
    ("rollout_batch micro_batch minibatches ppo_epochs steps plan_gpus", lambda v: v >= 1, ">= 1"),
    ("M", lambda v: v >= 2, ">= 2"),  # a group of one has advantage 0
    ("max_refill_rounds max_tool_calls", lambda v: 0 <= v <= MAX_REFILLS, f"in [0, {MAX_REFILLS}]"),  # step_seed's room
    (
        "warmup_steps save_every eval_every eval_examples keep_checkpoints log_completions weight_check_every "
        "max_num_seqs ref_reset_every overlong_buffer eval_samples clip_high sync_tolerance micro_batch_tokens "
        "lora_rank",
        lambda v: v >= 0,
        ">= 0",
    ),
    ("lr is_cap dist_timeout_s lora_alpha", lambda v: 0 < v < math.inf, "finite and > 0"),
    ("plan_gpu_gb", lambda v: 0 < v <= 2**20, "> 0 and at most 2^20 GiB"),  # bytes stay finite
    ("max_grad_norm", lambda v: v > 0, "> 0"),
    ("weight_decay beta filter_std", lambda v: 0 <= v < math.inf, "finite and >= 0"),
    ("entropy_coef", math.isfinite, "finite"),
    ("top_entropy", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("clip_low", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("gpu_memory_utilization", lambda v: 0 < v < 1, "in (0, 1)"),
    ("ref_ema min_lr_ratio", lambda v: 0 <= v <= 1, "in [0, 1]"),
]


def choice_error(args: Args) -> str | None:
    """The first string flag whose value is not a key of its registry, as one line, or None."""
    for name, registry in choices().items():
        if getattr(args, name) not in registry:
            return f"{flag(name)} must be one of {', '.join(registry)}"


def train_rule_error(args: Args, task, world: int) -> str | None:
    """The first rule between flags that `args` breaks, as one line, or None."""
    if args.rollout_batch % (world * args.minibatches):
        return (
            f"--rollout-batch ({args.rollout_batch}) must divide "
            f"evenly by ranks x minibatches ({world} x {args.minibatches})"
        )
    samples = args.rollout_batch * args.M
    # rollout.step_seed's streams stay below 2^64, and seed + rank below 2^32
    seed_max = min((2**64 // samples - 2**24) // 2**24, SEED_LIMIT - world)
    if seed_max < 0:
        return (
            f"--rollout-batch x --M is {samples:,} samples a step: each needs a seed "
            f"stream of its own, and at most {2**40:,} fit"
        )
    if args.seed > seed_max:
        return (
            f"--seed must be at most {seed_max:,} with --steps {args.steps}, --rollout-batch "
            f"{args.rollout_batch} and --M {args.M}, got {args.seed:,}"
        )
    if args.reference == "ema" and not args.ref_ema > 0:
        return "--reference ema needs --ref-ema ALPHA in (0, 1]"
    if args.reference == "reset" and not args.ref_reset_every >= 1:
        return "--reference reset needs --ref-reset-every N >= 1"
    moving = args.reference != "frozen"
    if not moving and (args.ref_ema or args.ref_reset_every):
        return (
            "--ref-ema and --ref-reset-every move the reference, "
            "which --reference frozen keeps: pass --reference ema or reset"
        )
    if moving and not args.beta > 0:
        return f"--reference {args.reference} moves the KL term's reference: --beta 0 has none"
    if moving and args.lora_rank:
        return (
            f"--lora-rank: the reference is the base model (the adapters off), which "
            f"--reference {args.reference} cannot move; pass --reference frozen"
        )
    if not set(alloc_estimators(args)) <= set(ESTIMATORS):
        return f"--alloc-estimators must name estimators of {', '.join(ESTIMATORS)}, or all"
    if not args.overlong_buffer < args.max_tokens:
        return "--overlong-buffer must be in [0, --max-tokens)"
    # an empty range: loss.is_weights' mask keeps ratios in [1/C, C]
    if args.is_correction in ("token-mask", "seq-mask") and not args.is_cap >= 1:
        return f"--is-cap {args.is_cap}: a mask correction keeps ratios in [1/C, C], empty for C < 1"
    if getattr(task, "held_out_only", False):  # a task need not be a tasks.Task: any object with its methods
        return f"--task {args.task} is a held-out benchmark: use --eval-tasks"
    if not args.eval_examples and (args.eval_samples or args.eval_tasks.strip()):
        return "--eval-samples and --eval-tasks need --eval-examples >= 1"


def reward_error(args: Args, task) -> str | None:
    """The first problem with the reward flags, the loss terms or --eval-tasks, as one line, or None."""
    try:
        parse_eval_tasks(args.eval_tasks, TASKS)
        loss_term_coefs(args.loss_terms)
        weights = reward_weights(task, args.reward, args.reward_weights)
    except ValueError as err:
        return first_line(err, limit=None)
    if args.overlong_buffer and "overlong" not in weights:
        return "--overlong-buffer is read by the overlong reward term only: add it to --reward-weights"
    if error := reward_model_flag_error(args.reward_model, weights):
        return error
    # an estimator may hold only for rewards above a floor (MaxRL divides by the group mean)
    least = sum(min(weight, 0.0) for weight in weights.values())  # every term is in [0, 1] (rewards.py)
    for name in alloc_estimators(args):
        floor = getattr(ESTIMATORS[name], "reward_floor", -math.inf)  # advantage.holds_for_rewards_at_least
        if least < floor:
            given = "--advantage" if name == args.advantage else f"--alloc-estimators {args.alloc_estimators} includes"
            return (
                f"{given} {name}, which holds for rewards >= {floor:g}, but --reward-weights "
                f"{args.reward_weights} gives rewards down to {least:g}"
            )
    return demo_file_error(task, args.demo_file, "sim" in weights)  # eval.py's door says the same


def machine_error(args: Args) -> str | None:
    """What this machine lacks for `args` (vLLM, a C++ compiler), as one line, or None."""
    if sampler_backend(args) == "vllm" and not importlib.util.find_spec("vllm"):
        return (
            f"--sampler {args.sampler} samples with vLLM, which is not installed: "
            "pip install -r requirements-vllm.txt, or pass --sampler hf (much slower)"
        )
    compilers = (os.environ.get("CXX", "g++"), "g++", "c++", "clang++")
    # torch.compile's CPU backend (inductor) writes C++
    if args.compile and not torch.cuda.is_available() and not any(map(shutil.which, compilers)):
        return "--compile on CPU needs a C++ compiler (g++, c++ or clang++ on PATH, or $CXX); none found"


def file_error(args: Args) -> str | None:
    """The first file flag that names no usable file or folder, as one line, or None."""
    if args.demo_file and not os.path.isfile(args.demo_file):
        return f"--demo-file {args.demo_file} does not exist"
    if args.reward_model and (error := reward_model_error(args.reward_model)):
        return error
    splits = ("train", "test") if args.eval_examples else ("train",)
    if args.data_file and (error := data_file_error(args.data_file, splits=splits)):
        return error
    # the room --max-tokens leaves in the model's context: again per prompt once the tokenizer is loaded
    if error := model_error(args.model) or no_room_error(args.max_tokens, model_context(args.model)):
        return error
    resumed = find_checkpoint(args.resume) if args.resume else None
    keeps = (*RESUME_KEEPS, *hyperparameters(ESTIMATORS[args.advantage]))
    fixed = ("lora_rank", "lora_targets")  # the adapters' shapes: DCP holds their optimizer state by name
    if args.resume and (error := resume_error(args.resume, run_dir(args), asdict(args), keeps, fixed)):
        return error
    return run_folder_error(run_dir(args), resumed)


# Flags read only when another is set ("FLAG") or has a value ("FLAG=VALUE"): given without it, each would be
# silently ignored (checked on the flags given; plumbing/cli.py: reads)
UNUSED_WITHOUT = {
    "lora_alpha": "lora_rank",
    "lora_targets": "lora_rank",
    "eval_temperature": "eval_samples",
    "eval_top_p": "eval_samples",
    "filter_std": "rollout=dapo",
    "max_refill_rounds": "rollout=dapo",
    "max_tool_calls": "rollout=tools",
    "min_lr_ratio": "lr_schedule=cosine",
}


def check_args(args: Args) -> str | None:
    """The first problem with `args` as one line, or None: each rule here, once per start."""
    try:
        task = get_task(args.task)
    except ValueError as err:
        return str(err)
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.plan:
        world = args.plan_gpus
    ranges = [
        (name, lambda v, valid=valid: valid.problem(v) is None, valid.means)
        for name, valid in hyperparameter_ranges().items()
    ]
    error = number_error(args, ranges + SAMPLING_RULES + TRAIN_RULES)
    error = error or choice_error(args) or train_rule_error(args, task, world) or reward_error(args, task)
    if error or args.plan:  # --plan loads nothing: no file, model or machine to check
        return error
    return machine_error(args) or file_error(args)


def parse_args(argv=None) -> Args:
    """Args from the command line: the --task preset, then the flags given."""
    parser = OneLineParser("train.py", description="SoftmaxGRPO training (Section 4, Appendix B.1)")
    for f in fields(Args):
        kind = dict(type=number if f.type is float else f.type)  # number: "1e-6", "８０" and no NaN or inf
        default = f" (default {f.default!r}, unless the task's preset sets it)"
        if f.type is bool:  # --wandb / --no-wandb
            kind = dict(action=argparse.BooleanOptionalAction)
            default = ""
        parser.add_argument(flag(f.name), default=argparse.SUPPRESS, help=f.metadata["help"] + default, **kind)
    given = vars(parser.parse_args(argv))
    args = Args(**{**PRESETS.get(given.get("task", Args.task), {}), **given})
    if error := unused_flag_error(given, asdict(args), UNUSED_WITHOUT) or check_args(args):
        parser.error(error)
    return args
