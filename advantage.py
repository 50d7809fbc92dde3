"""Group advantage estimators (Section 3.1, Eq. 1) and their exact prompt weights (Sections 3.2-3.3).

Every estimator maps rewards of shape (G, M) -- G prompts, M rollouts each -- to advantages of the
same shape. SoftmaxGRPO is the one-line change to GRPO this codebase exists for:

    w_i = exp(R_i / tau) / sum_j exp(R_j / tau),    A_i = M * w_i - 1            (Eq. 1)

The rest are the baselines the paper compares against (Table 1); `train.py --advantage NAME` swaps
only the advantage computation. A new estimator is a function plus an ESTIMATORS entry: its parameters
after `rewards` that have a default are its hyperparameters, one command-line flag each, and may
declare their valid values, `alpha: Annotated[float, POSITIVE] = 0.5` (plumbing/checks.py).
Advantages are constants in the loss (Eq. 10): every estimator returns a tensor without gradient history.
`population_weight` computes the exact finite-M prompt weight omega_M(p) for binary rewards by calling
the estimators on every possible group, so the theory is a test of the code that trains.

    python advantage.py        # prints Table 1 with numbers (M = 8)
"""

import inspect
import types
import typing
from typing import Annotated

import torch

from plumbing.checks import FINITE_OR_NONE, POSITIVE, Range
from plumbing.checks import as_groups as _as_groups  # the name docs/fork.md's estimator calls


def softmax_advantages(rewards: torch.Tensor, tau: Annotated[float, POSITIVE] = 0.1) -> torch.Tensor:
    """SoftmaxGRPO, Eq. (1): A_i = M * softmax(R / tau)_i - 1. Sums to zero in every group."""
    tau = POSITIVE.check(tau, "tau", "softmax_advantages")
    rewards = _as_groups(rewards, "softmax_advantages")
    M = rewards.shape[-1]
    # Subtracting the group max leaves the softmax unchanged and keeps exp() <= 1, so r / tau up
    # to 1e6 (tau -> 0) stays finite.
    logits = (rewards - rewards.amax(-1, keepdim=True)) / tau  # (G, M)
    w = torch.softmax(logits, dim=-1)  # Eq. (1): w_i
    return M * w - 1  # Eq. (1): A_i


def grpo_advantages(rewards: torch.Tensor, eps: Annotated[float, POSITIVE] = 1e-6) -> torch.Tensor:
    """GRPO: z-score within the group, (R - mean) / (std + eps); a constant group gives zeros.

    Uses the population std (divide by M, not M - 1). For a fixed M the two differ by the constant
    factor sqrt(M / (M - 1)), which only rescales the step size; the population std makes the
    large-M prompt weight exactly 1 / sqrt(p (1 - p)) (Table 1) and keeps M = 1 defined. eps > 0 keeps a
    constant group's 0 / 0 away; a negative eps would flip every advantage's sign.
    """
    eps = POSITIVE.check(eps, "eps", "grpo_advantages")
    rewards = _as_groups(rewards, "grpo_advantages")
    mean = rewards.mean(-1, keepdim=True)
    std = rewards.std(-1, keepdim=True, correction=0)
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
    others_mean = (rewards.sum(-1, keepdim=True) - rewards) / (M - 1)
    return rewards - others_mean


def maxrl_advantages(rewards: torch.Tensor, eps: Annotated[float, POSITIVE] = 1e-6) -> torch.Tensor:
    """MaxRL: (R - mean) / mean, zero in groups whose mean is (numerically) zero: |mean| <= eps."""
    eps = POSITIVE.check(eps, "eps", "maxrl_advantages")
    rewards = _as_groups(rewards, "maxrl_advantages")
    mean = rewards.mean(-1, keepdim=True)
    safe = torch.where(mean.abs() > eps, mean, torch.ones_like(mean))
    return torch.where(mean.abs() > eps, (rewards - mean) / safe, torch.zeros_like(rewards))


def reinforce_advantages(rewards: torch.Tensor,
                         baseline: Annotated[float | None, FINITE_OR_NONE] = None) -> torch.Tensor:
    """REINFORCE: reward minus a baseline that does not depend on the group.

    The baseline is the batch mean (over all prompts and rollouts) unless a constant is given.
    """
    baseline = FINITE_OR_NONE.check(baseline, "baseline", "reinforce_advantages")
    rewards = _as_groups(rewards, "reinforce_advantages")
    return rewards - (rewards.mean() if baseline is None else baseline)


# A new estimator is one more entry here; its hyperparameters are read from its signature.
ESTIMATORS = {
    "softmax": softmax_advantages,
    "grpo": grpo_advantages,
    "drgrpo": drgrpo_advantages,
    "rloo": rloo_advantages,
    "maxrl": maxrl_advantages,
    "reinforce": reinforce_advantages,
}


def hyperparameters(fn) -> dict[str, inspect.Parameter]:
    """An estimator's hyperparameters: its parameters after `rewards` that have a default."""
    params = list(inspect.signature(fn).parameters.values())[1:]
    return {p.name: p for p in params if p.default is not inspect.Parameter.empty}


