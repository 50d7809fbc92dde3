"""Argument checks for the stage files (the group shape of rewards, the valid values of a hyperparameter) and the
rules of train.py's and eval.py's flags, each broken rule one line (config.check_args, eval.parse_args).

An estimator declares its hyperparameters' ranges in its signature, `tau: Annotated[float, POSITIVE] = 0.1`
(advantage.py), checks them with `POSITIVE.check(tau, "tau", "softmax_advantages")`, and train.py's command
line checks every flag against the same Range before anything loads (config.check_args).

    python -m pytest tests/test_advantage.py tests/test_bad_input.py
"""

import importlib.util
import math
import numbers
import os
import shutil
from dataclasses import dataclass, fields

import torch


def as_groups(rewards: torch.Tensor, name: str) -> torch.Tensor:
    """Validate rewards (..., M) and return them in at least float32."""
    rewards = torch.as_tensor(rewards).detach()  # advantages are constants in Eq. (10): no gradient flows back
    if rewards.dim() < 1 or rewards.shape[-1] < 1:
        raise ValueError(f"{name}: rewards must have shape (G, M) with M >= 1, got {tuple(rewards.shape)}")
    if not rewards.is_floating_point() or rewards.dtype in (torch.float16, torch.bfloat16):
        rewards = rewards.float()
    bad = ~torch.isfinite(rewards)
    if bad.any():
        group = int(bad.reshape(-1, rewards.shape[-1]).any(-1).nonzero()[0])
        raise ValueError(f"{name}: non-finite reward in group {group}")
    return rewards


