"""Group advantage estimators (Section 3.1, Eq. 1; Table 1); their exact prompt weights: tools/theory.py.

Each estimator maps a (G, M) block of rewards, G prompts x M rollouts, to advantages of the same shape. Its
hyperparameters (parameters after `rewards` with a default) become train.py flags; the range each declares with
typing.Annotated is checked once, at start, by config.py (hyperparameter_ranges), not again on each call.

python -m pytest tests/test_advantage.py -q
"""

from __future__ import annotations  # POSITIVE, named in the annotations, is defined below the estimators

import inspect
import math
import numbers
import types
import typing
from dataclasses import dataclass

import torch


def softmax_advantages(rewards, tau: typing.Annotated[float, POSITIVE] = 0.1):
    """SoftmaxGRPO: A_i = M * softmax(R / tau)_i - 1, zero-sum in every group."""
    rewards = _as_groups(rewards, "softmax_advantages")
    M = rewards.shape[-1]
    # minus the group max: exp() <= 1 however small tau is (softmax is shift-invariant, so Eq. 1 is unchanged)
    logits = (rewards - rewards.amax(-1, keepdim=True)) / tau  # (G, M)
    w = torch.softmax(logits, dim=-1)  # Eq. (1): w_i = exp(R_i / tau) / sum_j exp(R_j / tau)
    return M * w - 1  # Eq. (1): A_i = M w_i - 1


def grpo_advantages(rewards, eps: typing.Annotated[float, POSITIVE] = 1e-6):
    """GRPO: A_i = (R_i - mean) / (std + eps) within the group (Table 1)."""
    rewards = _as_groups(rewards, "grpo_advantages")
    mean = rewards.mean(-1, keepdim=True)
    std = rewards.std(-1, keepdim=True, correction=0)  # population std: large-M weight 1 / sqrt(p (1 - p)) (Table 1)
    return (rewards - mean) / (std + eps)


def drgrpo_advantages(rewards):
    """Dr. GRPO: A_i = R_i - mean, no std division (Table 1)."""
    rewards = _as_groups(rewards, "drgrpo_advantages")
    return rewards - rewards.mean(-1, keepdim=True)


def rloo_advantages(rewards):
    """RLOO: A_i = R_i - the mean of the other M - 1 rewards (zero when M = 1)."""
    rewards = _as_groups(rewards, "rloo_advantages")
    M = rewards.shape[-1]
    if M == 1:  # no other rollout to form a baseline from
        return torch.zeros_like(rewards)
    others = (rewards.sum(-1, keepdim=True) - rewards) / (M - 1)  # (G, M): each rollout's leave-one-out mean
    return rewards - others


def holds_for_rewards_at_least(floor: float):
    """An estimator's reward domain, stated once on it (`reward_floor`): config.py refuses, at start, an --advantage
    or --alloc-estimators estimator whose --reward-weights could give a reward below it. That one check covers
    every step: each reward term is in [0, 1] (rewards.py), so the weights bound every reward a run can see."""

    def declare(estimator):
        estimator.reward_floor = floor
        return estimator

    return declare


@holds_for_rewards_at_least(0.0)  # it divides by the group mean: a negative reward flips signs
def maxrl_advantages(rewards, eps: typing.Annotated[float, POSITIVE] = 1e-6):
    """MaxRL: A_i = (R_i - mean) / mean, zero in groups whose |mean| <= eps (Table 1)."""
    rewards = _as_groups(rewards, "maxrl_advantages")
    mean = rewards.mean(-1, keepdim=True)
    signal = mean.abs() > eps  # (G, 1); a group that never succeeds carries no gradient
    safe = torch.where(signal, mean, torch.ones_like(mean))  # so the division below never makes NaN to mask away
    return torch.where(signal, (rewards - mean) / safe, torch.zeros_like(rewards))


def gdpo_advantages(rewards, eps: typing.Annotated[float, POSITIVE] = 1e-6, *, terms: dict | None = None):
    """GDPO (Liu et al. 2026, arXiv 2601.05242, Sec. 3): each reward term z-scored within its group, summed by its
    --reward-weights weight, then the sum z-scored over the batch. `terms` maps a term to (weight, (G, M) rewards);
    without it, the summed `rewards` are the one term. Both steps use the population std, as grpo here does; with
    every group of one M, a sample std would scale all totals alike, which the batch step cancels."""
    rewards = _as_groups(rewards, "gdpo_advantages")
    if terms is None:
        terms = {"reward": (1.0, rewards)}
    # per term: summing raw rewards first would let two reward mixes collapse to one advantage (the paper's Sec. 2)
    total = sum(weight * grpo_advantages(term, eps) for weight, term in terms.values())
    return (total - total.mean()) / (total.std(correction=0) + eps)  # batch-wise: a range that no term count grows


