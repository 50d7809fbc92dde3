"""The PPO-clip + reference-KL loss SoftmaxGRPO trains with (Section 4, Eqs. 10-11), and the log-probs it takes.

    rho_t = pi_theta(z_t | x, z_<t) / pi_old(z_t | x, z_<t)                          (Section 4)
    L_pg  = agg_t[ max(-A * rho_t, -A * clip(rho_t, 1 - clip_low, 1 + clip_high)) ]
    L     = L_pg + beta * agg_t[ k3(pi_theta, pi_ref) ]

with the asymmetric clip range [0.20, 0.28], no dual clip, the k3 reference KL as a separate term and token-mean
aggregation, as in the paper's runs (Appendix B.1). A is one number per sequence (advantage.py), broadcast over its
tokens. Each choice is a registry a fork adds to in one edit (its keys are the flag's choices): RATIOS (--ratio),
IS_CORRECTIONS (--is-correction; token-tis is not in the paper's runs), REFERENCES (--reference), ROW_FILTERS
(--row-filter), AGGREGATIONS (--loss-agg). Below them the log-probs: the plain `token_logprobs`, and
`sequence_logprobs`, which computes the same with speed/logprobs.py's row-chunked kernel (no float32 (B, K, V)
tensor).

    python -m pytest tests/test_loss.py
"""

import torch

from speed.logprobs import chunked_token_logprobs

LOG_RATIO_LIMIT = 20.0  # exp(20) ~ 5e8: keeps ratio and k3 finite when policies drift far apart


def policy_loss(logp, old_logp, adv, mask, *, clip_low=0.2, clip_high=0.28, ref_logp=None, beta=1e-3,
                agg="token-mean", denominator=None, norm_len=None, ratio="token", is_correction="none",
                sampler_logp=None, is_cap=None):
    """PPO clipped surrogate + beta * k3 reference KL (Section 4). Returns (loss, metrics).

    logp, old_logp, ref_logp, sampler_logp, mask: (B, T); adv: (B,) per-sequence advantages. `ratio` names a
    RATIOS entry, `is_correction` an IS_CORRECTIONS entry (weights from old_logp, sampler_logp and the cap
    `is_cap`). `agg`, `denominator` and `norm_len` go
    to `aggregate`.
    """
    mask = mask.to(logp.dtype)
    adv = adv.to(logp.dtype)[:, None]  # (B, 1): broadcast over the sequence's tokens
    log_ratio = _choose(RATIOS, ratio, "importance ratio")(logp, old_logp, mask)  # (B, T)
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))  # rho_t (Section 4), (B, T)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)  # asymmetric [0.20, 0.28], no dual clip
    pg = torch.maximum(pg_unclipped, pg_clipped)  # max(-A rho_t, -A clip(rho_t, 1 - eps_low, 1 + eps_high)), (B, T)
    is_weight = _choose(IS_CORRECTIONS, is_correction, "importance correction")(old_logp, sampler_logp, is_cap)
    if is_weight is not None:
        pg = pg * is_weight  # (B, T), e.g. w_t = min(pi_old / pi_sampler, C)
    pg_loss = aggregate(pg, mask, agg, denominator, norm_len)
    loss, kl = pg_loss, torch.zeros((), dtype=logp.dtype, device=logp.device)
    if ref_logp is not None and beta != 0:
        kl = aggregate(kl_k3(logp, ref_logp), mask, agg, denominator, norm_len)
        loss = pg_loss + beta * kl  # the KL is its own term, not folded into the reward
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        # A token is "clipped" when the clip is the active branch, i.e. its gradient is zero.
        low = ((ratio < 1 - clip_low) & (adv < 0)).to(mask.dtype)
        high = ((ratio > 1 + clip_high) & (adv > 0)).to(mask.dtype)
        metrics = {
            "pg_loss": pg_loss.item(),
            "kl": kl.item(),
            "clip_frac_low": ((low * mask).sum() / n).item(),
            "clip_frac_high": ((high * mask).sum() / n).item(),
            "ratio_mean": ((ratio * mask).sum() / n).item(),
        }
        if is_weight is not None:  # the uncapped pi_old / pi_sampler, and how often C caps it
            raw = torch.exp((old_logp - sampler_logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
            metrics["is_ratio_mean"] = ((raw * mask).sum() / n).item()
            metrics["is_clip_frac"] = (((raw > is_cap).to(mask.dtype) * mask).sum() / n).item()
    return loss, metrics


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref): exp(d) - d - 1 with d = ref_logp - logp; >= 0."""
    d = (ref_logp - logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return torch.exp(d) - d - 1


# ---------------------------------------------------------------- the importance ratio
# Each entry maps (logp, old_logp, mask), all (B, T), to the log of the ratio the PPO clip acts on, (B, T), which
# policy_loss clamps to +-LOG_RATIO_LIMIT.
def token_log_ratio(logp, old_logp, mask):
    """The paper's: log rho_t = log pi_theta(z_t) - log pi_old(z_t), token by token."""
    return logp - old_logp


RATIOS = {"token": token_log_ratio}


# ---------------------------------------------------------------- the sampler/trainer correction
# Each entry maps (old_logp, sampler_logp, cap) to per-token weights (B, T) of the policy-gradient term, or None.
def no_correction(old_logp, sampler_logp, cap):
    return None  # the paper's runs: pi_old is taken to be the sampler's distribution


def tis_weights(old_logp, sampler_logp, cap):
    """Truncated importance weights w_t = min(pi_old / pi_sampler, C) per token (B, T), detached (no gradient)."""
    log_w = (old_logp - sampler_logp).detach().clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return torch.exp(log_w).clamp(max=cap)


IS_CORRECTIONS = {"none": no_correction, "token-tis": tis_weights}


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


def _choose(registry: dict, name: str, what: str):
    if name not in registry:
        raise ValueError(f"unknown {what} {name!r}; choose one of {', '.join(registry)}")
    return registry[name]


def loss_denominator(mask: torch.Tensor, agg: str = "token-mean", norm_len: int | None = None) -> torch.Tensor:
    """This micro-batch's share of the loss denominator (0-d float tensor); sum it over the minibatch and ranks."""
    return _choose(AGGREGATIONS, agg, "loss aggregation")(mask.float(), norm_len)[1].float()


def aggregate(values: torch.Tensor, mask: torch.Tensor, agg: str = "token-mean",
              denominator: torch.Tensor | float | None = None, norm_len: int | None = None) -> torch.Tensor:
    """Reduce per-token values (B, T) over the masked tokens: sum(values * weights) / denominator.

    `denominator` is the whole minibatch's (the sum of `loss_denominator` over its micro-batches and ranks);
    None uses this batch's own, for a batch that is the whole minibatch.
    """
    weights, share = _choose(AGGREGATIONS, agg, "loss aggregation")(mask.to(values.dtype), norm_len)  # (B, T), ()
    denominator = torch.as_tensor(share if denominator is None else denominator, dtype=values.dtype,
                                  device=values.device)
    return (values * weights).sum() / denominator.where(denominator > 0, 1)  # every row masked: a loss of 0


# ---------------------------------------------------------------- log-probs of the sampled tokens
def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, entropy: bool = False):
    """(B, T, V) logits, (B, T) targets -> (B, T) float32 log-probs under softmax(logits / temperature); with
    `entropy`, the pair (log-probs, (B, T) entropies of those distributions, no gradient)."""
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)  # (B, T, V) float32
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)  # (B, T)
    if not entropy:
        return logp
    return logp, -(logp_all.exp() * logp_all).sum(-1).detach()  # H = -sum_v p_v log p_v, (B, T)


