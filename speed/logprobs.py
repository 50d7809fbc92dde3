"""Token log-probs and entropy in row chunks; the plain version (tests/test_loss.py: token_logprobs) keeps a (B, K, V)
log-softmax.

    python -m pytest tests/test_loss.py -k "token_logprobs or entropy"
"""

import torch

CHUNK_ELEMENTS = 1 << 25  # 128 MB on a GPU
CPU_CHUNK_ELEMENTS = 1 << 19  # CPU: 2 MB, so a chunk stays in L2


def _chunks(flat):
    """Row slices of the (N, V) `flat`, each about a chunk's elements (the last may run past N: slicing stops at N)."""
    elements = CPU_CHUNK_ELEMENTS if flat.device.type == "cpu" else CHUNK_ELEMENTS
    step = max(1, elements // flat.shape[1])
    return [slice(i, i + step) for i in range(0, len(flat), step)]


# SPEED and MEMORY TRICK: tests/test_loss.py::test_chunked_token_logprobs_equal_the_plain_version and
# test_chunked_entropy_gradient_equals_autograd: autograd's log_softmax keeps a float32 (B, K, V) for backward; this
# keeps the logits and a (N,) logsumexp, and redoes each row chunk's softmax in backward
class _TokenLogprobs(torch.autograd.Function):
    """log softmax(z)[target], z = logits / T, and with `entropy` H = lse - sum_v p_v z_v; (N, V) logits, (N,) rest."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, entropy, entropy_grad):
        work = torch.promote_types(logits.dtype, torch.float32)  # float32 at least; float64 stays float64 (the tests)
        lse = logits.new_empty(len(logits), dtype=work)  # (N,)
        out = torch.empty_like(lse)
        ent = torch.empty_like(lse) if entropy else lse.new_empty(0)
        for rows in _chunks(logits):
            # float32 copy of one chunk at a time: the whole (N, V) in float32 is what this saves
            chunk = logits[rows].to(work, copy=True).div_(temperature)
            lse[rows] = torch.logsumexp(chunk, dim=-1)
            target = chunk.gather(-1, targets[rows, None]).squeeze(-1)  # z[y]
            out[rows] = target - lse[rows]
            if entropy:  # float32: a bf16 dot would round the large sum H cancels
                pz = (chunk - lse[rows, None]).exp_().mul_(chunk)  # p_v z_v
                ent[rows] = lse[rows] - pz.sum(-1)
        ctx.temperature = temperature
        ctx.entropy_grad = entropy and entropy_grad
        ctx.save_for_backward(logits, targets, lse, ent)  # ent: (N,), read only for the entropy's gradient
        ctx.set_materialize_grads(not ctx.entropy_grad)  # a None says which output the loss used
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(ent)
        return out, ent

    @staticmethod
    def backward(ctx, grad_out, grad_entropy):
        """With z = logits / T and p = softmax(z): d logp[y] / dz = onehot(y) - p, dH / dz_j = -p_j (log p_j + H)."""
        logits, targets, lse, ent = ctx.saved_tensors
        T = ctx.temperature
        g = torch.zeros_like(lse) if grad_out is None else grad_out.to(lse.dtype)  # (N,)
        if ctx.entropy_grad:
            g_ent = torch.zeros_like(lse) if grad_entropy is None else grad_entropy.to(lse.dtype)
        grad = torch.empty_like(logits)
        for rows in _chunks(logits):
            log_p = logits[rows].to(lse.dtype, copy=True).div_(T).sub_(lse[rows, None])
            if ctx.entropy_grad:
                probs = log_p.exp()
                weight = log_p.add_(ent[rows, None]).mul_(-g_ent[rows, None]).sub_(g[rows, None])  # log_p is spent
                probs.mul_(weight).div_(T)
            else:
                probs = log_p.exp_()  # in place: log_p is not needed again
                probs.mul_(-g[rows, None] / T)
            probs.scatter_add_(-1, targets[rows, None], (g[rows] / T)[:, None])
            grad[rows] = probs.to(grad.dtype)
        return grad, None, None, None, None


def chunked_token_logprobs(logits, targets, temperature=1.0, entropy=False, entropy_grad=False):
    """The plain version's log-probs (and entropies), computed by the row-chunked kernel."""
    flat = logits.flatten(0, -2)  # (N, V): the kernel's rows
    logp, ent = _TokenLogprobs.apply(flat, targets.reshape(-1), float(temperature), entropy, entropy_grad)
    logp = logp.view(targets.shape)
    if entropy:
        return logp, ent.view(targets.shape)
    return logp


def pad_batch(prompts: list[list[int]], completions: list[list[int]], pad_id: int):
    """[left-padded prompt | right-padded completion] rows: ids, attention mask (B, P + K), completion mask (B, K)."""
    B = len(prompts)
    P = max(map(len, prompts))
    K = max(1, *map(len, completions))  # K >= 1: a slot if all are empty
    input_ids = torch.full((B, P + K), pad_id)
    attention_mask = torch.zeros_like(input_ids)
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        span = slice(P - len(prompt), P + len(completion))
        input_ids[i, span] = torch.tensor([*prompt, *completion])
        attention_mask[i, span] = 1
    return input_ids, attention_mask, attention_mask[:, P:].float()


def sequence_logprobs(
    model, input_ids, attention_mask, n_completion: int, temperature=1.0, entropy=False, entropy_grad=False
):
    """Log-probs (B, K) of the last K tokens under `model` (and entropies), by the kernel."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    keep = n_completion + 1  # the last prompt position predicts the first completion token
    out = model(input_ids, attention_mask, position_ids=position_ids, logits_to_keep=keep, use_cache=False)
    # all K + 1 positions, the last target a dummy: logits[:, :-1] would copy the logits
    targets = torch.nn.functional.pad(input_ids[:, -n_completion:], (0, 1))
    logp = chunked_token_logprobs(out.logits, targets, temperature, entropy, entropy_grad)  # (B, K + 1)
    if entropy:  # and the entropies
        return tuple(t[:, :-1] for t in logp)
    return logp[:, :-1]


# SPEED TRICK: tests/test_train.py::test_packed_log_probs_entropies_and_gradients_equal_the_padded_ones: a packed
# row computes no pad position, the padded batch (B, P + K) computes every one
PACKED_ATTENTION = ("eager", "sdpa", "flash_attention_2", "flex_attention")  # each keeps packed sequences apart


def packing_error(model) -> str | None:
    """Why --pack cannot keep `model`'s packed sequences apart, as one line, or None: transformers turns restarting
    position ids into separate sequences only under PACKED_ATTENTION's kernels (the tests try eager and sdpa)."""
    attention = model.config._attn_implementation
    if attention in PACKED_ATTENTION:
        return None
    kept_apart = ", ".join(PACKED_ATTENTION)
    return f"--pack: {attention} attention would let packed sequences attend to each other ({kept_apart} do not)"


def pack_batch(prompts: list[list[int]], completions: list[list[int]]):
    """The sequences back to back in one row, no pad: ids and position ids (1, T), the positions restarting at 0 for
    each sequence, which transformers reads as packed (a block-diagonal causal mask, attention_mask=None); then the
    row positions whose logits predict each completion token, and those tokens (N,)."""
    ids, positions, predict = [], [], []
    for prompt, completion in zip(prompts, completions):
        start = len(ids) + len(prompt) - 1  # the last prompt token predicts the first completion token
        predict.extend(range(start, start + len(completion)))
        ids.extend([*prompt, *completion])
        positions.extend(range(len(prompt) + len(completion)))
    targets = [token for completion in completions for token in completion]
    return torch.tensor([ids]), torch.tensor([positions]), torch.tensor(predict), torch.tensor(targets)


def packed_logprobs(model, packed, mask, temperature=1.0, entropy=False, entropy_grad=False):
    """sequence_logprobs' (B, K) log-probs (and entropies) from pack_batch's row, scattered back to the padded layout
    of `mask` (B, K), so the loss reads the same tensors."""
    input_ids, position_ids, predict, targets = packed
    out = model(input_ids, attention_mask=None, position_ids=position_ids, logits_to_keep=predict, use_cache=False)
    logp, ent = _TokenLogprobs.apply(out.logits[0], targets, float(temperature), entropy, entropy_grad)  # (N,)
    kept = mask.bool()

    def padded(flat):  # (N,) -> (B, K), 0 at the pad positions; masked_scatter keeps the gradient
        return torch.zeros(mask.shape, dtype=flat.dtype, device=flat.device).masked_scatter(kept, flat)

    if entropy:
        return padded(logp), padded(ent)
    return padded(logp)
