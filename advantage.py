"""Group advantage estimators (Section 3.1, Eq. 1; Table 1); their exact prompt weights: tools/theory.py.

python -m pytest tests/test_advantage.py -q
"""

from __future__ import annotations  # POSITIVE is defined below

import inspect
import math
import numbers
import types
import typing
from dataclasses import dataclass

import torch


def softmax_advantages(rewards: torch.Tensor, tau: typing.Annotated[float, POSITIVE] = 0.1) -> torch.Tensor:
    """SoftmaxGRPO: A_i = M * softmax(R / tau)_i - 1, zero-sum in every group."""
    tau = POSITIVE.check(tau, "tau", "softmax_advantages")
    rewards = _as_groups(rewards, "softmax_advantages")
    M = rewards.shape[-1]
    logits = (rewards - rewards.amax(-1, keepdim=True)) / tau  # (G, M); minus the max: exp() <= 1 as tau -> 0
    w = torch.softmax(logits, dim=-1)  # Eq. (1): w_i = exp(R_i / tau) / sum_j exp(R_j / tau)
    return M * w - 1  # Eq. (1): A_i = M w_i - 1


def grpo_advantages(rewards: torch.Tensor, eps: typing.Annotated[float, POSITIVE] = 1e-6) -> torch.Tensor:
    """GRPO: (R - mean) / (std + eps) within the group."""
    eps = POSITIVE.check(eps, "eps", "grpo_advantages")
    rewards = _as_groups(rewards, "grpo_advantages")
    mean = rewards.mean(-1, keepdim=True)
    std = rewards.std(-1, keepdim=True, correction=0)  # population std: large-M weight 1 / sqrt(p (1 - p)) (Table 1)
    return (rewards - mean) / (std + eps)


def drgrpo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO: reward minus the group mean, no std division."""
    rewards = _as_groups(rewards, "drgrpo_advantages")
    return rewards - rewards.mean(-1, keepdim=True)


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """RLOO: reward minus the mean of the other M - 1 rewards (zero when M = 1)."""
    rewards = _as_groups(rewards, "rloo_advantages")
    M = rewards.shape[-1]
    if M == 1:
        return torch.zeros_like(rewards)
    return rewards - (rewards.sum(-1, keepdim=True) - rewards) / (M - 1)


def maxrl_advantages(rewards: torch.Tensor, eps: typing.Annotated[float, POSITIVE] = 1e-6) -> torch.Tensor:
    """MaxRL: (R - mean) / mean, zero in groups whose |mean| <= eps."""
    eps = POSITIVE.check(eps, "eps", "maxrl_advantages")
    rewards = _as_groups(rewards, "maxrl_advantages")
    mean = rewards.mean(-1, keepdim=True)
    safe = torch.where(mean.abs() > eps, mean, torch.ones_like(mean))
    return torch.where(mean.abs() > eps, (rewards - mean) / safe, torch.zeros_like(rewards))


def reinforce_advantages(
    rewards: torch.Tensor, baseline: typing.Annotated[float | None, FINITE_OR_NONE] = None
) -> torch.Tensor:
    """REINFORCE: reward minus a constant `baseline`, else the batch mean."""
    baseline = FINITE_OR_NONE.check(baseline, "baseline", "reinforce_advantages")
    rewards = _as_groups(rewards, "reinforce_advantages")
    return rewards - (rewards.mean() if baseline is None else baseline)


ESTIMATORS = {
    "softmax": softmax_advantages,
    "grpo": grpo_advantages,
    "drgrpo": drgrpo_advantages,
    "rloo": rloo_advantages,
    "maxrl": maxrl_advantages,
    "reinforce": reinforce_advantages,
}
REWARD_FLOOR = {"maxrl": 0.0}  # the least reward each formula holds for (MaxRL divides by the mean); others: any real


def _as_groups(rewards: torch.Tensor, name: str) -> torch.Tensor:
    """Rewards (..., M) detached, at least float32; ValueError for a non-finite one."""
    rewards = torch.as_tensor(rewards).detach()  # Eq. (10): advantages are constants
    if rewards.dim() < 1 or rewards.shape[-1] < 1:
        raise ValueError(f"{name}: rewards must have shape (G, M) with M >= 1, got {tuple(rewards.shape)}")
    rewards = rewards if rewards.dtype in (torch.float32, torch.float64) else rewards.float()
    if (bad := ~torch.isfinite(rewards)).any():
        group = int(bad.reshape(-1, rewards.shape[-1]).any(-1).nonzero()[0])
        raise ValueError(f"{name}: non-finite reward in group {group}")
    return rewards


def _real(value) -> float | None:
    """`value` as a float when it is one real number, else None."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype != torch.bool and not value.is_complex():
        value = value.item()
    return None if isinstance(value, bool) or not isinstance(value, numbers.Real) else float(value)


