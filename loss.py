"""PPO-clip + reference-KL loss (Section 4, Eqs. 10-11; clip [0.20, 0.28], k3, token-mean: Appendix B.1).

python -m pytest tests/test_loss.py
"""

import math
from functools import partial

import torch

from plumbing.cli import parse_weights

LOG_RATIO_LIMIT = 20.0  # not in the paper: |log ratio| <= 20 keeps exp() of it (the ratio, k3) and its square finite


def clamp_log(log_ratio):
    """`log_ratio` within +-LOG_RATIO_LIMIT: one token far off the policy cannot make the loss inf or NaN."""
    return log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


class Share(float):
    """A metric summed over a minibatch's micro-batches."""


class TokenMean(float):
    """A token mean, weighed by its token count."""

    @classmethod
    def of(cls, values, mask):
        """The mean of `values` over the tokens `mask` keeps, (B, T) each."""
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
    mask = mask.to(logp.dtype)
    adv = adv.to(logp.dtype)[:, None]  # (B, 1)
    log_rho = RATIOS[ratio](logp, old_logp, mask)  # (B, T)
    rho = torch.exp(clamp_log(log_rho))  # rho_t = pi_theta / pi_old (Eq. 10), (B, T)
    pg, pg_metrics = PG_LOSSES[pg_loss](logp, rho, adv, clip_low, clip_high)  # Eq. (10)'s per-token term
    if top_entropy < 1 and mask.any():  # a micro-batch with no token (all masked) has nothing to keep
        threshold = torch.quantile(entropy.detach()[mask > 0].float(), 1 - top_entropy)
        kept = entropy.detach() >= threshold  # (B, T)
        pg = pg * kept
        pg_metrics["entropy_kept_frac"] = kept
    correction = IS_CORRECTIONS[is_correction](old_logp, sampler_logp, mask, is_cap)
    if correction is not None:
        pg = pg * correction[0]

    def mean_of(values):  # Eq. (10)'s outer mean, over tokens as --loss-agg weighs them
        return aggregate(values, mask, loss_agg, denominator, norm_len)

    pg_mean = mean_of(pg)
    loss = pg_mean
    kl = torch.zeros(())  # logged only: 0 without a reference
    if ref_logp is not None and beta != 0:  # beta = 0 skips the reference model
        kl = mean_of(KL_ESTIMATORS[kl_estimator](logp, ref_logp))
        loss = pg_mean + beta * kl  # Eq. (11)
    extra = {}
    if entropy_coef != 0:
        extra["entropy"] = mean_of(entropy)
        loss = loss - entropy_coef * extra["entropy"]
    for name, coef in loss_term_coefs(loss_terms).items():
        extra[name] = mean_of(LOSS_TERMS[name](logp, old_logp, mask))
        loss = loss + coef * extra[name]
    with torch.no_grad():
        clipped_low = (rho < 1 - clip_low) & (adv < 0)  # the clip acted: these tokens get no gradient
        clipped_high = (rho > 1 + clip_high) & (adv > 0)
        metrics = {
            "pg": Share(pg_mean.item()),
            "kl": Share(kl.item()),
            "clip_frac_low": TokenMean.of(clipped_low, mask),
            "clip_frac_high": TokenMean.of(clipped_high, mask),
            "ratio_mean": TokenMean.of(rho, mask),
        }
        for key, value in pg_metrics.items():
            metrics[key] = TokenMean.of(value, mask)
        if correction is not None:
            raw = torch.exp(clamp_log(old_logp - sampler_logp))  # per token, before the cap
            metrics["is_ratio_mean"] = TokenMean.of(raw, mask)
            metrics["is_clip_frac"] = TokenMean.of(correction[1], mask)  # where the cap (or the mask) acted
        for key, value in extra.items():
            metrics[key] = Share(value.item())
    return loss, metrics


# --pg-loss: (logp, rho = pi_theta / pi_old, adv (B, 1), clip_low, clip_high) -> (loss (B, T), {loss/ metric: (B, T)})
def ppo(logp, rho, adv, clip_low, clip_high):
    """The paper's PPO clip: max(-A rho, -A clip(rho, 1 - clip_low, 1 + clip_high)) per token."""
    clipped = rho.clamp(1 - clip_low, 1 + clip_high)
    return torch.maximum(-adv * rho, -adv * clipped), {}  # Eq. (10)


