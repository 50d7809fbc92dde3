"""Token log-probs and entropy in row chunks; the plain version (tests/test_loss.py: token_logprobs) keeps a (B, K, V)
log-softmax.

    python -m pytest tests/test_loss.py -k "token_logprobs or entropy"
"""

import torch

CHUNK_ELEMENTS = 1 << 25  # 128 MB on a GPU
CPU_CHUNK_ELEMENTS = 1 << 19  # CPU: 2 MB, so a chunk stays in L2


def _chunks(n_rows: int, vocab: int, device: torch.device):
    elements = CPU_CHUNK_ELEMENTS if device.type == "cpu" else CHUNK_ELEMENTS
    step = max(1, elements // vocab)
    return [slice(i, min(i + step, n_rows)) for i in range(0, n_rows, step)]


# SPEED and MEMORY TRICK: tests/test_loss.py::test_chunked_token_logprobs_equal_the_plain_version and
# test_chunked_entropy_gradient_equals_autograd: autograd's log_softmax keeps a float32 (B, K, V) for backward; this
# keeps the logits and a (N,) logsumexp, and redoes each row chunk's softmax in backward
class _TokenLogprobs(torch.autograd.Function):
    """log softmax(z)[target], z = logits / T, and with `entropy` H = lse - sum_v p_v z_v."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, entropy, entropy_grad):
        flat = logits.reshape(-1, logits.shape[-1])  # (N, V)
        flat_targets = targets.reshape(-1)  # (N,)
        lse = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
        out = torch.empty_like(lse)
        ent = torch.empty_like(lse) if entropy else lse.new_empty(0)
        for rows in _chunks(*flat.shape, flat.device):
            chunk = flat[rows].to(torch.float32, copy=True).div_(temperature)
            lse[rows] = torch.logsumexp(chunk, dim=-1)
            out[rows] = chunk.gather(-1, flat_targets[rows, None]).squeeze(-1) - lse[rows]
            if entropy:  # float32: a bf16 dot would round the large sum H cancels
                ent[rows] = lse[rows] - (chunk - lse[rows, None]).exp_().mul_(chunk).sum(-1)
        ctx.temperature = temperature
        ctx.entropy_grad = entropy and entropy_grad
        ctx.save_for_backward(logits, targets, lse, ent if ctx.entropy_grad else None)
        ctx.set_materialize_grads(not ctx.entropy_grad)  # a None says which output the loss used
        ent = ent.view(targets.shape) if entropy else ent
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(ent)
        return out.view(targets.shape), ent

    @staticmethod
    def backward(ctx, grad_out, grad_entropy):
        """With z = logits / T and p = softmax(z): d logp[y] / dz = onehot(y) - p, dH / dz_j = -p_j (log p_j + H)."""
        logits, targets, lse, ent = ctx.saved_tensors
        T = ctx.temperature
        flat = logits.reshape(-1, logits.shape[-1])  # (N, V)
        flat_targets = targets.reshape(-1)  # (N,)
        g = lse.new_zeros(lse.shape) if grad_out is None else grad_out.reshape(-1).float()  # (N,)
        if ctx.entropy_grad:
            g_ent = lse.new_zeros(lse.shape) if grad_entropy is None else grad_entropy.reshape(-1).float()
        grad = torch.empty_like(flat)
        for rows in _chunks(*flat.shape, flat.device):
            log_p = flat[rows].to(torch.float32, copy=True).div_(T).sub_(lse[rows, None])
            if ctx.entropy_grad:
                probs = log_p.exp()
                probs.mul_(log_p.add_(ent[rows, None]).mul_(-g_ent[rows, None]).sub_(g[rows, None])).div_(T)
            else:
                probs = log_p.exp_()
                probs.mul_(-g[rows, None] / T)
            probs.scatter_add_(-1, flat_targets[rows, None], (g[rows] / T)[:, None])
            grad[rows] = probs.to(grad.dtype)
        return grad.view_as(logits), None, None, None, None


def chunked_token_logprobs(logits, targets, temperature=1.0, entropy=False, entropy_grad=False):
    """The plain version's log-probs (and entropies), computed by the row-chunked kernel."""
    logp, ent = _TokenLogprobs.apply(logits, targets, float(temperature), entropy, entropy_grad)
    return (logp, ent) if entropy else logp


def pad_batch(prompts: list[list[int]], completions: list[list[int]], pad_id: int):
    """[left-padded prompt | right-padded completion] rows: ids, attention mask (B, P + K), completion mask (B, K)."""
    B = len(prompts)
    P = max(map(len, prompts))
    K = max(1, *map(len, completions))  # K >= 1: a slot if all are empty
    input_ids = torch.full((B, P + K), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, P + K), dtype=torch.long)
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        span = slice(P - len(prompt), P + len(completion))
        input_ids[i, span] = torch.tensor([*prompt, *completion], dtype=torch.long)
        attention_mask[i, span] = 1
    return input_ids, attention_mask, attention_mask[:, P:].float()


def sequence_logprobs(
    model, input_ids, attention_mask, n_completion: int, temperature=1.0, entropy=False, entropy_grad=False
):
    """Log-probs (B, K) of the last K tokens under `model` (and entropies), by the kernel."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logits_to_keep=n_completion + 1,
        use_cache=False,
    )  # (B, K + 1, V)
    targets = torch.nn.functional.pad(input_ids[:, -n_completion:], (0, 1))  # all K + 1: logits[:, :-1] would copy
    logp, ent = _TokenLogprobs.apply(out.logits, targets, float(temperature), entropy, entropy_grad)
    return (logp[:, :-1], ent[:, :-1]) if entropy else logp[:, :-1]
