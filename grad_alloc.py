"""Gradient allocation by prompt difficulty (Section 6.3, Table 3): each pass-rate bin's share of sum_i |A_gi| len_gi.

python -m tools.grad_alloc --model smollm2-135m --task arith --prompts 32 --M 8 [--exact]
"""

import sys

import torch

from advantage import compute_advantages
from plumbing.cli import first_line

BINS = [(0, 0.2), (0.2, 0.5), (0.5, 0.7), (0.7, 0.9), (0.9, 1.0)]  # Table 3's columns
BIN_LABELS = [f"{low:g}-{high:g}" for low, high in BINS]  # "0-0.2", ..., "0.9-1"
EDGE_TOL = 1e-6  # float32 7/10 is 0.69999999


def bin_index(p: float) -> int:
    """p's bin, [low, high); p = 1 in the last."""
    return sum(float(p) + EDGE_TOL >= low for low, _ in BINS[1:])


def prompt_budgets(adv, lengths):
    """(G,): each prompt's budget sum_i |A_gi| len_gi, from (G, M) advantages and completion lengths."""
    return (adv.abs().double() * lengths.double()).sum(-1)


def shares_by_bin(pass_rates, budgets) -> list[float]:
    """Percent of the budget in each bin."""
    per_bin = [0.0] * len(BINS)
    for p, b in zip(torch.as_tensor(pass_rates).tolist(), torch.as_tensor(budgets).tolist()):
        per_bin[bin_index(p)] += b
    total = sum(per_bin)
    if not total > 0:  # no advantage anywhere (every group tied): zeros, not NaN
        return [0.0] * len(BINS)
    return [100.0 * b / total for b in per_bin]


def allocation_table(pass_rates, adv, lengths) -> list[float]:
    """Table 3's row: (G,), (G, M), (G, M) -> shares (%) per bin."""
    return shares_by_bin(pass_rates, prompt_budgets(torch.as_tensor(adv), torch.as_tensor(lengths)))


def pass_rates_of(rewards):
    """(G,): each group's share of rewards >= 0.5 (a verifier's 0/1, or a graded reward cut at 0.5)."""
    return (torch.as_tensor(rewards).double() >= 0.5).double().mean(-1)


def allocation_by_estimator(rewards, lengths, names, pass_rates=None, **hparams) -> dict[str, list[float]]:
    """Table 3's rows of estimators `names` on the same rollouts (G, M)."""
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if pass_rates is None:
        pass_rates = pass_rates_of(rewards)
    return {name: allocation_table(pass_rates, compute_advantages(name, rewards, **hparams), lengths) for name in names}


_warned: set[str] = set()  # the estimators allocation_metrics has warned about


def allocation_metrics(rewards, lengths, names, pass_rates=None, must=None, **hparams) -> dict[str, float]:
    """alloc/<estimator>/<bin> metrics; an estimator that raises is left out and warned once, unless `must`."""
    out = {}
    for name in names:
        try:
            row = allocation_by_estimator(rewards, lengths, [name], pass_rates, **hparams)[name]
        except Exception as err:
            if name == must:  # the estimator being trained: its failure is the run's
                raise
            if name not in _warned:  # once a run, not once a step
                _warned.add(name)
                reason = first_line(err, limit=None, typed=True)
                print(
                    f"grad_alloc.py: warning: alloc/{name}/* left out, estimator {name!r} raised {reason}",
                    file=sys.stderr,
                    flush=True,
                )
            continue
        for label, share in zip(BIN_LABELS, row):
            out[f"alloc/{name}/{label}"] = share
    return out


if __name__ == "__main__":
    sys.exit("grad_alloc.py is the stage; its command line is python -m tools.grad_alloc (--help)")