def dual_clip(logp, rho, adv, clip_low, clip_high):
    """Dual-clip PPO (Ye et al. 2020, arXiv 1912.09729; verl's clip_ratio_c, 3): PPO's term, at most 3 |A| if A < 0."""
    pg = ppo(logp, rho, adv, clip_low, clip_high)[0]
    bound = torch.where(adv < 0, -3.0 * adv, torch.inf)  # a huge rho on a negative advantage cannot blow the loss up
    return torch.minimum(pg, bound), {"dual_clip_frac": pg > bound}


def cispo(logp, rho, adv, clip_low, clip_high):
    """CISPO (MiniMax-M1, arXiv 2506.13585): -A sg(clip(rho)) log pi, so every token keeps a gradient."""
    clipped = rho.clamp(1 - clip_low, 1 + clip_high)
    return -adv * clipped.detach() * logp, {"cispo_clip_frac": clipped != rho}


def sapo(logp, rho, adv, clip_low, clip_high):
    """SAPO (arXiv 2511.20347): the hard clip made a sigmoid gate; its temperatures, 1 for A > 0 and 1.05 else, are
    the paper's defaults."""
    tau = torch.where(adv > 0, adv.new_tensor(1.0), 1.05)  # in adv's dtype; a softer gate on A < 0
    gate = torch.sigmoid(tau * (rho - 1))
    weight = 4 * gate * (1 - gate)  # its gradient's share of PPO's unclipped one: 1 at rho = 1
    return -adv * gate * 4 / tau, {"sapo_gate_weight": weight}


PG_LOSSES = {"ppo": ppo, "dual-clip": dual_clip, "cispo": cispo, "sapo": sapo}  # ppo: the paper's


# --kl-estimator: per-token KL(pi_theta || pi_ref), (B, T)
def kl_k1(logp, ref_logp):
    """k1: log(pi_theta / pi_ref), unbiased, can go negative."""
    return logp - ref_logp


def kl_k2(logp, ref_logp):
    """k2: log(pi_theta / pi_ref)^2 / 2, low variance, biased."""
    return 0.5 * clamp_log(logp - ref_logp) ** 2


def kl_k3(logp, ref_logp):
    """k3, the paper's: r - log r - 1 with r = pi_ref / pi_theta, unbiased and never negative."""
    d = clamp_log(ref_logp - logp)
    return torch.exp(d) - d - 1


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


# --loss-terms NAME=COEF: (logp, old_logp, mask) -> per-token values (B, T)
LOSS_TERMS = {}


def loss_term_coefs(loss_terms):
    """{NAME: COEF} of --loss-terms; ValueError "--loss-terms: ..." for a list config.py refuses at start."""
    return parse_weights(loss_terms, "--loss-terms", LOSS_TERMS, "NAME=COEF (e.g. l2=0.1)")


# --ratio: (logp, old_logp, mask) -> log ratio, (B, T)
def token_log_ratio(logp, old_logp, mask):
    """The paper's: log(pi_theta / pi_old) per token."""
    return logp - old_logp


def sequence_log_ratio(logp, old_logp, mask):
    """GSPO-token: the sequence's mean log-ratio on each token, each token's gradient its own."""
    seq = ((logp - old_logp) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)  # (B, 1)
    return seq.detach() + (logp - logp.detach())  # the value of seq, the gradient of the token's own log-prob


RATIOS = {"token": token_log_ratio, "sequence": sequence_log_ratio}


# --is-correction: -> None, or (weights, where the cap acted), (B, T) each
def no_correction(old_logp, sampler_logp, mask, cap):
    """The paper's: no sampler/trainer correction."""
    return None


