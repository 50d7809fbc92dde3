"""Gradient allocation by prompt difficulty (Section 6.3, Table 3): each pass-rate bin's share of sum_i |A_gi| len_gi.

python -m tools.grad_alloc --model smollm2-135m --task arith --prompts 32 --M 8 [--exact]
"""

import sys

import torch

from advantage import compute_advantages
from plumbing.cli import first_line

BINS = [(0, 0.2), (0.2, 0.5), (0.5, 0.7), (0.7, 0.9), (0.9, 1.0)]  # Table 3's columns
BIN_LABELS = ["0-0.2", "0.2-0.5", "0.5-0.7", "0.7-0.9", "0.9-1"]
EDGE_TOL = 1e-6  # float32 7/10 is 0.69999999


def bin_index(p: float) -> int:
    """p's bin, [low, high); p = 1 in the last."""
    return sum(float(p) + EDGE_TOL >= low for low, _ in BINS[1:])


def prompt_budgets(adv: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    return (adv.abs().double() * lengths.double()).sum(-1)  # (G,)


def shares_by_bin(pass_rates, budgets) -> list[float]:
    """Percent of the budget in each bin."""
    per_bin = [0.0] * len(BINS)
    for p, b in zip(torch.as_tensor(pass_rates).tolist(), torch.as_tensor(budgets).tolist()):
        per_bin[bin_index(p)] += b
    total = sum(per_bin)
    return [100.0 * b / total if total > 0 else 0.0 for b in per_bin]


def allocation_table(pass_rates, adv, lengths) -> list[float]:
    """Table 3's row: (G,), (G, M), (G, M) -> shares (%) per bin."""
    return shares_by_bin(pass_rates, prompt_budgets(torch.as_tensor(adv), torch.as_tensor(lengths)))


def pass_rates_of(rewards: torch.Tensor, pass_threshold: float = 0.5) -> torch.Tensor:
    return (torch.as_tensor(rewards).double() >= pass_threshold).double().mean(-1)  # (G,)


def allocation_by_estimator(rewards, lengths, names, pass_rates=None, **hparams) -> dict[str, list[float]]:
    """Table 3's rows of estimators `names` on the same rollouts (G, M)."""
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    p = pass_rates_of(rewards) if pass_rates is None else pass_rates
    return {name: allocation_table(p, compute_advantages(name, rewards, **hparams), lengths) for name in names}


_warned: set[str] = set()


def allocation_metrics(rewards, lengths, names, pass_rates=None, must=None, **hparams) -> dict[str, float]:
    """alloc/<estimator>/<bin> metrics; an estimator that raises is left out and warned once, unless `must`."""
    out = {}
    for name in names:
        try:
            row = allocation_by_estimator(rewards, lengths, [name], pass_rates, **hparams)[name]
        except Exception as err:
            if name == must:
                raise
            if name not in _warned:
                _warned.add(name)
                print(
                    f"grad_alloc.py: warning: alloc/{name}/* left out, estimator {name!r} raised "
                    f"{first_line(err, limit=None, typed=True)}",
                    file=sys.stderr,
                    flush=True,
                )
            continue
        out.update({f"alloc/{name}/{label}": share for label, share in zip(BIN_LABELS, row)})
    return out


if __name__ == "__main__":
    sys.exit("grad_alloc.py is the stage; its command line is python -m tools.grad_alloc (--help)")