def hyperparameter_ranges() -> dict[str, Range]:
    """{hyperparameter: its Range} over all ESTIMATORS, from their signatures; finite when none is declared."""
    out = {}
    for fn in ESTIMATORS.values():
        hints = typing.get_type_hints(fn, include_extras=True)
        for name in hyperparameters(fn):
            declared = [m for m in getattr(hints.get(name), "__metadata__", ()) if isinstance(m, Range)]
            out.setdefault(name, declared[0] if declared else Range(optional=True))
    return out


def estimator_params() -> dict[str, tuple[object, type]]:
    """{hyperparameter: (default, type)} over all ESTIMATORS, for one command-line flag each.

    The type is the annotation's (float for `float | None`). Two estimators may share a name (grpo's
    and maxrl's `eps`) only with the same default, since one flag sets both.
    """
    out: dict[str, tuple[object, type]] = {}
    for est, fn in ESTIMATORS.items():
        hints = typing.get_type_hints(fn)
        for name, p in hyperparameters(fn).items():
            kind = hints.get(name, type(p.default))
            if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
                kind = next(t for t in typing.get_args(kind) if t is not type(None))
            if name in out and out[name][0] != p.default:
                raise ValueError(f"estimator {est!r}: hyperparameter {name!r} defaults to {p.default!r}, but "
                                 f"another estimator's {name!r} defaults to {out[name][0]!r}; rename one")
            out[name] = (p.default, kind)
    return out


def compute_advantages(name: str, rewards: torch.Tensor, tau: float | None = None, **hparams) -> torch.Tensor:
    """Advantages (G, M) of estimator `name`, given the hyperparameters it declares.

    `hparams` may hold every estimator's hyperparameters (train.py passes them all): each estimator
    gets only its own. A name no estimator declares is an error, not silently ignored. The positional
    `tau` is kept for `compute_advantages("softmax", rewards, 0.3)`.
    """
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; choose one of {sorted(ESTIMATORS)}")
    if tau is not None:
        hparams["tau"] = tau
    unknown = sorted(set(hparams) - set(estimator_params()))
    if unknown:
        raise ValueError(f"unknown estimator hyperparameter(s) {', '.join(unknown)}; "
                         f"the estimators declare {', '.join(sorted(estimator_params()))}")
    own = hyperparameters(ESTIMATORS[name])
    return ESTIMATORS[name](rewards, **{k: v for k, v in hparams.items() if k in own})


def population_weight(name: str, M: int, p, **kwargs) -> torch.Tensor:
    """Exact finite-M prompt weight omega_M(p) for binary rewards (Sections 3.2-3.3).

    omega_M(p) = E_s[A(own reward 1 | s others succeed) - A(own reward 0 | s others succeed)],
    s ~ Binomial(M - 1, p), so that E[sum_i A_i grad log pi(z_i)] = M * omega_M(p) * grad p.
    The advantages come from calling the estimator on all 2M possible groups. kwargs are
    hyperparameters, as for `compute_advantages` (`tau` for softmax). REINFORCE gets a constant
    baseline, as its batch baseline does not depend on the group.
    """
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; choose one of {sorted(ESTIMATORS)}")
    p = torch.as_tensor(p, dtype=torch.float64)
    s = torch.arange(M, dtype=torch.float64)  # successes among the M - 1 others
    others = (torch.arange(M - 1, dtype=torch.float64) < s[:, None]).double()  # (M, M-1)
    groups = torch.cat([torch.cat([torch.ones(M, 1, dtype=torch.float64), others], 1),
                        torch.cat([torch.zeros(M, 1, dtype=torch.float64), others], 1)])  # (2M, M)
    if name == "reinforce":
        kwargs = {"baseline": 0.0, **kwargs}
    adv = compute_advantages(name, groups, **kwargs)[:, 0].double()  # own advantage, (2M,)
    gap = adv[:M] - adv[M:]  # A(1 | s) - A(0 | s), (M,)
    log_binom = (torch.lgamma(torch.tensor(M, dtype=torch.float64)) - torch.lgamma(s + 1)
                 - torch.lgamma(M - s))  # log C(M-1, s)
    # Binomial(M - 1, p) pmf in log space; xlogy(0, 0) = 0 keeps p = 0 and p = 1 exact.
    pmf = torch.exp(log_binom + torch.xlogy(s, p[..., None]) + torch.xlogy(M - 1 - s, 1 - p[..., None]))
    return (pmf * gap).sum(-1)  # (*p.shape,)


def _table(M: int = 8, ps=(0.05, 0.25, 0.5, 0.75, 0.95)) -> str:
    rows = [("softmax tau=0.1", "softmax", {"tau": 0.1}), ("softmax tau=0.3", "softmax", {"tau": 0.3})]
    rows += [(name, name, {}) for name in ESTIMATORS if name != "softmax"]
    p = torch.tensor(ps, dtype=torch.float64)
    lines = [f"omega_M(p), exact finite-M prompt weight for binary rewards, M = {M}",
             f"{'estimator':<18}" + "".join(f"p={x:<8}" for x in ps)]
    for label, name, kw in rows:
        lines.append(f"{label:<18}" + "".join(f"{w:<10.4f}" for w in population_weight(name, M, p, **kw).tolist()))
    return "\n".join(lines)


if __name__ == "__main__":
    print(_table())
