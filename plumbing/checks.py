"""Argument checks for the stage files: the group shape of rewards, and the valid values of a hyperparameter.

An estimator declares its hyperparameters' ranges in its signature, `tau: Annotated[float, POSITIVE] = 0.1`
(advantage.py), checks them with `POSITIVE.check(tau, "tau", "softmax_advantages")`, and train.py's command
line checks every flag against the same Range before anything loads (config.check_args).

    python -m pytest tests/test_advantage.py
"""

import math
import numbers
from dataclasses import dataclass

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
    if context is not None and args.max_tokens >= context:
        return (f"--max-tokens {args.max_tokens:,} leaves no room for a prompt in the model's context of {context:,} "
                "tokens: pass a smaller --max-tokens")
    return None