def is_weights(old_logp, sampler_logp, mask, cap, *, per_sequence: bool, masked: bool):
    """r = pi_old / pi_sampler: truncated min(r, C), or masked to [1/C, C] (config.py holds C >= 1 for a mask)."""
    log_w = (old_logp - sampler_logp).detach()  # a weight, not a path for the gradient
    if per_sequence:
        log_w = (log_w * mask).sum(-1, keepdim=True).expand_as(log_w)  # log of the sequence's product of ratios
    log_w = clamp_log(log_w)
    if not masked:
        w = torch.exp(log_w)
        return w.clamp(max=cap), w > cap
    outside = log_w.abs() > math.log(cap)
    return torch.exp(log_w).masked_fill(outside, 0.0), outside


IS_CORRECTIONS = {
    "none": no_correction,
    "token-tis": partial(is_weights, per_sequence=False, masked=False),
    "seq-tis": partial(is_weights, per_sequence=True, masked=False),
    "token-mask": partial(is_weights, per_sequence=False, masked=True),
    "seq-mask": partial(is_weights, per_sequence=True, masked=True),
}


# --reference: update the reference in place after optimizer step `step`
def ema_reference(ref, policy, step, ref_ema, ref_reset_every):
    """TRL's ref_model_mixup_alpha: ref <- ref + ref_ema (policy - ref)."""
    ref.lerp_(policy, ref_ema)


def reset_reference(ref, policy, step, ref_ema, ref_reset_every):
    """TRL's ref_model_sync_steps: ref <- policy every ref_reset_every steps."""
    if step % ref_reset_every == 0:
        ref.copy_(policy)


REFERENCES = {"frozen": None, "ema": ema_reference, "reset": reset_reference}  # frozen: the paper's


# --row-filter: (G, M) rewards, truncated -> kept samples
def keep_all(rewards, truncated):
    return torch.ones_like(truncated)


def drop_truncated(rewards, truncated):
    """DAPO's overlong filtering: a cut-off answer has no fair reward."""
    return ~truncated


ROW_FILTERS = {"none": keep_all, "truncated": drop_truncated}


def kept_samples(rewards, truncated, row_filter="none", mask_truncated=False):
    """(G, M) bools: the samples --row-filter (a ROW_FILTERS name) and --mask-truncated (a bool) keep."""
    truncated = truncated.bool()
    kept = ROW_FILTERS[row_filter](rewards, truncated)
    if mask_truncated:
        kept = kept & ~truncated
    return kept.expand_as(truncated)  # a filter may answer per group, (G, 1)


# --loss-agg: (mask, norm_len) -> weights (B, T), this micro-batch's share of the denominator
def sequences(mask):
    """The rows with a token."""
    return (mask > 0).any(-1).sum().to(mask.dtype)


def token_mean(mask, norm_len):
    """Appendix B.1: every loss token of the minibatch weighs the same."""
    return mask, mask.sum()


def seq_mean_token_mean(mask, norm_len):
    """Each sequence's token mean, averaged over sequences."""
    return mask / mask.sum(-1, keepdim=True).clamp(min=1), sequences(mask)


def seq_mean_token_sum_norm(mask, norm_len):
    """Dr. GRPO: token sums over sequences x the maximum length, a constant however long each answer is."""
    return mask, sequences(mask) * norm_len


AGGREGATIONS = {
    "token-mean": token_mean,
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


def loss_denominator(mask, agg="token-mean", norm_len=None):
    """This micro-batch's share (0-d) of --loss-agg `agg`'s denominator, from its mask (B, T) and norm_len (the
    maximum completion length, for seq-mean-token-sum-norm); train.py sums it over the minibatch and the ranks."""
    _, share = AGGREGATIONS[agg](mask.float(), norm_len)
    return share.float()


def aggregate(values, mask, agg="token-mean", denominator=None, norm_len=None):
    """sum(values * weights) / denominator, a 0-d tensor: values and mask (B, T), `agg` an AGGREGATIONS name, the
    denominator a tensor or number (None: this micro-batch's own share, as if it were the whole minibatch)."""
    weights, share = AGGREGATIONS[agg](mask.to(values.dtype), norm_len)
    if denominator is None:
        denominator = share
    denominator = torch.as_tensor(denominator).to(values)
    return (values * weights).sum() / denominator.where(denominator > 0, 1)  # every row masked: 0, not NaN