def reinforce_advantages(rewards, baseline: typing.Annotated[float | None, FINITE_OR_NONE] = None):
    """REINFORCE: A_i = R_i - a constant `baseline`, else minus the batch mean."""
    rewards = _as_groups(rewards, "reinforce_advantages")
    return rewards - (rewards.mean() if baseline is None else baseline)


ESTIMATORS = {
    "softmax": softmax_advantages,
    "grpo": grpo_advantages,
    "drgrpo": drgrpo_advantages,
    "rloo": rloo_advantages,
    "maxrl": maxrl_advantages,
    "gdpo": gdpo_advantages,
    "reinforce": reinforce_advantages,
}


def _as_groups(rewards, name):
    """Rewards (..., M) detached, at least float32; ValueError for a non-finite one (rewards change every step). Their
    shape is the rollout's (G, M), --M >= 2 checked at start: not checked again here."""
    rewards = torch.as_tensor(rewards).detach()  # Eq. (10): advantages are constants
    if rewards.dtype not in (torch.float32, torch.float64):
        rewards = rewards.float()  # bf16 rewards / tau would lose Eq. 1's weights
    bad = ~torch.isfinite(rewards)
    if bad.any():
        group = int(bad.reshape(-1, rewards.shape[-1]).any(-1).nonzero()[0])
        raise ValueError(f"{name}: non-finite reward in group {group}")
    return rewards


def _real(value) -> float | None:
    """`value` as a float when it is one real number, else None."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype != torch.bool and not value.is_complex():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # True is an int to Python, not a number here
        return None
    return float(value)


@dataclass(frozen=True)
class Range:
    """A hyperparameter's valid values: finite reals >= low (None when `optional`)."""

    low: float = -math.inf
    optional: bool = False
    means: str = "finite"

    def problem(self, value) -> str | None:
        """None when in range, else "must be ..., got VALUE" (config.py's message for the flag)."""
        if value is None and self.optional:
            return None
        real = _real(value)
        if real is None:
            return (
                "must be one real number (float, int, numpy scalar or one-element tensor), got "
                f"{type(value).__name__} {value!r}"
            )
        if math.isfinite(real) and real >= self.low:
            return None
        return f"must be {self.means}, got {value!r}"


POSITIVE = Range(
    low=torch.finfo(torch.float32).tiny,  # a smaller tau or eps rounds to 0 in float32: NaN advantages
    means="finite and > 0 (at least 1.2e-38, float32's smallest normal number: a smaller value rounds to 0)",
)
FINITE_OR_NONE = Range(optional=True, means="finite, or None")


def hyperparameters(fn):
    """{name: inspect.Parameter} of an estimator's hyperparameters: its parameters after `rewards` with a default.
    Keyword-only ones (GDPO's `terms`) are the step's inputs, given by compute_advantages, not flags."""
    params = list(inspect.signature(fn).parameters.values())[1:]
    return {p.name: p for p in params if p.default is not p.empty and p.kind is not p.KEYWORD_ONLY}


def hyperparameter_ranges():
    """{name: its declared Range} over all ESTIMATORS' hyperparameters; undeclared: any finite real or None."""
    out = {}
    for fn in ESTIMATORS.values():
        hints = typing.get_type_hints(fn, include_extras=True)
        for name in hyperparameters(fn):
            metadata = getattr(hints.get(name), "__metadata__", ())  # typing.Annotated's extras
            declared = [m for m in metadata if isinstance(m, Range)]
            out.setdefault(name, declared[0] if declared else Range(optional=True))
    return out


def estimator_params():
    """{hyperparameter: (default, type)} over all ESTIMATORS; a name has one default (one flag serves them all)."""
    out = {}
    for est, fn in ESTIMATORS.items():
        hints = typing.get_type_hints(fn)
        for name, p in hyperparameters(fn).items():
            kind = hints.get(name, type(p.default))
            if typing.get_origin(kind) in (types.UnionType, typing.Union):
                kind = next(t for t in typing.get_args(kind) if t is not type(None))  # float | None: a float flag
            if name in out and out[name][0] != p.default:
                raise ValueError(
                    f"estimator {est!r}: hyperparameter {name!r} defaults to {p.default!r}, but "
                    f"another estimator's {name!r} defaults to {out[name][0]!r}; rename one"
                )
            out[name] = (p.default, kind)
    return out


def compute_advantages(name, rewards, tau=None, terms=None, **hparams):
    """Advantages (G, M) of estimator `name` on rewards (G, M), which takes its own of `hparams` (train.py passes
    every one) and `tau` (a float; None: its default). `terms`, {term: (weight, (G, M) rewards)}, reaches an
    estimator that declares it (GDPO)."""
    estimator = ESTIMATORS[name]
    params = inspect.signature(estimator).parameters
    given = {**hparams, "tau": tau, "terms": terms}  # tau is never in hparams: a second value is a TypeError
    own = {k: v for k, v in given.items() if k in params and v is not None}  # None: the estimator's default
    return estimator(rewards, **own)
