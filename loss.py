"""The PPO-clip + reference-KL loss SoftmaxGRPO trains with (Section 4, Eqs. 10-11).

    rho_t = pi_theta(z_t | x, z_<t) / pi_old(z_t | x, z_<t)                          (Section 4)
    L_pg  = agg_t[ max(-A * rho_t, -A * clip(rho_t, 1 - clip_low, 1 + clip_high)) ]
    L     = L_pg + beta * agg_t[ k3(pi_theta, pi_ref) ]  (- entropy_coef * agg_t[ H_t ] + sum_k c_k agg_t[ term_k ])

with the asymmetric clip range [0.20, 0.28], no dual clip, the k3 reference KL as a separate term and token-mean
aggregation, as in the paper's runs (Appendix B.1); A, one number per sequence (advantage.py), covers its tokens.
Each choice below is a registry whose keys are its flag's choices, the defaults the paper's; a fork adds one in one
edit (docs/fork.md). Each option of `policy_loss` with a default is a train.py flag, each metric it returns loss/NAME.

    python -m pytest tests/test_loss.py
"""

import math
from functools import partial

import torch

from plumbing.cli import choose, term_weights
from plumbing.run_log import Share, TokenMean
from speed.logprobs import pad_batch, sequence_logprobs, token_logprobs  # noqa: F401 (the log-probs it takes)

LOG_RATIO_LIMIT = 20.0  # exp(20) ~ 5e8: keeps ratio and k3 finite when policies drift far apart