def pad_batch(prompts: list[list[int]], completions: list[list[int]], pad_id: int):
    """Lay out (prompt, completion) pairs as [left-padded prompt | right-padded completion].

    Every completion then starts at the same column P, so the model's last K + 1 positions hold
    exactly the logits that predict the completion tokens. Returns input_ids (B, P + K),
    attention_mask (B, P + K) and completion_mask (B, K).
    """
    B, P = len(prompts), max(len(p) for p in prompts)
    K = max(1, max(len(c) for c in completions))
    input_ids = torch.full((B, P + K), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, P + K), dtype=torch.long)
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        input_ids[i, P - len(prompt):P] = torch.tensor(prompt, dtype=torch.long)
        input_ids[i, P:P + len(completion)] = torch.tensor(completion, dtype=torch.long)
        attention_mask[i, P - len(prompt):P + len(completion)] = 1
    return input_ids, attention_mask, attention_mask[:, P:].float()


def sequence_logprobs(model, input_ids, attention_mask, n_completion: int, temperature: float = 1.0,
                      entropy: bool = False):
    """Log-probs (B, K) of the last K = n_completion tokens of input_ids under `model` (and with `entropy`, the
    (B, K) entropies of the distributions they are drawn from), as token_logprobs computes them, by
    speed/logprobs.py's row-chunked kernel: it never holds their float32 (B, K, V) log-softmax.

    Calls the model's own forward (so FSDP2's hooks run) with `logits_to_keep`, so logits exist
    only for the K + 1 positions that predict completion tokens, never for the prompt.
    """
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # left padding: count real tokens
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                logits_to_keep=n_completion + 1, use_cache=False)  # (B, K + 1, V): position t predicts token t + 1
    # All K + 1 positions, the last with a dummy target, then its column dropped: the slice logits[:, :-1]
    # would make the kernel copy the (B, K, V) logits to flatten them, and its backward zero-fill them.
    targets = torch.nn.functional.pad(input_ids[:, -n_completion:], (0, 1))  # (B, K + 1)
    if entropy:
        logp, ent = chunked_token_logprobs(out.logits, targets, temperature, entropy=True)
        return logp[:, :-1], ent[:, :-1]  # (B, K) each
    return chunked_token_logprobs(out.logits, targets, temperature)[:, :-1]  # (B, K)