def _real(value):
    """`value` as a float when it is one real number (Python or numpy scalar, one-element tensor), else None."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype != torch.bool and not value.is_complex():
        value = value.item()
    return None if isinstance(value, bool) or not isinstance(value, numbers.Real) else float(value)


@dataclass(frozen=True)
class Range:
    """A hyperparameter's valid values, declared in its estimator's signature: `tau: Annotated[float, POSITIVE]`.

    Finite real numbers >= low, and None too when `optional`. The estimator refuses anything else (ValueError),
    and train.py's command line checks every hyperparameter against it before anything loads (config.check_args).
    """
    low: float = -math.inf
    optional: bool = False
    means: str = "finite"  # what the range says, for the messages and --help

    def problem(self, value) -> str | None:
        """None when `value` is in the range, else "must be ..., got VALUE"."""
        if value is None and self.optional:
            return None
        real = _real(value)
        if real is None:
            return (f"must be one real number (float, int, numpy scalar or one-element tensor), got "
                    f"{type(value).__name__} {value!r}")
        return None if math.isfinite(real) and real >= self.low else f"must be {self.means}, got {value!r}"

    def check(self, value, name: str, where: str) -> float | None:
        if (problem := self.problem(value)) is not None:
            raise ValueError(f"{where}: {name} {problem}")
        return None if value is None else _real(value)


# Rewards are float32, so a hyperparameter below float32's smallest normal number rounds to 0 in r / tau or
# std + eps, and the advantages become NaN: "> 0" means at least that.
POSITIVE = Range(low=torch.finfo(torch.float32).tiny, means="finite and > 0 (at least 1.2e-38, float32's smallest "
                 "normal number: a smaller value rounds to 0)")
FINITE_OR_NONE = Range(optional=True, means="finite, or None")


def available_memory(device: torch.device) -> int | None:
    """Bytes free for new tensors: the GPU's free memory, or Linux's MemAvailable; None where neither is known."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as meminfo:
            return next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def sampling_bytes(config, rows: int, length: int, dtype: str) -> int:
    """What the HF sampler holds at once to sample `rows` sequences of `length` tokens (prompt and completion): the
    KV cache and one layer's copy as it grows, the float32 logits with two same-sized temporaries (probabilities,
    top-p's sort), and each row's generator (~5 kB). Measured against: docs/memory_plan.md, "The HF sampler"."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    layer = 2 * kv_heads * head_dim * torch.finfo(getattr(torch, dtype)).bits // 8 * length  # one row's keys, values
    return rows * ((config.num_hidden_layers + 1) * layer + config.vocab_size * 4 * 3 + 5_000)


def sampling_memory_error(args, config, max_prompt: int, world: int, device: torch.device) -> str | None:
    """With the HF sampler, one line when a step's rollout on one rank (rollout_batch / world prompts x M samples of
    max_prompt + max_tokens tokens) needs more memory than the device has free; else None."""
    if args.sampler != "hf":
        return None  # vLLM sizes its own KV cache (gpu_memory_utilization) and queues what does not fit
    rows = args.rollout_batch // world * args.M
    need = sampling_bytes(config, rows, max_prompt + args.max_tokens, args.dtype)
    if (free := available_memory(device)) is None or need <= free:
        return None
    return (f"sampling {rows:,} sequences at once (--rollout-batch x --M per process) needs about {need / 1e9:.1f} "
            f"GB for the HF sampler's KV cache and logits, more than the {free / 1e9:.1f} GB free on {device.type}: "
            "lower --M or --rollout-batch")


# ---------------------------------------------------------------- the flags train.py and eval.py share
# One checker for both commands, so a flag means the same and is refused the same in each (config.check_args,
# eval.parse_args). Each check reads flags or small files only: it runs once, before any model loads.
MIN_TEMPERATURE = 1e-3  # below it logits / T overflow float32; a small --top-p samples near-greedily
MAX_TOKENS = 2**24  # beyond any model's context: the sampler's (rows, tokens) buffers could not be allocated
SEED_LIMIT = 2**32  # np.random.seed (plumbing/parallel.py) and vLLM's engine seed take 32 bits
STREAM_LIMIT = 2**64  # torch.Generator.manual_seed takes 64 bits: every sample's stream must stay below it


def largest_seed(steps: int, prompts_per_step: int, M: int, ranks: int) -> int:
    """The largest --seed of a training run: each sample's stream, rollout.step_seed's ((seed * 2^24 + lane) *
    prompts_per_step + prompt) * M + k, stays below 2^64 for every lane below 2^24 (a step, or a DAPO refill round's
    step + r * 2^20), and seed + rank below 2^32. `steps` is below 2^24 (check_args)."""
    return min((STREAM_LIMIT // (prompts_per_step * M) - 2**24) // 2**24, SEED_LIMIT - ranks)


def sampling_flag_error(args, *, seed_max: int, seed_why: str = "") -> str | None:
    """The first problem with --temperature, --max-tokens or --seed as one line, or None. `args` has those fields
    (train.py's Args, eval.py's namespace); `seed_max` is the largest seed the command's sampling streams allow
    (largest_seed for train.py), and `seed_why` says what sets it."""
    if not MIN_TEMPERATURE <= args.temperature < math.inf:  # NaN fails both comparisons
        return (f"--temperature must be finite and >= {MIN_TEMPERATURE:g} (below it logits / T overflow; a small "
                f"--top-p samples near-greedily), got {args.temperature:g}")
    if not 1 <= args.max_tokens <= MAX_TOKENS:
        return f"--max-tokens must be >= 1 and at most {MAX_TOKENS:,}, got {args.max_tokens:,}"
    if args.seed < 0:
        return f"--seed must be >= 0, got {args.seed}"
    if args.seed > seed_max:
        return f"--seed must be at most {seed_max:,}{seed_why}, got {args.seed:,}"
    return None


def eval_flag_error(args) -> str | None:
    """The first problem with eval.py's --limit, --batch-size, --samples, the sampling flags (as train.py checks
    them), --data-file or --top-p as one line, or None."""
    if min(1 if args.limit is None else args.limit, args.batch_size) < 1 or args.samples < 0:
        return "--limit and --batch-size must be >= 1, --samples >= 0"
    if error := (sampling_flag_error(args, seed_max=SEED_LIMIT - 1, seed_why=" (the sampler's seed takes 32 bits)")
                 or data_file_error(args, (args.split,))):
        return error
    if not 0 < args.top_p <= 1:
        return f"--top-p must be in (0, 1], got {args.top_p}"
    return None


def data_file_error(args, splits) -> str | None:
    """The problem with --data-file (each of `splits`' files when its name holds "{split}") as one line, or None."""
    from plumbing.data import data_file_error

    return data_file_error(args.data_file, splits=splits) if args.data_file else None


def model_flag_error(args) -> str | None:
    """The first problem with --model (its files; the hub, when it is a hub id) or with --max-tokens against its
    context, as one line, or None."""
    from plumbing.models import model_context, model_error

    if error := model_error(args.model):
        return error
    context = model_context(args.model)  # a local folder's config.json; None for a hub id (checked at load)
    return no_room_error(args.max_tokens, context)


def no_room_error(max_tokens: int, context: int | None) -> str | None:
    """The one line for a --max-tokens that leaves a prompt no room in the model's context (train.py, eval.py, at
    the checks and again at the load, where a hub model's context becomes known); None where it fits or is unknown."""
    if context is not None and max_tokens >= context:
        return (f"--max-tokens {max_tokens:,} leaves no room for a prompt in the model's context of {context:,} "
                "tokens: pass a smaller --max-tokens")
    return None


# ---------------------------------------------------------------- train.py's own flags (config.check_args)
def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def number_error(args, ranges: dict) -> str | None:
    """NaN in any float flag of the dataclass `args`, or any estimator's hyperparameter outside its declared Range
    (`ranges`, advantage.hyperparameter_ranges()), as one line: a flag out of range is an error even for an estimator
    this run does not train."""
    for f in fields(args):
        value = getattr(args, f.name)
        if f.type is float and isinstance(value, float) and math.isnan(value):
            return f"{flag(f.name)} must be a number, got nan"
    for name, valid in ranges.items():
        if (problem := valid.problem(getattr(args, name))) is not None:
            return f"{flag(name)} {problem}"
    return None


def choice_error(args, choices: dict) -> str | None:
    """A string flag whose value is not a key of its registry (`choices`, config.choices()), as one line."""
    for name, registry in choices.items():
        if getattr(args, name) not in registry:
            return f"{flag(name)} must be one of {', '.join(registry)}"
    return None


def train_sampling_error(args, world: int) -> str | None:
    """sampling_flag_error for train.py: its largest --seed is set by --steps, --rollout-batch and --M."""
    return sampling_flag_error(args, seed_max=largest_seed(args.steps, args.rollout_batch, args.M, world), seed_why=(
        f" with --steps {args.steps}, --rollout-batch {args.rollout_batch} and --M {args.M} (each sample's seed, "
        "rollout.step_seed, must stay below 2^64; np.random.seed's below 2^32)"))


def train_flag_error(args, *, task, world: int, estimators, alloc: list[str], max_refills: int,
                     dapo_defaults: tuple) -> str | None:
    """The first range or consistency rule train.py's `args` breaks, as one line, or None. `task` is the run's
    tasks.Task, `world` the ranks (--plan's, or torchrun's), `estimators` advantage.ESTIMATORS, `alloc` the
    estimators --alloc-estimators names, `max_refills` rollout.MAX_REFILLS, and `dapo_defaults` the defaults of
    (--filter-std, --max-refill-rounds), which only --rollout dapo may change."""
    rules = [
        (not args.plan or (args.plan_gpus >= 1 and math.isfinite(args.plan_gpu_gb) and args.plan_gpu_gb > 0),
         "--plan-gpus must be >= 1 and --plan-gpu-gb finite and > 0"),
        (math.isfinite(args.is_cap) and args.is_cap > 0, "--is-cap must be finite and > 0"),
        (math.isfinite(args.entropy_coef), "--entropy-coef must be finite"),
        (args.reward != "exact" or task.has_verifier or args.reward_weights,
         f"task {args.task} has no verifier: use --reward sim"),
        (min(args.M, args.rollout_batch, args.micro_batch, args.minibatches, args.ppo_epochs, args.steps,
             args.max_tokens) >= 1, "--M, --rollout-batch, --micro-batch, --minibatches, --ppo-epochs, "
                                    "--steps and --max-tokens must be >= 1"),
        (args.M >= 2, f"--M must be >= 2, got {args.M}: a group advantage compares a prompt's samples, and in a "
                      "group of one every advantage is 0"),
        (args.rollout_batch % max(1, world * args.minibatches) == 0,  # the list is built whole: 0 is refused above
         f"--rollout-batch ({args.rollout_batch}) must divide evenly by ranks x minibatches ({world} x "
         f"{args.minibatches})"),
        (math.isfinite(args.lr) and args.lr > 0 and args.max_grad_norm > 0,
         "--lr must be finite and > 0, --max-grad-norm > 0"),
        (min(args.warmup_steps, args.save_every, args.eval_every, args.eval_examples, args.keep_checkpoints,
             args.log_completions, args.weight_check_every, args.max_num_seqs) >= 0, "--warmup-steps, --save-every, "
         "--eval-every, --eval-examples, --keep-checkpoints, --log-completions, --weight-check-every and "
         "--max-num-seqs must be >= 0"),
        (math.isfinite(args.weight_decay) and args.weight_decay >= 0 and math.isfinite(args.beta) and args.beta >= 0,
         "--weight-decay and --beta must be finite and >= 0"),
        (0 < args.top_p <= 1, "--top-p must be in (0, 1]"),
        (0 <= args.clip_low < 1 and args.clip_high >= 0, "--clip-low must be in [0, 1), --clip-high >= 0"),
        (0 < args.gpu_memory_utilization < 1, "--gpu-memory-utilization must be in (0, 1)"),
        (args.sync_tolerance >= 0, "--sync-tolerance must be >= 0"),
        (args.steps < 2**24, f"--steps must be below 2^24 = {2**24:,}: rollout.step_seed gives each step 24 bits"),
        (0 < args.dist_timeout_s < math.inf, "--dist-timeout-s must be finite and > 0"),
        (0 <= args.ref_ema <= 1 and args.ref_reset_every >= 0, "--ref-ema must be in [0, 1], --ref-reset-every >= 0"),
        (args.reference != "ema" or args.ref_ema > 0, "--reference ema needs --ref-ema ALPHA in (0, 1]"),
        (args.reference != "reset" or args.ref_reset_every >= 1, "--reference reset needs --ref-reset-every N >= 1"),
        (args.reference != "frozen" or not (args.ref_ema or args.ref_reset_every), "--ref-ema and --ref-reset-every "
         "move the reference, which --reference frozen (the default) keeps: pass --reference ema or reset"),
        (args.reference == "frozen" or args.beta > 0, f"--reference {args.reference} moves the KL term's reference, "
         "and --beta 0 has none: pass --beta > 0"),
        (all(name in estimators for name in alloc),
         f"--alloc-estimators must name estimators of {', '.join(estimators)}, or all"),
        (math.isfinite(args.filter_std) and args.filter_std >= 0 and 0 <= args.max_refill_rounds <= max_refills,
         f"--filter-std must be finite and >= 0, --max-refill-rounds in [0, {max_refills}]"),
        (args.rollout == "dapo" or (args.filter_std, args.max_refill_rounds) == dapo_defaults,
         "--filter-std and --max-refill-rounds are read by --rollout dapo only"),
        (args.rollout != "dapo" or args.steps <= 2**20, "--rollout dapo: --steps must be <= 2^20 (rollout.step_seed)"),
        (0 <= args.overlong_buffer < args.max_tokens, "--overlong-buffer must be in [0, --max-tokens)"),
        (not getattr(task, "held_out_only", False), f"--task {args.task} is a held-out benchmark: score it with "
         f"--eval-tasks {args.task}, and train on another task"),
        (args.eval_samples >= 0 and 1e-3 <= args.eval_temperature < math.inf and 0 < args.eval_top_p <= 1,
         "--eval-samples must be >= 0, --eval-temperature finite and >= 0.001, --eval-top-p in (0, 1]"),
        (args.eval_examples or not (args.eval_samples or args.eval_tasks.strip()),
         "--eval-samples and --eval-tasks score held-out prompts: they need --eval-examples >= 1"),
    ]
    return next((message for ok, message in rules if not ok), None)


def tool_error(args) -> str | None:
    """What the run needs installed and does not find (vLLM for its sampler, a C++ compiler for --compile on CPU), as
    one line, or None."""
    rules = [
        (args.sampler == "hf" or (args.sampler == "auto" and not torch.cuda.is_available())
         or importlib.util.find_spec("vllm") is not None, f"--sampler {args.sampler} samples with vLLM, which is not "
         "installed: pip install -r requirements-vllm.txt, or pass --sampler hf (much slower)"),
        (not args.compile or torch.cuda.is_available() or any(map(shutil.which, (os.environ.get("CXX", "g++"),
                                                                                 "g++", "c++", "clang++"))),
         "--compile on CPU needs a C++ compiler (g++, c++ or clang++ on PATH, or $CXX); none found"),
    ]
    return next((message for ok, message in rules if not ok), None)


def demo_file_error(args, task, weights: dict) -> str | None:
    """The problem with --demo-file as one line, or None: only countdown joins demonstrations, and only a similarity
    reward (a sim term in `weights`) reads them."""
    if args.demo_file and getattr(task, "demos", None) is None:
        return f"--demo-file: task {args.task} keeps its demonstrations in its own rows (only countdown joins them)"
    if args.demo_file and ("sim" not in weights or not os.path.isfile(args.demo_file)):
        return (f"--demo-file {args.demo_file} does not exist" if "sim" in weights else "--demo-file is read only "
                "for a similarity reward: --reward sim, or a sim term in --reward-weights")
    return None
