"""Flag checks shared by train.py and eval.py, each broken rule one line.
    python -m pytest tests/test_bad_input.py tests/test_nothing_silent.py
"""

import math

from plumbing.data import data_file_error
from plumbing.models import model_context, model_error

MAX_TOKENS = 2**24  # beyond any model's context
SEED_LIMIT = 2**32  # np.random.seed and vLLM's seed take 32 bits
SAMPLING_RULES = [  # (flags, valid, what valid means); NaN breaks each
    ("temperature eval_temperature", lambda v: 1e-3 <= v < math.inf, "finite and >= 0.001 (below it logits / T "
     "overflow; a small --top-p samples near-greedily)"),
    ("top_p eval_top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("max_tokens", lambda v: 1 <= v <= MAX_TOKENS, f">= 1 and at most {MAX_TOKENS:,}"),
    ("seed", lambda v: v >= 0, ">= 0"),
]
EVAL_RULES = [
    ("limit batch_size", lambda v: v >= 1, ">= 1"),
    ("samples", lambda v: v >= 0, ">= 0"),
    ("seed", lambda v: v < SEED_LIMIT, f"at most {SEED_LIMIT - 1:,} (the sampler's seed takes 32 bits)"),
]


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def number_error(args, rules) -> str | None:
    """The first number flag of `args` that is NaN or breaks its rule, as one line, or None."""
    values = vars(args)
    for name, value in values.items():
        if isinstance(value, float) and math.isnan(value):
            return f"{flag(name)} must be a number, got nan"
    for names, valid, means in rules:
        for name in names.split():
            if values.get(name) is not None and not valid(values[name]):
                return f"{flag(name)} must be {means}, got {values[name]:,}"
    return None


def eval_flag_error(args) -> str | None:
    """The first problem with eval.py's flags, or None."""
    return number_error(args, SAMPLING_RULES + EVAL_RULES) or (
        args.data_file and data_file_error(args.data_file, splits=(args.split,))) or None


def model_flag_error(args) -> str | None:
    """The problem with --model or with --max-tokens against its context, or None."""
    return model_error(args.model) or no_room_error(args.max_tokens, model_context(args.model))


def no_room_error(max_tokens: int, context: int | None) -> str | None:
    """The line for a --max-tokens that leaves a prompt no room in `context` (None: unknown), or None."""
    if context is not None and max_tokens >= context:
        return (f"--max-tokens {max_tokens:,} leaves no room for a prompt in the model's context of {context:,} "
                "tokens: pass a smaller --max-tokens")
    return None
