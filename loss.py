"""PPO-clip + reference-KL loss (Section 4, Eqs. 10-11; clip [0.20, 0.28], k3, token-mean: Appendix B.1).

python -m pytest tests/test_loss.py
"""

import math
from functools import partial

import torch

from plumbing.cli import choose, parse_weights

LOG_RATIO_LIMIT = 20.0  # keeps ratio and k3 finite


class Share(float):
    """A metric summed over a minibatch's micro-batches."""


class TokenMean(float):
    """A token mean, weighed by its token count."""

    @classmethod
    def of(cls, values: torch.Tensor, mask: torch.Tensor) -> "TokenMean":
        return cls(((values.to(mask.dtype) * mask).sum() / mask.sum().clamp(min=1)).item())  # a bool counts 1


def policy_loss(
    logp,
    old_logp,
    adv,
    mask,
    *,
    ref_logp=None,
    sampler_logp=None,
    entropy=None,
    denominator=None,
    norm_len=None,
    clip_low=0.2,
    clip_high=0.28,
    beta=1e-3,
    kl_estimator="k3",
    entropy_coef=0.0,
    loss_terms="",
    loss_agg="token-mean",
    ratio="token",
    is_correction="none",
    is_cap=2.0,
    pg_loss="ppo",
    top_entropy=1.0,
):
    """PPO clipped surrogate + beta * reference KL (Section 4) -> (loss, metrics). Tensors (B, T); adv: (B,).

    Options (config.py makes each a train.py flag with this help):
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
        pg_loss: the policy-gradient term (loss.py: PG_LOSSES): ppo, the paper's clip (Eq. 10); dual-clip, cispo, sapo
        top_entropy: keep the policy-gradient term on this share of tokens, highest entropy first (TRL's); 1: all
    """
    if entropy is None and (top_entropy < 1 or entropy_coef != 0):
        raise ValueError(
            f"{'top_entropy' if top_entropy < 1 else 'entropy_coef'} needs the entropies: pass entropy "
            "(sequence_logprobs, entropy=True; entropy_grad=True for entropy_coef's gradient)"
        )
    mask = mask.to(logp.dtype)
    adv = adv.to(logp.dtype)[:, None]  # (B, 1)
    log_rho = choose(RATIOS, ratio, "importance ratio")(logp, old_logp, mask)  # (B, T); no option name is rebound
    rho = torch.exp(log_rho.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))  # rho_t, (B, T)
    pg, pg_metrics = choose(PG_LOSSES, pg_loss, "policy-gradient term")(logp, rho, adv, clip_low, clip_high)  # Eq. 10
    if top_entropy < 1 and mask.any():  # a micro-batch with no token (all masked) has nothing to keep
        kept = entropy.detach() >= torch.quantile(entropy.detach()[mask > 0].float(), 1 - top_entropy)  # (B, T)
        pg, pg_metrics["entropy_kept_frac"] = pg * kept, kept
    correction = choose(IS_CORRECTIONS, is_correction, "importance correction")(old_logp, sampler_logp, mask, is_cap)
    if correction is not None:
        pg = pg * correction[0]
    pg_mean = aggregate(pg, mask, loss_agg, denominator, norm_len)
    estimate_kl = choose(KL_ESTIMATORS, kl_estimator, "KL estimator")
    loss, kl = pg_mean, torch.zeros((), dtype=logp.dtype, device=logp.device)
    if ref_logp is not None and beta != 0:
        kl = aggregate(estimate_kl(logp, ref_logp), mask, loss_agg, denominator, norm_len)
        loss = pg_mean + beta * kl
    extra = {}
    if entropy_coef != 0:
        extra["entropy"] = aggregate(entropy, mask, loss_agg, denominator, norm_len)
        loss = loss - entropy_coef * extra["entropy"]
    for name, coef in parse_weights(loss_terms, "--loss-terms", LOSS_TERMS, "NAME=COEF (e.g. l2=0.1)").items():
        extra[name] = aggregate(LOSS_TERMS[name](logp, old_logp, mask), mask, loss_agg, denominator, norm_len)
        loss = loss + coef * extra[name]
    with torch.no_grad():
        metrics = {
            "pg": Share(pg_mean.item()),
            "kl": Share(kl.item()),
            "clip_frac_low": TokenMean.of((rho < 1 - clip_low) & (adv < 0), mask),
            "clip_frac_high": TokenMean.of((rho > 1 + clip_high) & (adv > 0), mask),
            "ratio_mean": TokenMean.of(rho, mask),
            **{k: TokenMean.of(v, mask) for k, v in pg_metrics.items()},
        }
        if correction is not None:
            raw = torch.exp((old_logp - sampler_logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
            metrics.update(is_ratio_mean=TokenMean.of(raw, mask), is_clip_frac=TokenMean.of(correction[1], mask))
        metrics.update({name: Share(value.item()) for name, value in extra.items()})
    return loss, metrics


# --pg-loss: (logp, rho = pi_theta / pi_old, adv (B, 1), clip_low, clip_high) -> (loss (B, T), {loss/ metric: (B, T)})
def ppo(logp, rho, adv, clip_low, clip_high):
    return torch.maximum(-adv * rho, -adv * rho.clamp(1 - clip_low, 1 + clip_high)), {}  # Eq. 10


def dual_clip(logp, rho, adv, clip_low, clip_high, c=3.0):  # Ye et al. 2020 (arXiv 1912.09729), verl's clip_ratio_c
    pg, bound = ppo(logp, rho, adv, clip_low, clip_high)[0], torch.where(adv < 0, -c * adv, torch.inf)  # c |A| at most
    return torch.minimum(pg, bound), {"dual_clip_frac": pg > bound}


def cispo(logp, rho, adv, clip_low, clip_high):  # MiniMax-M1 (arXiv 2506.13585): every token keeps a gradient
    clipped = rho.clamp(1 - clip_low, 1 + clip_high)
    return -adv * clipped.detach() * logp, {"cispo_clip_frac": clipped != rho}


def sapo(logp, rho, adv, clip_low, clip_high, tau_pos=1.0, tau_neg=1.05):  # arXiv 2511.20347, its temperatures
    tau = torch.where(adv > 0, adv.new_tensor(tau_pos), tau_neg)  # in adv's dtype
    gate = torch.sigmoid(tau * (rho - 1))  # the clip made a soft gate
    return -adv * gate * 4 / tau, {"sapo_gate_weight": 4 * gate * (1 - gate)}  # its gradient's share of PPO's


PG_LOSSES = {"ppo": ppo, "dual-clip": dual_clip, "cispo": cispo, "sapo": sapo}  # ppo: the paper's


# --kl-estimator: per-token KL(pi_theta || pi_ref), (B, T)
def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    d = (ref_logp - logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return torch.exp(d) - d - 1  # k3, the paper's


KL_ESTIMATORS = {
    "k1": lambda logp, ref_logp: logp - ref_logp,
    "k2": lambda logp, ref_logp: 0.5 * (logp - ref_logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT) ** 2,
    "k3": kl_k3,
}


# --loss-terms NAME=COEF: (logp, old_logp, mask) -> per-token values (B, T)
LOSS_TERMS = {}


# --ratio: (logp, old_logp, mask) -> log ratio, (B, T)
def sequence_log_ratio(logp, old_logp, mask):
    """GSPO-token: the sequence's mean log-ratio on each token, each token's gradient its own."""
    seq = ((logp - old_logp) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)  # (B, 1)
    return seq.detach() + (logp - logp.detach())


RATIOS = {"token": lambda logp, old_logp, mask: logp - old_logp, "sequence": sequence_log_ratio}  # token: the paper's


# --is-correction: -> None, or (weights, where the cap acted), (B, T) each
def is_weights(old_logp, sampler_logp, mask, cap, *, per_sequence: bool, masked: bool):
    """r = pi_old / pi_sampler: truncated min(r, C), or masked to [1/C, C]."""
    log_w = (old_logp - sampler_logp).detach()
    if per_sequence:
        log_w = (log_w * mask).sum(-1, keepdim=True).expand_as(log_w)
    log_w = log_w.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    if not masked:
        w = torch.exp(log_w)
        return w.clamp(max=cap), w > cap
    if not cap >= 1:
        raise ValueError(f"--is-cap {cap}: a mask correction keeps ratios in [1/C, C], empty for C < 1")
    outside = log_w.abs() > math.log(cap)
    return torch.exp(log_w).masked_fill(outside, 0.0), outside


IS_CORRECTIONS = {
    "none": lambda old_logp, sampler_logp, mask, cap: None,  # the paper's
    "token-tis": partial(is_weights, per_sequence=False, masked=False),
    "seq-tis": partial(is_weights, per_sequence=True, masked=False),
    "token-mask": partial(is_weights, per_sequence=False, masked=True),
    "seq-mask": partial(is_weights, per_sequence=True, masked=True),
}


# --reference: update the reference in place after optimizer step `step`; ema: TRL's ref_model_mixup_alpha
def reset_reference(ref, policy, step, ref_ema, ref_reset_every):
    if step % ref_reset_every == 0:  # TRL's ref_model_sync_steps
        ref.copy_(policy)


REFERENCES = {
    "frozen": None,
    "ema": lambda ref, policy, step, ref_ema, ref_reset_every: ref.lerp_(policy, ref_ema),
    "reset": reset_reference,
}


# --row-filter: (G, M) rewards, truncated -> kept samples
ROW_FILTERS = {
    "none": lambda rewards, truncated: torch.ones_like(truncated),
    "truncated": lambda rewards, truncated: ~truncated,
}  # DAPO's overlong filtering


def kept_samples(rewards, truncated, row_filter: str = "none", mask_truncated: bool = False):
    """(G, M) bools: the samples --row-filter and --mask-truncated keep."""
    truncated = truncated.bool()
    return (ROW_FILTERS[row_filter](rewards, truncated) & (~truncated if mask_truncated else True)).expand_as(truncated)


# --loss-agg: (mask, norm_len) -> weights (B, T), this micro-batch's share of the denominator
def sequences(mask):
    return (mask > 0).any(-1).sum().to(mask.dtype)  # rows with a token


def seq_mean_token_mean(mask, norm_len):
    return mask / mask.sum(-1, keepdim=True).clamp(min=1), sequences(mask)


def seq_mean_token_sum_norm(mask, norm_len):  # Dr. GRPO
    if norm_len is None:
        raise ValueError("loss aggregation seq-mean-token-sum-norm needs norm_len (the maximum completion length)")
    return mask, sequences(mask) * norm_len


AGGREGATIONS = {
    "token-mean": lambda mask, norm_len: (mask, mask.sum()),  # Appendix B.1
    "seq-mean-token-mean": seq_mean_token_mean,
    "seq-mean-token-sum-norm": seq_mean_token_sum_norm,
}

OPTION_CHOICES = {
    "kl_estimator": KL_ESTIMATORS,
    "loss_agg": AGGREGATIONS,
    "ratio": RATIOS,
    "is_correction": IS_CORRECTIONS,
    "pg_loss": PG_LOSSES,
}


def loss_denominator(mask: torch.Tensor, agg: str = "token-mean", norm_len: int | None = None) -> torch.Tensor:
    """This micro-batch's share of the loss denominator (0-d); sum over minibatch and ranks."""
    return choose(AGGREGATIONS, agg, "loss aggregation")(mask.float(), norm_len)[1].float()


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    agg: str = "token-mean",
    denominator: torch.Tensor | float | None = None,
    norm_len: int | None = None,
) -> torch.Tensor:
    """sum(values * weights) / denominator (None: this batch's own)."""
    weights, share = choose(AGGREGATIONS, agg, "loss aggregation")(mask.to(values.dtype), norm_len)
    denominator = torch.as_tensor(share if denominator is None else denominator).to(values)
    return (values * weights).sum() / denominator.where(denominator > 0, 1)
