"""The PPO-clip + reference-KL loss SoftmaxGRPO trains with (Section 4), and the log-prob plumbing.

    rho_t = pi_theta(z_t | x, z_<t) / pi_old(z_t | x, z_<t)                          (Section 4)
    L_pg  = agg_t[ max(-A * rho_t, -A * clip(rho_t, 1 - clip_low, 1 + clip_high)) ]
    L     = L_pg + beta * agg_t[ k3(pi_theta, pi_ref) ]

    --is-correction token-tis (not in the paper's runs) weights each token's term of L_pg by
    w_t = min(pi_old(z_t) / pi_sampler(z_t), C), detached: truncated importance sampling for the gap between the
    sampler's and the trainer's probabilities of the tokens the sampler drew.

with the asymmetric clip range [0.20, 0.28], no dual clip, the reference KL as a separate loss term
(k3 estimator), and token-mean aggregation, as in the paper's runs (Appendix B.1). A is one number
per sequence (the group advantage from advantage.py) broadcast over the sequence's tokens.
agg_t is one of AGGREGATIONS (token-mean; seq-mean-token-mean; Dr. GRPO's seq-mean-token-sum-norm);
a new one is a function (mask, norm_len) -> (token weights, denominator share) added to that dict.

Below the loss, the log-probs it takes: `sequence_logprobs` runs the model and `token_logprobs` never holds a
float32 full-vocabulary log-softmax (row chunks, a hand-written backward; a GPU needs the bound too).

    python -m pytest tests/test_loss.py
"""

import torch

LOG_RATIO_LIMIT = 20.0  # exp(20) ~ 5e8: keeps ratio and k3 finite when policies drift far apart


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref): exp(d) - d - 1 with d = ref_logp - logp; >= 0."""
    d = (ref_logp - logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return torch.exp(d) - d - 1


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


def _aggregation(agg: str):
    if agg not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {agg!r}; choose one of {', '.join(AGGREGATIONS)}")
    return AGGREGATIONS[agg]


def loss_denominator(mask: torch.Tensor, agg: str = "token-mean", norm_len: int | None = None) -> torch.Tensor:
    """This micro-batch's share of the loss denominator (0-d float tensor); sum it over the minibatch and ranks."""
    return _aggregation(agg)(mask.float(), norm_len)[1].float()


def aggregate(values: torch.Tensor, mask: torch.Tensor, agg: str = "token-mean",
              denominator: torch.Tensor | float | None = None, norm_len: int | None = None) -> torch.Tensor:
    """Reduce per-token values (B, T) over the masked tokens: sum(values * weights) / denominator.

    `denominator` is the whole minibatch's (the sum of `loss_denominator` over its micro-batches and ranks);
    None uses this batch's own, for a batch that is the whole minibatch.
    """
    weights, share = _aggregation(agg)(mask.to(values.dtype), norm_len)  # (B, T), ()
    denominator = torch.as_tensor(share if denominator is None else denominator, dtype=values.dtype,
                                  device=values.device)
    return (values * weights).sum() / denominator.where(denominator > 0, 1)  # every row masked: a loss of 0


def tis_weights(old_logp, sampler_logp, cap):
    """Truncated importance weights w_t = min(pi_old / pi_sampler, C) per token (B, T), detached: they correct
    which tokens were drawn, and no gradient should flow into the correction itself."""
    log_w = (old_logp - sampler_logp).detach().clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return torch.exp(log_w).clamp(max=cap)