@dataclass(frozen=True)
class Range:
    """A hyperparameter's valid values: finite reals >= low (None when `optional`)."""

    low: float = -math.inf
    optional: bool = False
    means: str = "finite"

    def problem(self, value) -> str | None:
        """None when in range, else "must be ..., got VALUE"."""
        if value is None and self.optional:
            return None
        if (real := _real(value)) is None:
            return (
                f"must be one real number (float, int, numpy scalar or one-element tensor), got "
                f"{type(value).__name__} {value!r}"
            )
        return None if math.isfinite(real) and real >= self.low else f"must be {self.means}, got {value!r}"

    def check(self, value, name: str, where: str) -> float | None:
        """`value` as a float (or None); ValueError outside the range."""
        if (problem := self.problem(value)) is not None:
            raise ValueError(f"{where}: {name} {problem}")
        return None if value is None else _real(value)


POSITIVE = Range(
    low=torch.finfo(torch.float32).tiny,
    means="finite and > 0 (at least 1.2e-38, float32's smallest normal number: a smaller value rounds to 0)",
)
FINITE_OR_NONE = Range(optional=True, means="finite, or None")


def hyperparameters(fn) -> dict[str, inspect.Parameter]:
    """An estimator's hyperparameters: its parameters after `rewards` that have a default."""
    params = list(inspect.signature(fn).parameters.values())[1:]
    return {p.name: p for p in params if p.default is not inspect.Parameter.empty}


def hyperparameter_ranges() -> dict[str, Range]:
    """{hyperparameter: its declared Range} over all ESTIMATORS."""
    out = {}
    for fn in ESTIMATORS.values():
        hints = typing.get_type_hints(fn, include_extras=True)
        for name in hyperparameters(fn):
            declared = [m for m in getattr(hints.get(name), "__metadata__", ()) if isinstance(m, Range)]
            out.setdefault(name, declared[0] if declared else Range(optional=True))
    return out


def estimator_params() -> dict[str, tuple[object, type]]:
    """{hyperparameter: (default, type)} over all ESTIMATORS; a name has one default."""
    out: dict[str, tuple[object, type]] = {}
    for est, fn in ESTIMATORS.items():
        hints = typing.get_type_hints(fn)
        for name, p in hyperparameters(fn).items():
            kind = hints.get(name, type(p.default))
            if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
                kind = next(t for t in typing.get_args(kind) if t is not type(None))
            if name in out and out[name][0] != p.default:
                raise ValueError(
                    f"estimator {est!r}: hyperparameter {name!r} defaults to {p.default!r}, but "
                    f"another estimator's {name!r} defaults to {out[name][0]!r}; rename one"
                )
            out[name] = (p.default, kind)
    return out


def compute_advantages(name: str, rewards: torch.Tensor, tau: float | None = None, **hparams) -> torch.Tensor:
    """Advantages (G, M) of estimator `name`, which takes its own of `hparams`."""
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; choose one of {sorted(ESTIMATORS)}")
    if tau is not None:
        hparams["tau"] = tau
    if unknown := sorted(set(hparams) - set(estimator_params())):
        raise ValueError(
            f"unknown estimator hyperparameter(s) {', '.join(unknown)}; "
            f"the estimators declare {', '.join(sorted(estimator_params()))}"
        )
    floor, rewards = REWARD_FLOOR.get(name, -math.inf), torch.as_tensor(rewards)
    if (below := rewards[rewards < floor]).numel():
        raise ValueError(f"estimator {name} holds for rewards >= {floor:g}, got a reward of {below.min().item():g}")
    own = hyperparameters(ESTIMATORS[name])
    return ESTIMATORS[name](rewards, **{k: v for k, v in hparams.items() if k in own})
