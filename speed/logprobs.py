"""Log-probs of the sampled tokens: the plain version, and the kernel training runs, in row chunks with a hand-written
backward and no float32 full-vocabulary log-softmax.

The plain version is `token_logprobs`: log_softmax(logits.float() / T) gathered at the targets, with the
entropy of the same distribution. It holds a float32 (B, K, V) log-softmax, and autograd keeps it for backward;
at a 150k vocabulary that is the largest tensor of a training step. `chunked_token_logprobs` computes the same
values (float32, within a few ulp: tests/test_loss.py::test_chunked_token_logprobs_equal_the_plain_version, values
and gradients at several chunk sizes) a chunk of rows at a time and saves only each row's logsumexp, so its extra
memory is one chunk. `sequence_logprobs`, which training calls (through loss.py), runs it; a GPU needs the bound too.
Under --entropy-coef the entropy gets a gradient as well (`entropy_grad`: the row's entropy is saved beside its
logsumexp, tests/test_loss.py::test_chunked_entropy_gradient_equals_autograd); without it the kernel runs as it
always did. `pad_batch` lays out the (prompt, completion) pairs `sequence_logprobs` reads.

    python -m pytest tests/test_loss.py -k "token_logprobs or entropy"
"""

import torch

CHUNK_ELEMENTS = 1 << 25  # float32 elements per row chunk (128 MB) on a GPU: bounds the kernel's extra memory
# On CPU 2 MB: a chunk then stays in a core's L2 cache through the passes each chunk makes (cast, logsumexp's,
# gather; in backward cast, subtract, exp, scale, cast back). A GPU keeps the big chunks: each costs kernel launches.
CPU_CHUNK_ELEMENTS = 1 << 19


# ---------------------------------------------------------------- the plain version
def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, entropy: bool = False,
                   entropy_grad: bool = False):
    """(B, T, V) logits, (B, T) targets -> (B, T) float32 log-probs under softmax(logits / temperature); with
    `entropy`, the pair (log-probs, (B, T) entropies of those distributions: with `entropy_grad` their gradient flows
    to the logits, else none)."""
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)  # (B, T, V) float32
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)  # (B, T)
    if not entropy:
        return logp
    ent = -(logp_all.exp() * logp_all).sum(-1)  # H = -sum_v p_v log p_v, (B, T)
    return logp, ent if entropy_grad else ent.detach()


def _chunks(n_rows: int, vocab: int, device: torch.device):
    step = max(1, (CPU_CHUNK_ELEMENTS if device.type == "cpu" else CHUNK_ELEMENTS) // vocab)
    return [(i, min(i + step, n_rows)) for i in range(0, n_rows, step)]


# ---- SPEED and MEMORY TRICK (skippable; the GPU path needs it too): equals log_softmax(logits / T)[target];
# tests/test_loss.py::test_chunked_token_logprobs_equal_the_plain_version, and for the entropy's gradient
# tests/test_loss.py::test_chunked_entropy_gradient_equals_autograd
class _TokenLogprobs(torch.autograd.Function):
    """log softmax(logits / T)[target], chunked over rows; saves only the logsumexp for backward. With
    `entropy`, also each position's entropy H = lse - sum_v p_v z_v (z = logits / T) from the same chunks: without a
    gradient (policy/entropy is watched), or with `entropy_grad` with one (--entropy-coef trains on it; H is then
    saved too); otherwise an empty tensor."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, entropy, entropy_grad):
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
        ctx.temperature, ctx.entropy_grad = temperature, entropy and entropy_grad
        if ctx.entropy_grad:
            ctx.save_for_backward(logits, targets, lse, ent)
            ctx.set_materialize_grads(False)  # a None says which of the two outputs the loss used
        else:
            ctx.save_for_backward(logits, targets, lse)
        ent = ent.view(targets.shape) if entropy else ent
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(ent)
        return out.view(targets.shape), ent

    @staticmethod
    def backward(ctx, grad_out, grad_entropy):
        if ctx.entropy_grad:
            return _backward_with_entropy(ctx, grad_out, grad_entropy), None, None, None, None
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
        return grad.view_as(logits), None, None, None, None


def _backward_with_entropy(ctx, grad_out, grad_entropy):
    """The logits' gradient from both outputs. With z = logits / T, p = softmax(z), H = -sum_v p_v log p_v:
    d logp[y] / dz = onehot(y) - p, and dH / dz_j = -sum_v (d p_v / d z_j)(log p_v + 1) = -p_j (log p_j + H);
    each times 1 / T for the logits. One more chunk-sized buffer than the plain backward."""
    logits, targets, lse, ent = ctx.saved_tensors
    T = ctx.temperature
    flat = logits.reshape(-1, logits.shape[-1])
    flat_targets = targets.reshape(-1)
    zeros = lse.new_zeros(lse.shape)
    g = zeros if grad_out is None else grad_out.reshape(-1).float()  # (N,)
    g_ent = zeros if grad_entropy is None else grad_entropy.reshape(-1).float()  # (N,)
    grad = torch.empty_like(flat)
    for a, b in _chunks(flat.shape[0], flat.shape[1], flat.device):
        log_p = flat[a:b].to(torch.float32, copy=True).div_(T).sub_(lse[a:b, None])  # (n, V) log p
        probs = log_p.exp()  # (n, V)
        # p * (-g - g_H (log p + H)) / T, then + g / T at the target
        probs.mul_(log_p.add_(ent[a:b, None]).mul_(-g_ent[a:b, None]).sub_(g[a:b, None])).div_(T)
        probs.scatter_add_(-1, flat_targets[a:b, None], (g[a:b] / T)[:, None])
        grad[a:b] = probs.to(grad.dtype)
    return grad.view_as(logits)


def chunked_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                           entropy: bool = False, entropy_grad: bool = False):
    """token_logprobs in row chunks: (B, T, V) logits, (B, T) targets -> (B, T) float32 log-probs under
    softmax(logits / temperature); with `entropy`, the pair (log-probs, (B, T) entropies: with `entropy_grad` their
    gradient flows to the logits, else none)."""
    logp, ent = _TokenLogprobs.apply(logits, targets, float(temperature), entropy, entropy_grad)
    return (logp, ent) if entropy else logp


# ---------------------------------------------------------------- the log-probs training takes
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
                      entropy: bool = False, entropy_grad: bool = False):
    """Log-probs (B, K) of the last K = n_completion tokens of input_ids under `model` (and with `entropy`, the
    (B, K) entropies of the distributions they are drawn from, with a gradient if `entropy_grad`), as token_logprobs
    computes them, by the row-chunked kernel above: it never holds their float32 (B, K, V) log-softmax.

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
        logp, ent = chunked_token_logprobs(out.logits, targets, temperature, entropy=True, entropy_grad=entropy_grad)
        return logp[:, :-1], ent[:, :-1]  # (B, K) each
    return chunked_token_logprobs(out.logits, targets, temperature)[:, :-1]  # (B, K)