def policy_loss(logp, old_logp, adv, mask, *, clip_low=0.2, clip_high=0.28, ref_logp=None,
                beta=1e-3, agg="token-mean", denominator=None, norm_len=None, sampler_logp=None, is_cap=None):
    """PPO clipped surrogate + beta * k3 reference KL (Section 4). Returns (loss, metrics).

    logp, old_logp, ref_logp, mask: (B, T); adv: (B,) per-sequence advantages. `agg`, `denominator` and
    `norm_len` go to `aggregate`. With `is_cap`, each token's policy-gradient term is weighted by
    tis_weights(old_logp, sampler_logp, is_cap) (--is-correction token-tis).
    """
    mask = mask.to(logp.dtype)
    adv = adv.to(logp.dtype)[:, None]  # (B, 1): broadcast over the sequence's tokens
    log_ratio = (logp - old_logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)  # rho_t (Section 4), (B, T)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)  # asymmetric [0.20, 0.28], no dual clip
    pg = torch.maximum(pg_unclipped, pg_clipped)  # (B, T)
    if is_cap is not None:
        is_weight = tis_weights(old_logp, sampler_logp, is_cap)  # w_t = min(pi_old / pi_sampler, C)
        pg = pg * is_weight
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
        if is_cap is not None:  # the uncapped pi_old / pi_sampler, and how often C caps it
            raw = torch.exp((old_logp - sampler_logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
            metrics["is_ratio_mean"] = ((raw * mask).sum() / n).item()
            metrics["is_clip_frac"] = (((raw > is_cap).to(mask.dtype) * mask).sum() / n).item()
    return loss, metrics


# ---------------------------------------------------------------- log-probs of the sampled tokens
CHUNK_ELEMENTS = 1 << 25  # float32 elements per row chunk (128 MB) on a GPU: bounds token_logprobs' extra memory
# On CPU 2 MB: a chunk then stays in a core's L2 cache through the passes each chunk makes (cast, logsumexp's,
# gather; in backward cast, subtract, exp, scale, cast back). A GPU keeps the big chunks: each costs kernel launches.
CPU_CHUNK_ELEMENTS = 1 << 19


def _chunks(n_rows: int, vocab: int, device: torch.device):
    step = max(1, (CPU_CHUNK_ELEMENTS if device.type == "cpu" else CHUNK_ELEMENTS) // vocab)
    return [(i, min(i + step, n_rows)) for i in range(0, n_rows, step)]


# ---- SPEED and MEMORY TRICK (skippable; the GPU path needs it too): equals log_softmax(logits / T)[target];
# tests/test_loss.py::test_token_logprobs_*
class _TokenLogprobs(torch.autograd.Function):
    """log softmax(logits / T)[target], chunked over rows; saves only the logsumexp for backward. With
    `entropy`, also each position's entropy H = lse - sum_v p_v z_v (z = logits / T) from the same chunks, without
    a gradient (policy/entropy is watched, not trained); otherwise an empty tensor."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, entropy):
        flat = logits.reshape(-1, logits.shape[-1])  # (N, V)
        flat_targets = targets.reshape(-1)  # (N,)
        lse = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)  # (N,)
        out = torch.empty_like(lse)
        ent = torch.empty_like(lse) if entropy else lse.new_empty(0)
        for a, b in _chunks(flat.shape[0], flat.shape[1], flat.device):
            chunk = flat[a:b].to(torch.float32, copy=True).div_(temperature)  # (n, V) float32, one chunk at a time
            lse[a:b] = torch.logsumexp(chunk, dim=-1)
            out[a:b] = chunk.gather(-1, flat_targets[a:b, None]).squeeze(-1) - lse[a:b]
            if entropy:  # H = lse - sum_v softmax(z)_v z_v; one more chunk-sized buffer. Elementwise ops, which
                # autocast leaves in float32: a bf16 dot product would round the large sum_v p_v z_v that H cancels
                ent[a:b] = lse[a:b] - (chunk - lse[a:b, None]).exp_().mul_(chunk).sum(-1)
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature = temperature
        ent = ent.view(targets.shape) if entropy else ent
        ctx.mark_non_differentiable(ent)
        return out.view(targets.shape), ent

    @staticmethod
    def backward(ctx, grad_out, grad_entropy):
        logits, targets, lse = ctx.saved_tensors
        T = ctx.temperature
        flat = logits.reshape(-1, logits.shape[-1])
        flat_targets = targets.reshape(-1)
        g = grad_out.reshape(-1).float()
        grad = torch.empty_like(flat)
        for a, b in _chunks(flat.shape[0], flat.shape[1], flat.device):
            # d logp[y] / d logits = (onehot(y) - softmax(logits / T)) / T
            probs = flat[a:b].to(torch.float32, copy=True).div_(T).sub_(lse[a:b, None]).exp_()  # (n, V)
            probs.mul_(-g[a:b, None] / T)
            probs.scatter_add_(-1, flat_targets[a:b, None], (g[a:b] / T)[:, None])
            grad[a:b] = probs.to(grad.dtype)
        return grad.view_as(logits), None, None, None


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, entropy: bool = False):
    """(B, T, V) logits, (B, T) targets -> (B, T) float32 log-probs under softmax(logits / temperature); with
    `entropy`, the pair (log-probs, (B, T) entropies of those distributions, no gradient)."""
    logp, ent = _TokenLogprobs.apply(logits, targets, float(temperature), entropy)
    return (logp, ent) if entropy else logp


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
    (B, K) entropies of the distributions they are drawn from: token_logprobs).

    Calls the model's own forward (so FSDP2's hooks run) with `logits_to_keep`, so logits exist
    only for the K + 1 positions that predict completion tokens, never for the prompt.
    """
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # left padding: count real tokens
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                logits_to_keep=n_completion + 1, use_cache=False)  # (B, K + 1, V): position t predicts token t + 1
    # All K + 1 positions, the last with a dummy target, then its column dropped: the slice logits[:, :-1]
    # would make token_logprobs copy the (B, K, V) logits to flatten them, and its backward zero-fill them.
    targets = torch.nn.functional.pad(input_ids[:, -n_completion:], (0, 1))  # (B, K + 1)
    if entropy:
        logp, ent = token_logprobs(out.logits, targets, temperature, entropy=True)
        return logp[:, :-1], ent[:, :-1]  # (B, K) each
    return token_logprobs(out.logits, targets, temperature)[:, :-1]  # (B, K)
