"""The PPO-clip + reference-KL loss SoftmaxGRPO trains with (Section 4, Eqs. 10-11), and the log-probs it takes.

    rho_t = pi_theta(z_t | x, z_<t) / pi_old(z_t | x, z_<t)                          (Section 4)
    L_pg  = agg_t[ max(-A * rho_t, -A * clip(rho_t, 1 - clip_low, 1 + clip_high)) ]
    L     = L_pg + beta * agg_t[ k3(pi_theta, pi_ref) ]  (- entropy_coef * agg_t[ H_t ] + sum_k c_k agg_t[ term_k ])

with the asymmetric clip range [0.20, 0.28], no dual clip, the k3 reference KL as a separate term and token-mean
aggregation, as in the paper's runs (Appendix B.1). A is one number per sequence (advantage.py), broadcast over its
tokens. Each choice is a registry a fork adds to in one edit (its keys are the flag's choices): RATIOS (--ratio),
IS_CORRECTIONS (--is-correction), KL_ESTIMATORS (--kl-estimator), LOSS_TERMS (--loss-terms), REFERENCES
(--reference), ROW_FILTERS (--row-filter), AGGREGATIONS (--loss-agg); none but the paper's choices is on by default.
Every keyword option of `policy_loss` with a default is a train.py flag of the same name (config.py), and every metric
it returns reaches metrics.jsonl as loss/NAME (train.py: ppo_update), so a new option or metric is one edit here.
The log-probs the loss takes (`sequence_logprobs`, `pad_batch`, the plain `token_logprobs`) are speed/logprobs.py's.

    python -m pytest tests/test_loss.py
"""

import math

import torch

from plumbing.cli import choose, parse_weights
from speed.logprobs import pad_batch, sequence_logprobs, token_logprobs  # noqa: F401 (loss.sequence_logprobs, ...)

LOG_RATIO_LIMIT = 20.0  # exp(20) ~ 5e8: keeps ratio and k3 finite when policies drift far apart


class Share(float):
    """A metric reduced like the loss: this micro-batch's share of the minibatch's value (train.py sums the shares
    of a minibatch and averages over optimizer steps)."""


class TokenMean(float):
    """A metric that is a mean over this micro-batch's loss tokens (train.py weighs it by their number)."""