def policy_loss(logp, old_logp, adv, mask, *, ref_logp=None, sampler_logp=None, entropy=None, denominator=None,
                norm_len=None, clip_low=0.2, clip_high=0.28, beta=1e-3, kl_estimator="k3", entropy_coef=0.0,
                loss_terms="", loss_agg="token-mean", ratio="token", is_correction="none", is_cap=2.0):
    """PPO clipped surrogate + beta * reference KL (Section 4) with the options below -> (loss, metrics), each metric
    a Share or a TokenMean (how train.py reduces it over micro-batches and ranks). logp, old_logp, ref_logp,
    sampler_logp, entropy, mask: (B, T); adv: (B,). `denominator`, `norm_len`: see `aggregate`.

    Options, each a train.py flag of the same name with this default (config.py reads the help from these lines):
        clip_low: PPO clip: ratio >= 1 - clip_low
        clip_high: PPO clip: ratio <= 1 + clip_high
        beta: reference KL coefficient (estimator: --kl-estimator); 0 skips the reference model
        kl_estimator: per-token estimate of KL(pi_theta || pi_ref) (Schulman 2020, "Approximating KL divergence"): k3,
            the paper's; k1 (logp - ref_logp) or k2 (its square / 2)
        entropy_coef: entropy bonus: the loss subtracts this x the aggregated policy entropy, with its gradient; 0: off
        loss_terms: extra terms (loss.py: LOSS_TERMS), e.g. l2=0.1: each adds COEF x its aggregate, logged as loss/NAME
        loss_agg: loss aggregation: token-mean, the paper's; seq-mean-token-sum-norm, Dr. GRPO's (length max-tokens)
        ratio: importance ratio the PPO clip acts on: token, the paper's; sequence, GSPO's (Zheng et al. 2025)
        is_correction: detached weights of the policy-gradient term for the sampler/trainer gap, from pi_old /
            pi_sampler and --is-cap (docs/training.md): token-tis, seq-tis (truncated), token-mask, seq-mask (masked)
        is_cap: --is-correction: the cap C on pi_old / pi_sampler (the mask modes keep [1/C, C])
    """
    mask = mask.to(logp.dtype)
    adv = adv.to(logp.dtype)[:, None]  # (B, 1): broadcast over the sequence's tokens
    log_ratio = choose(RATIOS, ratio, "importance ratio")(logp, old_logp, mask)  # (B, T)
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))  # rho_t (Section 4), (B, T)
    pg_clipped = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)  # asymmetric [0.20, 0.28], no dual clip
    pg = torch.maximum(-adv * ratio, pg_clipped)  # max(-A rho_t, -A clip(rho_t, 1 - eps_low, 1 + eps_high)), (B, T)
    correction = choose(IS_CORRECTIONS, is_correction, "importance correction")(old_logp, sampler_logp, mask, is_cap)
    if correction is not None:  # (B, T) each: the weights, and where the cap truncated or masked them
        pg = pg * correction[0]  # (B, T), e.g. w_t = min(pi_old / pi_sampler, C)
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
    for name, coef in term_weights(loss_terms, LOSS_TERMS).items():
        extra[name] = aggregate(LOSS_TERMS[name](logp, old_logp, mask), mask, loss_agg, denominator, norm_len)
        loss = loss + coef * extra[name]
    with torch.no_grad():  # a token is "clipped" where the clip is the active branch: its gradient is zero
        metrics = {"pg": Share(pg_loss.item()), "kl": Share(kl.item()),
                   "clip_frac_low": TokenMean.of((ratio < 1 - clip_low) & (adv < 0), mask),
                   "clip_frac_high": TokenMean.of((ratio > 1 + clip_high) & (adv > 0), mask),
                   "ratio_mean": TokenMean.of(ratio, mask)}
        if correction is not None:  # the uncapped pi_old / pi_sampler, and how often C truncates or masks
            raw = torch.exp((old_logp - sampler_logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
            metrics.update(is_ratio_mean=TokenMean.of(raw, mask), is_clip_frac=TokenMean.of(correction[1], mask))
        metrics.update({name: Share(value.item()) for name, value in extra.items()})
    return loss, metrics


# ---------------------------------------------------------------- the reference KL (--kl-estimator)
# (logp, ref_logp), (B, T) -> per-token estimates of KL(pi_theta || pi_ref) on tokens drawn from pi_theta (J. Schulman,
# http://joschu.net/blog/kl-approx.html); as loss terms k1's gradient is zero in expectation on-policy.
def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp  # k1 = log(pi / pi_ref): unbiased, high variance, negative on some tokens


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref_logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT) ** 2  # k2: biased, low variance, >= 0


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    d = (ref_logp - logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return torch.exp(d) - d - 1  # k3 = e^d - d - 1, d = ref_logp - logp: unbiased, low variance, >= 0 (the paper's)


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


# ---------------------------------------------------------------- further loss terms (--loss-terms NAME=COEF,...)
# (logp, old_logp, mask) -> per-token values (B, T); the loss adds COEF x their aggregate, logged as loss/NAME. None yet
LOSS_TERMS = {}


# ---------------------------------------------------------------- the importance ratio (--ratio)
# (logp, old_logp, mask), (B, T) -> the log of the ratio the PPO clip acts on, (B, T) (clamped to +-LOG_RATIO_LIMIT).
def token_log_ratio(logp, old_logp, mask):
    return logp - old_logp  # the paper's: log rho_t = log pi_theta(z_t) - log pi_old(z_t), token by token


def sequence_log_ratio(logp, old_logp, mask):
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): log s_i = mean over the sequence's tokens of
    log pi_theta - log pi_old, so a sequence is clipped whole; in GSPO-token's form s_i,t = sg[s_i] pi_theta(z_t) /
    sg[pi_theta(z_t)]: the value s_i on every token, the gradient of each token's term through its own log-prob."""
    seq = ((logp - old_logp) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)  # (B, 1)
    return seq.detach() + (logp - logp.detach())  # (B, T): log s_i, with d/d logp_t = 1 on token t's own term


RATIOS = {"token": token_log_ratio, "sequence": sequence_log_ratio}


# ---------------------------------------------------------------- the sampler/trainer correction (--is-correction)
# (old_logp, sampler_logp, mask, cap) -> None, or (B, T) detached weights of the policy-gradient term and where the cap
# truncated or masked them (loss/is_clip_frac); a weight 0 keeps its token in the denominator (docs/training.md).
def is_weights(old_logp, sampler_logp, mask, cap, *, per_sequence: bool, masked: bool):
    """r = pi_old / pi_sampler per token, or per sequence (the product over its tokens, on each): truncated IS,
    w = min(r, C), or masked IS, w = r in [1/C, C], else 0 (the token or sequence drops out)."""
    log_w = (old_logp - sampler_logp).detach()  # (B, T): log r_t
    if per_sequence:
        log_w = (log_w * mask).sum(-1, keepdim=True).expand_as(log_w)  # (B, T): log prod_t r_t
    log_w = log_w.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    if not masked:
        w = torch.exp(log_w)
        return w.clamp(max=cap), w > cap  # w = min(r, C)
    if not cap >= 1:
        raise ValueError(f"--is-cap {cap}: a mask correction keeps ratios in [1/C, C], empty for C < 1")
    outside = log_w.abs() > math.log(cap)  # r outside [1/C, C]
    return torch.exp(log_w).masked_fill(outside, 0.0), outside  # w = r inside the band, else 0


tis_weights = partial(is_weights, per_sequence=False, masked=False)  # token-level truncated IS: min(r_t, C)
IS_CORRECTIONS = {"none": lambda old_logp, sampler_logp, mask, cap: None,  # the paper's: pi_old taken as the sampler's
                  "token-tis": tis_weights,
                  "seq-tis": partial(is_weights, per_sequence=True, masked=False),  # min(prod_t r_t, C)
                  "token-mask": partial(is_weights, per_sequence=False, masked=True),
                  "seq-mask": partial(is_weights, per_sequence=True, masked=True)}


# ---------------------------------------------------------------- the KL term's reference policy (--reference)
# Moves a float32 tensor of the reference (this rank's shard) toward the policy's in place after optimizer step
# `step` (1, 2, ...); None: frozen, the paper's. A moving one is checkpointed: a resumed run equals the straight one.
def ema_reference(ref, policy, step, ref_ema, ref_reset_every):
    ref.lerp_(policy, ref_ema)  # ref <- (1 - ref_ema) ref + ref_ema policy (TRL's ref_model_mixup_alpha)


def reset_reference(ref, policy, step, ref_ema, ref_reset_every):
    if step % ref_reset_every == 0:  # ref <- policy every ref_reset_every optimizer steps (TRL's ref_model_sync_steps)
        ref.copy_(policy)


REFERENCES = {"frozen": None, "ema": ema_reference, "reset": reset_reference}


# ---------------------------------------------------------------- batch filters (--row-filter, --mask-truncated)
# (G, M) rewards and truncation flags -> the samples the loss keeps. A dropped one leaves the loss and its denominator
# (train.py zeroes its mask row) but counts in its group's advantages; every rank still runs every micro-batch.
def drop_truncated(rewards, truncated):
    return ~truncated  # (G, M): DAPO's overlong filtering (--mask-truncated), a cut answer was never judged whole


ROW_FILTERS = {"none": lambda rewards, truncated: torch.ones_like(truncated),  # the paper's runs: every sample
               "truncated": drop_truncated}


# ---------------------------------------------------------------- loss aggregation (--loss-agg: the denominator)
# (mask, norm_len) -> per-token weights (B, T) and this micro-batch's share of the denominator; the loss is
# sum(values * weights) / denominator, summed over the minibatch's micro-batches and ranks before the first backward,
# so no mode depends on either (tests/test_loss.py::test_every_aggregation_is_invariant_to_micro_batches_and_ranks).
def token_mean(mask, norm_len):
    return mask, mask.sum()  # the paper's (Appendix B.1): each completion token of the minibatch weighs 1 / #tokens


def sequences(mask):
    return (mask > 0).any(-1).sum().to(mask.dtype)  # the sequences with a token: --mask-truncated zeroes whole rows


def seq_mean_token_mean(mask, norm_len):
    return mask / mask.sum(-1, keepdim=True).clamp(min=1), sequences(mask)  # each sequence's token mean, averaged


def seq_mean_token_sum_norm(mask, norm_len):  # Dr. GRPO: token sum / (sequences x a constant length): no length bias
    if norm_len is None:
        raise ValueError("loss aggregation seq-mean-token-sum-norm needs norm_len (the maximum completion length)")
    return mask, sequences(mask) * norm_len


AGGREGATIONS = {"token-mean": token_mean, "seq-mean-token-mean": seq_mean_token_mean,
                "seq-mean-token-sum-norm": seq_mean_token_sum_norm}


OPTION_CHOICES = {"kl_estimator": KL_ESTIMATORS, "loss_agg": AGGREGATIONS, "ratio": RATIOS,  # policy_loss's options
                  "is_correction": IS_CORRECTIONS}  # that name a registry's entry: config.py makes its keys the choices


def loss_denominator(mask: torch.Tensor, agg: str = "token-mean", norm_len: int | None = None) -> torch.Tensor:
    """This micro-batch's share of the loss denominator (0-d float tensor); sum it over the minibatch and ranks."""
    return choose(AGGREGATIONS, agg, "loss aggregation")(mask.float(), norm_len)[1].float()


def aggregate(values: torch.Tensor, mask: torch.Tensor, agg: str = "token-mean",
              denominator: torch.Tensor | float | None = None, norm_len: int | None = None) -> torch.Tensor:
    """sum(values * weights) / denominator of per-token values (B, T): `denominator` the whole minibatch's (the sum
    of `loss_denominator` over its micro-batches and ranks), or None for this batch's own (a whole minibatch)."""
    weights, share = choose(AGGREGATIONS, agg, "loss aggregation")(mask.to(values.dtype), norm_len)  # (B, T), ()
    denominator = torch.as_tensor(share if denominator is None else denominator).to(values)  # values' dtype, device
    return (values * weights).sum() / denominator.where(denominator > 0, 1)  # every row masked: a loss of 0
