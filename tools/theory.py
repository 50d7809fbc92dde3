"""Table 1 with numbers (Sections 3.2-3.3): the exact finite-M prompt weight omega_M(p) of every estimator in
advantage.py's ESTIMATORS, computed by calling the training estimators themselves on every possible binary group.

    python -m tools.theory        # M = 8 (docs/theory.md)
"""

import torch

from advantage import ESTIMATORS, compute_advantages


def population_weight(name: str, M: int, p, **kwargs) -> torch.Tensor:
    """Exact prompt weight omega_M(p) = E_s[A(1 | s) - A(0 | s)], s ~ Binomial(M - 1, p) (Sections 3.2-3.3)."""
    p = torch.as_tensor(p, dtype=torch.float64)
    s = torch.arange(M, dtype=torch.float64)  # successes among the M - 1 others
    others = (torch.arange(M - 1, dtype=torch.float64) < s[:, None]).double()  # (M, M-1)
    own = torch.tensor([1.0] * M + [0.0] * M, dtype=torch.float64)[:, None]  # own reward 1, then 0
    groups = torch.cat([own, others.repeat(2, 1)], 1)  # (2M, M)
    kwargs = {"baseline": 0.0, **kwargs} if name == "reinforce" else kwargs  # a constant baseline
    adv = compute_advantages(name, groups, **kwargs)[:, 0].double()  # own advantage, (2M,)
    gap = adv[:M] - adv[M:]  # A(1 | s) - A(0 | s), (M,)
    log_binom = (
        torch.lgamma(torch.tensor(M, dtype=torch.float64)) - torch.lgamma(s + 1) - torch.lgamma(M - s)
    )  # log C(M-1, s)
    # xlogy(0, 0) = 0 keeps p = 0 and p = 1 exact
    pmf = torch.exp(log_binom + torch.xlogy(s, p[..., None]) + torch.xlogy(M - 1 - s, 1 - p[..., None]))
    return (pmf * gap).sum(-1)  # (*p.shape,)


def print_table1(M: int = 8, ps=(0.05, 0.25, 0.5, 0.75, 0.95)):
    print(f"omega_M(p), exact finite-M prompt weight for binary rewards, M = {M}")
    print(f"{'estimator':<18}" + "".join(f"p={x:<8}" for x in ps))
    rows = [("softmax tau=0.1", "softmax", {"tau": 0.1}), ("softmax tau=0.3", "softmax", {"tau": 0.3})]
    for label, name, kw in rows + [(name, name, {}) for name in ESTIMATORS if name != "softmax"]:
        weights = population_weight(name, M, torch.tensor(ps, dtype=torch.float64), **kw).tolist()
        print(f"{label:<18}" + "".join(f"{w:<10.4f}" for w in weights))


if __name__ == "__main__":
    print_table1()