def policy_loss(logp, old_logp, adv, mask, *, ref_logp=None, sampler_logp=None, entropy=None, denominator=None,
                norm_len=None, clip_low=0.2, clip_high=0.28, beta=1e-3, kl_estimator="k3", entropy_coef=0.0,
                loss_terms="", loss_agg="token-mean", ratio="token", is_correction="none", is_cap=2.0):
    """PPO clipped surrogate + beta * reference KL (Section 4), and the options below. Returns (loss, metrics),
    each metric a Share or a TokenMean (how train.py reduces it over micro-batches and ranks).

    logp, old_logp, ref_logp, sampler_logp, entropy, mask: (B, T); adv: (B,) per-sequence advantages. `denominator`
    and `norm_len` go to `aggregate`. `entropy` carries a gradient only where the bonus is on (train.py asks the
    kernel for it).

    Options, each a train.py flag of the same name with this default (config.py reads the help from these lines):
        clip_low: PPO clip: ratio >= 1 - clip_low
        clip_high: PPO clip: ratio <= 1 + clip_high
        beta: reference KL coefficient (estimator: --kl-estimator); 0 skips the reference model
        kl_estimator: per-token estimate of KL(pi_theta || pi_ref) (Schulman 2020, "Approximating KL divergence"): k3,
            the paper's; k1 (logp - ref_logp) or k2 (its square / 2)
        entropy_coef: entropy bonus: the loss subtracts this times the aggregated entropy of the policy's
            distributions (with its gradient); 0: none, the paper's runs
        loss_terms: extra loss terms (loss.py: LOSS_TERMS) with their coefficients, e.g. l2=0.1; each adds COEF x
            the aggregated term to the loss and logs the aggregate as loss/NAME
        loss_agg: loss aggregation; the paper's is token-mean, Dr. GRPO's seq-mean-token-sum-norm (length
            max-tokens)
        ratio: importance ratio the PPO clip acts on: token, the paper's; sequence, GSPO's (Zheng et al. 2025)
        is_correction: weights of the policy-gradient term for the gap between the sampler's and the trainer's
            log-probs, from pi_old / pi_sampler and --is-cap, detached (docs/training.md): token-tis,
            seq-tis (truncated), token-mask, seq-mask (masked); none: the paper's runs
        is_cap: --is-correction: the cap C on pi_old / pi_sampler (the mask modes keep [1/C, C])
    """
    mask = mask.to(logp.dtype)
    adv = adv.to(logp.dtype)[:, None]  # (B, 1): broadcast over the sequence's tokens
    log_ratio = choose(RATIOS, ratio, "importance ratio")(logp, old_logp, mask)  # (B, T)
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))  # rho_t (Section 4), (B, T)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)  # asymmetric [0.20, 0.28], no dual clip
    pg = torch.maximum(pg_unclipped, pg_clipped)  # max(-A rho_t, -A clip(rho_t, 1 - eps_low, 1 + eps_high)), (B, T)
    correction = choose(IS_CORRECTIONS, is_correction, "importance correction")(old_logp, sampler_logp, mask, is_cap)
    if correction is not None:
        is_weight, capped = correction  # (B, T) each: the weights, and where the cap truncated or masked
        pg = pg * is_weight  # (B, T), e.g. w_t = min(pi_old / pi_sampler, C)
    pg_loss = aggregate(pg, mask, loss_agg, denominator, norm_len)
    estimate_kl = choose(KL_ESTIMATORS, kl_estimator, "KL estimator")
    loss, kl = pg_loss, torch.zeros((), dtype=logp.dtype, device=logp.device)
    if ref_logp is not None and beta != 0:
        kl = aggregate(estimate_kl(logp, ref_logp), mask, loss_agg, denominator, norm_len)
        loss = pg_loss + beta * kl  # the KL is its own term, not folded into the reward
    extra = {}  # each further term's aggregate: logged as loss/NAME
    if entropy_coef != 0:
        if entropy is None:
            raise ValueError("entropy_coef needs the entropies: pass entropy (sequence_logprobs, entropy_grad=True)")
        extra["entropy"] = aggregate(entropy, mask, loss_agg, denominator, norm_len)
        loss = loss - entropy_coef * extra["entropy"]  # a bonus: higher entropy, lower loss
    for name, coef in term_weights(loss_terms).items():
        extra[name] = aggregate(LOSS_TERMS[name](logp, old_logp, mask), mask, loss_agg, denominator, norm_len)
        loss = loss + coef * extra[name]
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        # A token is "clipped" when the clip is the active branch, i.e. its gradient is zero.
        low = ((ratio < 1 - clip_low) & (adv < 0)).to(mask.dtype)
        high = ((ratio > 1 + clip_high) & (adv > 0)).to(mask.dtype)
        metrics = {
            "pg": Share(pg_loss.item()),
            "kl": Share(kl.item()),
            "clip_frac_low": TokenMean(((low * mask).sum() / n).item()),
            "clip_frac_high": TokenMean(((high * mask).sum() / n).item()),
            "ratio_mean": TokenMean(((ratio * mask).sum() / n).item()),
        }
        if correction is not None:  # the uncapped pi_old / pi_sampler, and how often C truncates or masks
            raw = torch.exp((old_logp - sampler_logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
            metrics["is_ratio_mean"] = TokenMean(((raw * mask).sum() / n).item())
            metrics["is_clip_frac"] = TokenMean(((capped.to(mask.dtype) * mask).sum() / n).item())
        metrics.update({name: Share(value.item()) for name, value in extra.items()})
    return loss, metrics


# ---------------------------------------------------------------- the reference KL
# Each entry maps (logp, ref_logp), (B, T), to a per-token estimate of KL(pi_theta || pi_ref) on tokens drawn from
# pi_theta (J. Schulman, "Approximating KL divergence", 2020, http://joschu.net/blog/kl-approx.html). As loss terms
# their gradients differ: k1's is zero in expectation on-policy (E_pi[grad log pi] = 0).
def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = log(pi / pi_ref): unbiased, high variance, negative on some tokens."""
    return logp - ref_logp


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = (log(pi / pi_ref))^2 / 2: biased, low variance, >= 0."""
    return 0.5 * (logp - ref_logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT) ** 2


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 = exp(d) - d - 1 with d = ref_logp - logp: unbiased, low variance, >= 0 (the paper's)."""
    d = (ref_logp - logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return torch.exp(d) - d - 1


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


# ---------------------------------------------------------------- further loss terms (--loss-terms NAME=COEF,...)
# Each entry maps (logp, old_logp, mask), all (B, T), to per-token values (B, T); policy_loss aggregates them like
# the policy-gradient term, adds COEF times the aggregate to the loss and logs the aggregate as loss/NAME. None is
# built in; docs/fork.md adds one.
LOSS_TERMS = {}


def term_weights(text: str) -> dict[str, float]:
    """{name: coefficient} of --loss-terms ("l2=0.1,other=-1"); ValueError, one line naming the flag, for a piece that
    is not NAME=COEF, a coefficient that is not a finite number, a name given twice or not in LOSS_TERMS."""
    return parse_weights(text, "--loss-terms", LOSS_TERMS, not_a_pair=lambda piece: (
        f"{piece!r} is not NAME=COEF with a finite COEF (e.g. l2=0.1)"), unknown=lambda name: (
        f"unknown term {name!r}; choose from {', '.join(LOSS_TERMS) or 'none yet'} (loss.py: LOSS_TERMS)"))


# ---------------------------------------------------------------- the importance ratio
# Each entry maps (logp, old_logp, mask), all (B, T), to the log of the ratio the PPO clip acts on, (B, T), which
# policy_loss clamps to +-LOG_RATIO_LIMIT.
def token_log_ratio(logp, old_logp, mask):
    """The paper's: log rho_t = log pi_theta(z_t) - log pi_old(z_t), token by token."""
    return logp - old_logp


def sequence_log_ratio(logp, old_logp, mask):
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): log s_i = mean over the sequence's tokens of
    log pi_theta - log pi_old, so a sequence is clipped whole; in GSPO-token's form s_i,t = sg[s_i] pi_theta(z_t) /
    sg[pi_theta(z_t)]: the value s_i on every token, the gradient of each token's term through its own log-prob."""
    seq = ((logp - old_logp) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)  # (B, 1)
    return seq.detach() + (logp - logp.detach())  # (B, T): log s_i, with d/d logp_t = 1 on token t's own term


RATIOS = {"token": token_log_ratio, "sequence": sequence_log_ratio}


# ---------------------------------------------------------------- the sampler/trainer correction
# Each entry maps (old_logp, sampler_logp, mask, cap) to None (no correction) or a pair of (B, T) tensors: detached
# weights of the policy-gradient term, and where the cap truncated or masked the weight (loss/is_clip_frac). A weight
# 0 keeps its token in the denominator. How they match TRL's and verl's: docs/training.md.
def no_correction(old_logp, sampler_logp, mask, cap):
    return None  # the paper's runs: pi_old is taken to be the sampler's distribution


def _is_log_ratios(old_logp, sampler_logp, mask, per_sequence: bool):
    """log(pi_old / pi_sampler) per token, or per sequence (the sum over its tokens: the log of the product of the
    token ratios) broadcast to its tokens; detached, clamped to +-LOG_RATIO_LIMIT. (B, T)."""
    log_w = (old_logp - sampler_logp).detach()
    if per_sequence:
        log_w = (log_w * mask).sum(-1, keepdim=True).expand_as(log_w)  # (B, T): log prod_t w_t
    return log_w.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def _truncated(log_w, cap):
    w = torch.exp(log_w)
    return w.clamp(max=cap), w > cap  # w = min(ratio, C)


def _masked(log_w, cap):
    if not cap >= 1:
        raise ValueError(f"--is-cap {cap}: a mask correction keeps ratios in [1/C, C], empty for C < 1")
    outside = log_w.abs() > math.log(cap)  # ratio outside [1/C, C]
    return torch.exp(log_w).masked_fill(outside, 0.0), outside  # w = ratio inside the band, else 0


def tis_weights(old_logp, sampler_logp, mask, cap):
    """Token-level truncated IS: w_t = min(pi_old(z_t) / pi_sampler(z_t), C)."""
    return _truncated(_is_log_ratios(old_logp, sampler_logp, mask, per_sequence=False), cap)


def seq_tis_weights(old_logp, sampler_logp, mask, cap):
    """Sequence-level truncated IS: w_i = min(prod_t pi_old(z_t) / pi_sampler(z_t), C) on every token of sequence i."""
    return _truncated(_is_log_ratios(old_logp, sampler_logp, mask, per_sequence=True), cap)


def token_mask_weights(old_logp, sampler_logp, mask, cap):
    """Token-level masked IS: w_t = pi_old / pi_sampler where it lies in [1/C, C], else 0 (the token drops out)."""
    return _masked(_is_log_ratios(old_logp, sampler_logp, mask, per_sequence=False), cap)


def seq_mask_weights(old_logp, sampler_logp, mask, cap):
    """Sequence-level masked IS: w_i = prod_t pi_old / pi_sampler where it lies in [1/C, C], else 0 (the whole
    sequence drops out)."""
    return _masked(_is_log_ratios(old_logp, sampler_logp, mask, per_sequence=True), cap)


IS_CORRECTIONS = {"none": no_correction, "token-tis": tis_weights, "seq-tis": seq_tis_weights,
                  "token-mask": token_mask_weights, "seq-mask": seq_mask_weights}


# ---------------------------------------------------------------- the KL term's reference policy (--reference)
# An entry moves one float32 tensor of the reference (train.py passes this rank's shards) toward the policy's, in
# place, after optimizer step `step` (1, 2, ...); None: frozen, the initial model (the paper's). train.py saves a
# moving reference in each checkpoint, so a resumed run equals the straight one.

def ema_reference(ref, policy, step, ref_ema, ref_reset_every):
    """ref <- (1 - ref_ema) ref + ref_ema policy (TRL's ref_model_mixup_alpha)."""
    ref.lerp_(policy, ref_ema)


def reset_reference(ref, policy, step, ref_ema, ref_reset_every):
    """ref <- policy every ref_reset_every optimizer steps (TRL's ref_model_sync_steps)."""
    if step % ref_reset_every == 0:
        ref.copy_(policy)


REFERENCES = {"frozen": None, "ema": ema_reference, "reset": reset_reference}


# ---------------------------------------------------------------- batch filters (--row-filter, --mask-truncated)
# (G, M) rewards and truncation flags -> the samples the loss keeps. A dropped one gets no weight and leaves the
# denominator (train.py zeroes its mask row) but counts in its group's advantages; every rank still runs every
# micro-batch, so FSDP2's collectives stay in step even where a filter leaves a rank no sample.
def keep_all(rewards, truncated):
    return torch.ones_like(truncated)  # (G, M): the paper's runs


def drop_truncated(rewards, truncated):
    return ~truncated  # (G, M): DAPO's overlong filtering (--mask-truncated), a cut answer was never judged whole


ROW_FILTERS = {"none": keep_all, "truncated": drop_truncated}


# ---------------------------------------------------------------- loss aggregation (the denominator)
# Each mode returns per-token weights (B, T) and this micro-batch's share of the denominator. The loss is
# sum(values * weights) / denominator, with the denominator summed over every micro-batch of the optimizer
# minibatch on every rank before the first backward: so no mode depends on the micro-batch size or on the
# number of ranks (tests/test_loss.py::test_every_aggregation_is_invariant_to_micro_batches_and_ranks).
def token_mean(mask, norm_len):
    """The paper's (Appendix B.1): every completion token of the minibatch weighs 1 / (number of tokens)."""
    return mask, mask.sum()


def sequences(mask):
    """The number of sequences with a token in the loss: --mask-truncated zeroes whole rows of the mask."""
    return (mask > 0).any(-1).sum().to(mask.dtype)


def seq_mean_token_mean(mask, norm_len):
    """Each sequence's token mean, averaged over the minibatch's sequences."""
    return mask / mask.sum(-1, keepdim=True).clamp(min=1), sequences(mask)


def seq_mean_token_sum_norm(mask, norm_len):
    """Dr. GRPO: token sum / (number of sequences x a constant length), so long answers are not discounted."""
    if norm_len is None:
        raise ValueError("loss aggregation seq-mean-token-sum-norm needs norm_len (the maximum completion length)")
    return mask, sequences(mask) * norm_len


AGGREGATIONS = {
    "token-mean": token_mean,
    "seq-mean-token-mean": seq_mean_token_mean,
    "seq-mean-token-sum-norm": seq_mean_token_sum_norm,
}


# policy_loss's options that name an entry of a registry: config.py makes the registry's keys the flag's choices.
OPTION_CHOICES = {"kl_estimator": KL_ESTIMATORS, "loss_agg": AGGREGATIONS, "ratio": RATIOS,
                  "is_correction": IS_CORRECTIONS}


def loss_denominator(mask: torch.Tensor, agg: str = "token-mean", norm_len: int | None = None) -> torch.Tensor:
    """This micro-batch's share of the loss denominator (0-d float tensor); sum it over the minibatch and ranks."""
    return choose(AGGREGATIONS, agg, "loss aggregation")(mask.float(), norm_len)[1].float()


def aggregate(values: torch.Tensor, mask: torch.Tensor, agg: str = "token-mean",
              denominator: torch.Tensor | float | None = None, norm_len: int | None = None) -> torch.Tensor:
    """Reduce per-token values (B, T) over the masked tokens: sum(values * weights) / denominator.

    `denominator` is the whole minibatch's (the sum of `loss_denominator` over its micro-batches and ranks);
    None uses this batch's own, for a batch that is the whole minibatch.
    """
    weights, share = choose(AGGREGATIONS, agg, "loss aggregation")(mask.to(values.dtype), norm_len)  # (B, T), ()
    denominator = torch.as_tensor(share if denominator is None else denominator, dtype=values.dtype,
                                  device=values.device)
    return (values * weights).sum() / denominator.where(denominator > 0, 1)  # every row masked: a loss of 0
