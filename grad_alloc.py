"""Gradient allocation by prompt difficulty (Section 6.3, Table 3).

Which prompts does each advantage estimator spend its update on? Prompts are binned by measured pass
rate p into BINS, and each bin's share of the gradient budget is reported; a row sums to 100%.
The budget of one prompt (G groups, M rollouts each) is its token-level advantage mass

    budget_g = sum_i |A_gi| * len_gi

because the token-mean loss gives every token of rollout i the weight A_gi / N (one denominator N
for the whole batch), so this is the triangle-inequality bound on the prompt's gradient norm when
per-token gradients have similar size. `exact_prompt_grad_norms` measures the real per-prompt
gradient norm with a backward pass (small models) to check the cheap measure against it
(`--exact` prints their Pearson and Spearman agreement).

    python -m tools.grad_alloc --model smollm2-135m --task arith --prompts 32 --M 8    # Table 3 layout
    python -m tools.grad_alloc --model smollm2-135m --task arith --prompts 8 --exact   # + cheap vs exact (slow on CPU)

Pass rate of a prompt: the fraction of its rollouts with reward >= 0.5; for binary verifier rewards
that is the mean reward. Comparing estimators on the *same* rollouts, as the paper
does, is `allocation_by_estimator`; train.py logs it every step as alloc/<estimator>/<bin>.
"""

import sys

import torch

from advantage import compute_advantages
from plumbing.cli import first_line

BINS = [(0, 0.2), (0.2, 0.5), (0.5, 0.7), (0.7, 0.9), (0.9, 1.0)]  # Table 3's columns; the last is closed
BIN_LABELS = ["0-0.2", "0.2-0.5", "0.5-0.7", "0.7-0.9", "0.9-1"]
EDGE_TOL = 1e-6  # a float32 pass rate 7/10 is 0.69999999: it still belongs to [0.7, 0.9)


def bin_index(p: float) -> int:
    """Index of p's bin: lower edges inclusive, upper exclusive, except that p = 1 is in the last bin."""
    return sum(float(p) + EDGE_TOL >= low for low, _ in BINS[1:])


def prompt_budgets(adv: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Token-level advantage mass sum_i |A_gi| * len_gi of each prompt: (G, M), (G, M) -> (G,)."""
    return (adv.abs().double() * lengths.double()).sum(-1)  # (G,)


def shares_by_bin(pass_rates, budgets) -> list[float]:
    """Percent of the total budget that falls in each bin (all zeros when the total is zero)."""
    per_bin = [0.0] * len(BINS)
    for p, b in zip(torch.as_tensor(pass_rates).tolist(), torch.as_tensor(budgets).tolist()):
        per_bin[bin_index(p)] += b
    total = sum(per_bin)
    return [100.0 * b / total if total > 0 else 0.0 for b in per_bin]


def allocation_table(pass_rates, adv, lengths) -> list[float]:
    """Table 3 row: shares (%) of the token-level gradient budget per pass-rate bin. (G,), (G, M), (G, M)."""
    return shares_by_bin(pass_rates, prompt_budgets(torch.as_tensor(adv), torch.as_tensor(lengths)))


def pass_rates_of(rewards: torch.Tensor, pass_threshold: float = 0.5) -> torch.Tensor:
    return (torch.as_tensor(rewards).double() >= pass_threshold).double().mean(-1)  # (G,)


def allocation_by_estimator(rewards, lengths, names, pass_rates=None, **hparams) -> dict[str, list[float]]:
    """Table 3 rows for several estimators on the same rollouts: rewards, lengths (G, M) -> name -> shares.

    pass_rates (G,) default to the fraction of rewards >= 0.5; pass the verifier's when training on r_sim.
    hparams: estimator hyperparameters (tau=..., eps=...), each estimator taking its own (advantage.py).
    """
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    p = pass_rates_of(rewards) if pass_rates is None else pass_rates
    return {name: allocation_table(p, compute_advantages(name, rewards, **hparams), lengths) for name in names}


def allocation_metrics(rewards, lengths, names, pass_rates=None, must=None, **hparams) -> dict[str, float]:
    """The same as flat metrics for train.py: {"alloc/<estimator>/<bin label>": percent}.

    An estimator that raises is left out (its keys absent, one warning on stderr), so a broken estimator stops
    no run that does not train with it; only `must`, the estimator being trained, raises.
    """
    out = {}
    for name in names:
        try:
            row = allocation_by_estimator(rewards, lengths, [name], pass_rates, **hparams)[name]
        except Exception as err:
            if name == must:
                raise
            if name not in _warned:
                _warned.add(name)
                print(f"grad_alloc.py: warning: alloc/{name}/* left out, estimator {name!r} raised "
                      f"{first_line(err, limit=None, typed=True)}", file=sys.stderr, flush=True)
            continue
        out.update({f"alloc/{name}/{label}": share for label, share in zip(BIN_LABELS, row)})
    return out


_warned: set[str] = set()  # estimators allocation_metrics has warned about: once each, not every step


def exact_prompt_grad_norms(model, prompts, completions, adv, pad_id, temperature=1.0) -> torch.Tensor:
    """||grad_theta L_g|| per prompt, L_g = sum_i A_gi sum_t logp_git / N: its part of the token-mean loss.

    prompts: G token-id lists; completions: G lists of M token-id lists; adv (G, M). At theta = theta_old
    PPO's clip is inactive, so this is exactly prompt g's share of the policy-gradient step (Section 4).
    """
    from loss import pad_batch, sequence_logprobs

    n_tokens = sum(len(c) for group in completions for c in group)  # N: the batch's token-mean denominator
    norms = torch.zeros(len(prompts), dtype=torch.float64)  # (G,)
    params = [q for q in model.parameters() if q.requires_grad]
    for g, (prompt, group) in enumerate(zip(prompts, completions)):
        if not adv[g].abs().sum() > 0:  # no advantage, no gradient: skip the backward pass
            continue
        input_ids, attention_mask, mask = pad_batch([prompt] * len(group), group, pad_id)
        logp = sequence_logprobs(model, input_ids, attention_mask, mask.shape[1], temperature)  # (M, K)
        loss = (torch.as_tensor(adv[g]).float() * (logp * mask).sum(-1)).sum() / n_tokens
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        norms[g] = torch.sqrt(sum((gr.double() ** 2).sum() for gr in grads if gr is not None))
    return norms


def agreement(cheap, exact) -> dict[str, float]:
    """Pearson and Spearman correlation of two per-prompt budgets over prompts where either is nonzero.

    Prompts with no advantage (all pass or all fail) are 0 in both and would inflate the agreement.
    NaN when fewer than two such prompts remain or one side is constant.
    """
    cheap, exact = torch.as_tensor(cheap).double(), torch.as_tensor(exact).double()
    keep = (cheap != 0) | (exact != 0)
    x, y = cheap[keep], exact[keep]

    def pearson(a, b):
        a, b = a - a.mean(), b - b.mean()
        denom = a.norm() * b.norm()
        return float((a @ b) / denom) if len(a) > 1 and denom > 0 else float("nan")

    def ranks(a):  # average ranks, so ties get the same rank
        return torch.tensor([(a < v).sum().item() + ((a == v).sum().item() - 1) / 2 for v in a], dtype=torch.float64)

    return {"pearson": pearson(x, y), "spearman": pearson(ranks(x), ranks(y)), "prompts": int(keep.sum())}


if __name__ == "__main__":
    sys.exit("grad_alloc.py is the stage; its command line is python -m tools.grad_alloc (--help)")
