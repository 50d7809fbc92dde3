"""loss.py: log-probs against the naive formula, PPO-clip gradients, k3 KL, masking, batch layout."""

import math
import re

import pytest
import torch

import loss
from loss import (
    AGGREGATIONS,
    IS_CORRECTIONS,
    KL_ESTIMATORS,
    LOSS_TERMS,
    RATIOS,
    Share,
    TokenMean,
    aggregate,
    kl_k3,
    loss_denominator,
    policy_loss,
)
from speed.logprobs import chunked_token_logprobs, pad_batch, sequence_logprobs
from tests.test_nothing_silent import train_refuses

CHUNK = "speed.logprobs.CPU_CHUNK_ELEMENTS"  # the kernel's row-chunk size on CPU, in float32 elements


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    entropy: bool = False,
    entropy_grad: bool = False,
):
    """speed/logprobs.py's plain version: (B, T) float32 log-probs under softmax(logits / temperature); with `entropy`,
    also the entropies, from a whole (B, T, V) log-softmax."""
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)  # (B, T, V)
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)  # (B, T)
    if not entropy:
        return logp
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp, ent if entropy_grad else ent.detach()


def naive_logprobs(logits, targets, temperature=1.0):
    return torch.log_softmax(logits.float() / temperature, -1).gather(-1, targets[..., None]).squeeze(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("rows", [1, 4, 7, 21, 1000])  # 21 rows: one chunk; 1000: the whole batch at once
def test_chunked_token_logprobs_equal_the_plain_version(rows, temperature, monkeypatch):
    """speed/logprobs.py's kernel computes token_logprobs: the same float32 log-probs, entropies and gradient
    with respect to the logits, at every chunk size (rows per chunk), temperature 1 and not."""
    monkeypatch.setattr(CHUNK, 50 * rows)
    torch.manual_seed(0)
    logits = (torch.randn(3, 7, 50) * 3).requires_grad_()
    targets, weights = torch.randint(0, 50, (3, 7)), torch.randn(3, 7)
    before = logits.detach().clone()
    fast, fast_entropy = chunked_token_logprobs(logits, targets, temperature, entropy=True)
    plain, plain_entropy = token_logprobs(logits, targets, temperature, entropy=True)
    assert fast.shape == plain.shape == (3, 7) and fast.dtype == plain.dtype == torch.float32
    assert torch.allclose(fast, plain, atol=1e-5) and torch.allclose(fast_entropy, plain_entropy, atol=1e-5)
    assert not fast_entropy.requires_grad and not plain_entropy.requires_grad
    (fast_grad,) = torch.autograd.grad((fast * weights).sum(), logits)
    (plain_grad,) = torch.autograd.grad((plain * weights).sum(), logits)
    assert torch.allclose(fast_grad, plain_grad, atol=1e-6) and plain_grad.abs().max() > 0.1
    assert torch.equal(logits.detach(), before)  # input untouched (chunks are copies)
    assert torch.equal(chunked_token_logprobs(logits, targets, temperature), fast)  # entropy changes no log-prob


def test_plain_token_logprobs_by_hand():
    """softmax([0, ln 3] / T) at T = 1 is [1/4, 3/4]; at T = 0.5, [1/10, 9/10]. Entropy -sum_v p_v log p_v."""
    logits = torch.tensor([[[0.0, torch.log(torch.tensor(3.0))]] * 2])  # (1, 2, 2)
    targets = torch.tensor([[1, 0]])
    for temperature, p in ((1.0, 0.75), (0.5, 0.9)):
        logp, entropy = token_logprobs(logits, targets, temperature, entropy=True)
        want = torch.log(torch.tensor([[p, 1 - p]]))
        assert logp.dtype == torch.float32 and torch.allclose(logp, want)
        h = -(p * torch.log(torch.tensor(p)) + (1 - p) * torch.log(torch.tensor(1 - p)))
        assert torch.allclose(entropy, h.expand(1, 2))


def test_token_logprobs_is_bit_identical_for_every_chunk_size(monkeypatch):
    """Rows are independent, so the chunk size (CPU_CHUNK_ELEMENTS: cache-sized on CPU) changes no bit of the
    log-probs or of their gradient, bf16 logits as in training, temperature 1 and not."""
    torch.manual_seed(2)
    logits = (torch.randn(3, 7, 50) * 3).bfloat16().requires_grad_()
    targets, weights = torch.randint(0, 50, (3, 7)), torch.randn(3, 7)
    results = []
    for rows in (1, 4, 21, 1000):  # 21 rows: one chunk; 1000: the whole batch at once
        monkeypatch.setattr(CHUNK, 50 * rows)
        for temperature in (1.0, 0.7):
            logp = chunked_token_logprobs(logits, targets, temperature)
            (logp * weights).sum().backward()
            results.append((rows, temperature, logp.detach(), logits.grad))
            logits.grad = None
    for rows, temperature, logp, grad in results:
        _, _, want_logp, want_grad = next(r for r in results if r[0] == 1000 and r[1] == temperature)
        assert torch.equal(logp, want_logp) and torch.equal(grad, want_grad), (rows, temperature)


def test_token_logprobs_gradient_matches_autograd(monkeypatch):
    monkeypatch.setattr(CHUNK, 40)
    torch.manual_seed(1)
    logits = (torch.randn(2, 5, 40, dtype=torch.float64) * 2).requires_grad_()
    targets = torch.randint(0, 40, (2, 5))
    weights = torch.randn(2, 5, dtype=torch.float64)
    (chunked_token_logprobs(logits, targets, 0.8) * weights).sum().backward()
    ours = logits.grad.clone()
    logits.grad = None
    (naive_logprobs(logits.double(), targets, 0.8) * weights).sum().backward()
    assert torch.allclose(ours, logits.grad, atol=1e-5)


@pytest.mark.parametrize("logprobs", [token_logprobs, chunked_token_logprobs])
def test_token_logprobs_bfloat16_logits(logprobs):
    torch.manual_seed(2)
    logits = (torch.randn(2, 6, 64) * 4).bfloat16().requires_grad_()
    targets = torch.randint(0, 64, (2, 6))
    got = logprobs(logits, targets)
    assert got.dtype == torch.float32
    assert torch.allclose(got, naive_logprobs(logits.detach(), targets), atol=1e-4)
    got.sum().backward()
    assert logits.grad.dtype == torch.bfloat16 and torch.isfinite(logits.grad.float()).all()


def test_kl_k3_nonnegative_zero_when_equal_and_finite():
    torch.manual_seed(3)
    logp, ref = torch.randn(4, 9), torch.randn(4, 9)
    assert (kl_k3(logp, ref) >= 0).all()
    assert torch.equal(kl_k3(logp, logp), torch.zeros(4, 9))
    assert torch.isfinite(kl_k3(torch.tensor([-1e4]), torch.tensor([0.0]))).all()


def test_policy_loss_on_policy_gradient_is_token_mean_pg():
    torch.manual_seed(4)
    B, T = 3, 5
    logp = torch.randn(B, T, requires_grad=True)
    adv = torch.tensor([1.5, -0.5, 0.25])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float32)
    loss, metrics = policy_loss(logp, logp.detach(), adv, mask, beta=0.0)
    loss.backward()
    N = mask.sum()
    expected = -(adv[:, None] * mask) / N  # d/dlogp of -(1/N) sum_i A_i sum_t logp_it
    assert torch.allclose(logp.grad, expected, atol=1e-6)
    assert metrics["ratio_mean"] == pytest.approx(1.0)
    assert metrics["clip_frac_low"] == 0 and metrics["clip_frac_high"] == 0


def test_policy_loss_clipping_zeroes_gradient_on_the_pushed_side():
    old = torch.zeros(1, 4)
    # token ratios: 1.5 (above 1.28), 0.5 (below 0.8), 1.1 and 0.9 (inside)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 0.9]])).requires_grad_()
    mask = torch.ones(1, 4)
    loss, m = policy_loss(logp, old, torch.tensor([1.0]), mask, beta=0.0)
    loss.backward()
    g = logp.grad[0]
    assert g[0] == 0  # A > 0 and ratio above 1 + clip_high: clipped
    assert g[1] != 0 and g[2] != 0 and g[3] != 0  # A > 0 still pushes a low ratio up (no dual clip)
    assert m["clip_frac_high"] == pytest.approx(0.25) and m["clip_frac_low"] == 0

    logp.grad = None
    loss, m = policy_loss(logp, old, torch.tensor([-1.0]), mask, beta=0.0)
    loss.backward()
    g = logp.grad[0]
    assert g[1] == 0  # A < 0 and ratio below 1 - clip_low: clipped
    assert g[0] != 0 and g[2] != 0 and g[3] != 0
    assert m["clip_frac_low"] == pytest.approx(0.25) and m["clip_frac_high"] == 0


def test_policy_loss_asymmetric_range():
    old = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[1.25, 1.30]])).requires_grad_()  # inside 1.28 vs outside
    loss, _ = policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 2), beta=0.0)
    loss.backward()
    assert logp.grad[0, 0] != 0 and logp.grad[0, 1] == 0


def test_masked_tokens_never_contribute():
    torch.manual_seed(5)
    logp = torch.randn(2, 6, requires_grad=True)
    old, ref = torch.randn(2, 6), torch.randn(2, 6)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]], dtype=torch.float32)
    for agg in ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]:
        loss, _ = policy_loss(
            logp, old, torch.tensor([1.0, -2.0]), mask, ref_logp=ref, beta=0.1, loss_agg=agg, norm_len=6
        )
        logp.grad = None
        loss.backward()
        assert (logp.grad[mask == 0] == 0).all()
        garbage = logp.detach().clone()
        garbage[mask == 0] = 1e3  # padded positions hold junk
        loss2, _ = policy_loss(
            garbage, old, torch.tensor([1.0, -2.0]), mask, ref_logp=ref, beta=0.1, loss_agg=agg, norm_len=6
        )
        assert torch.allclose(loss.detach(), loss2)


def test_aggregation_denominators():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert aggregate(values, mask, "token-mean") == pytest.approx(10 / 4)
    assert aggregate(values, mask, "token-mean", denominator=8) == pytest.approx(10 / 8)
    assert aggregate(values, mask, "seq-mean-token-mean") == pytest.approx((2 + 4) / 2)
    assert aggregate(values, mask, "seq-mean-token-sum-norm", norm_len=5) == pytest.approx(10 / (2 * 5))
    with pytest.raises(KeyError, match="sum"):  # a plain lookup: --loss-agg's name is checked once, at start
        aggregate(values, mask, "sum")
    with pytest.raises(TypeError):  # norm_len None, never 0: the padded length would vary by micro-batch
        aggregate(values, mask, "seq-mean-token-sum-norm")
    assert loss_denominator(mask, "token-mean") == 4
    assert loss_denominator(mask, "seq-mean-token-mean") == 2
    assert loss_denominator(mask, "seq-mean-token-sum-norm", norm_len=5) == 10


def _padded(rows, lengths):
    """Micro-batch of `rows`, padded to its own longest completion, as train.py's pad_batch does."""
    T = max(lengths[i] for i in rows)
    mask = torch.tensor([[1.0] * lengths[i] + [0.0] * (T - lengths[i]) for i in rows])  # (b, T)
    return mask, T


@pytest.mark.parametrize("agg", list(AGGREGATIONS))
def test_every_aggregation_is_invariant_to_micro_batches_and_ranks(agg):
    assert_invariant_to_micro_batches_and_ranks(agg)


def assert_invariant_to_micro_batches_and_ranks(agg):
    """Splitting the minibatch into micro-batches on 2 ranks gives the full-batch loss and gradient.

    train.py's pattern: the denominator is summed over all micro-batches and ranks first; each rank
    backpropagates sum(micro losses) * world; the ranks' gradients are averaged (FSDP).
    """
    torch.manual_seed(7)
    B, K = 7, 9
    lengths = [3, 9, 1, 5, 7, 2, 6]
    theta = torch.randn(B, K, dtype=torch.float64, requires_grad=True)  # stands in for the policy parameters
    old, ref = torch.randn(B, K, dtype=torch.float64), torch.randn(B, K, dtype=torch.float64)
    adv = torch.randn(B, dtype=torch.float64)
    kw = dict(ref_logp=None, beta=0.1, loss_agg=agg, norm_len=K)

    def loss_of(rows, denominator):
        mask, T = _padded(rows, lengths)
        logp = torch.tanh(theta[rows, :T]) - 1  # (b, T), a nonlinear function of the parameters
        return policy_loss(
            logp, old[rows, :T], adv[rows], mask.double(), **dict(kw, ref_logp=ref[rows, :T]), denominator=denominator
        )[0]

    full = loss_of(list(range(B)), None)
    (full_grad,) = torch.autograd.grad(full, theta)

    ranks = [[[0, 1], [2], [3]], [[4, 5, 6]]]  # rank 0: three micro-batches, rank 1: one
    world = len(ranks)
    denominator = sum(loss_denominator(_padded(rows, lengths)[0], agg, norm_len=K) for rank in ranks for rows in rank)
    total_loss, grads = 0.0, []
    for rank in ranks:
        rank_loss = sum(loss_of(rows, denominator) for rows in rank)
        grads.append(torch.autograd.grad(rank_loss * world, theta)[0])
        total_loss += rank_loss.item()
    assert total_loss == pytest.approx(full.item(), abs=1e-6)
    assert torch.allclose(sum(grads) / world, full_grad, atol=1e-6, rtol=0)  # FSDP's average over ranks
    # teeth: each micro-batch's own denominator (the naive split) would not match
    naive = sum(loss_of(rows, None) for rank in ranks for rows in rank)
    assert abs(naive.item() - full.item()) > 1e-3


def test_kl_term_added_with_beta():
    torch.manual_seed(6)
    logp, ref = torch.randn(2, 3), torch.randn(2, 3)
    mask = torch.ones(2, 3)
    without, m0 = policy_loss(logp, logp, torch.zeros(2), mask, ref_logp=None)
    with_kl, m1 = policy_loss(logp, logp, torch.zeros(2), mask, ref_logp=ref, beta=0.5)
    assert m0["kl"] == 0 and m1["kl"] == pytest.approx(kl_k3(logp, ref).mean().item(), rel=1e-5)
    assert (with_kl - without).item() == pytest.approx(0.5 * m1["kl"], rel=1e-5)


def test_pad_batch_layout():
    ids, attn, cmask = pad_batch([[5, 6, 7], [8]], [[1, 2], [3, 4, 9]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7, 1, 2, 0], [0, 0, 8, 3, 4, 9]]
    assert attn.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert cmask.tolist() == [[1, 1, 0], [1, 1, 1]]


def test_sequence_logprobs_matches_unpadded_forward(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompts, completions = [[10, 11, 12, 13], [20, 21]], [[30, 31, 32], [40]]
    ids, attn, cmask = pad_batch(prompts, completions, pad_id=0)
    with torch.no_grad():
        got = sequence_logprobs(model, ids, attn, n_completion=cmask.shape[1], temperature=0.9)
        for i, (p, c) in enumerate(zip(prompts, completions)):
            full = torch.tensor([p + c])
            logits = model(full).logits[0, len(p) - 1 : -1]  # positions predicting the completion
            ref = torch.log_softmax(logits / 0.9, -1).gather(-1, torch.tensor(c)[:, None]).squeeze(-1)
            assert torch.allclose(got[i, : len(c)], ref, atol=1e-5)


def test_sequence_logprobs_skips_the_slice_copy_bit_for_bit(tiny_model_dir):
    """sequence_logprobs scores all K + 1 kept positions (the last against a dummy target) and drops the last
    column, instead of slicing the logits first: the same log-probs and gradients, bit for bit, under bf16."""
    from plumbing.models import load_model
    from speed.backward import configure_backward

    model = configure_backward(load_model(tiny_model_dir), bf16=True, checkpointing=False)
    prompts, completions = [[10, 11, 12, 13], [20, 21]], [[30, 31, 32], [40]]
    ids, attn, cmask = pad_batch(prompts, completions, pad_id=0)
    K = cmask.shape[1]
    results = []
    for sliced in (True, False):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if sliced:  # the plain way: logits of the K positions that predict the completion
                position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
                logits = model(
                    input_ids=ids, attention_mask=attn, position_ids=position_ids, logits_to_keep=K + 1, use_cache=False
                ).logits[:, :-1]
                logp = chunked_token_logprobs(logits, ids[:, -K:], 0.9)
            else:
                logp = sequence_logprobs(model, ids, attn, K, temperature=0.9)
        (logp * cmask).sum().backward()
        results.append((logp.detach(), [p.grad.clone() for p in model.parameters()]))
    (logp_a, grads_a), (logp_b, grads_b) = results
    assert logp_b.shape == (2, K) and torch.equal(logp_a, logp_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))


def test_eager_attention_matches_sdpa(tiny_model_dir):
    """plumbing/models.py: load_model picks eager attention on CPU (faster there); loss and gradients equal SDPA's."""
    from transformers import AutoModelForCausalLM

    from plumbing.models import load_model

    eager = load_model(tiny_model_dir)
    sdpa = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    assert eager.config._attn_implementation == "eager" and sdpa.config._attn_implementation == "sdpa"
    prompts, completions = [[10, 11, 12, 13, 14], [20, 21], [5, 6, 7]], [[30, 31, 32], [40], [41, 42, 43, 44, 45]]
    ids, attn, cmask = pad_batch(prompts, completions, pad_id=0)  # left-padded prompts: masks matter
    adv = torch.tensor([1.0, -0.5, 0.3])
    grads = []
    for model in (eager, sdpa):
        logp = sequence_logprobs(model, ids, attn, cmask.shape[1], temperature=0.9)
        loss, _ = policy_loss(logp, logp.detach() + 0.05, adv, cmask)  # off-policy: a ratio != 1
        loss.backward()
        grads.append((logp.detach(), loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (lp_e, loss_e, g_e), (lp_s, loss_s, g_s) = grads
    assert torch.allclose(lp_e, lp_s, atol=1e-5) and torch.allclose(loss_e, loss_s, rtol=1e-5)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(g_e, g_s))


# ---- policy/entropy, --is-correction token-tis, --mask-truncated


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_entropy_from_the_log_prob_pass_equals_categorical(temperature, monkeypatch):
    """policy/entropy comes out of the kernel's chunks (several here), equal to torch's Categorical entropy of
    softmax(logits / T), with no gradient; the log-probs and their gradient are those of the plain call."""
    monkeypatch.setattr(CHUNK, 50 * 4)
    torch.manual_seed(3)
    logits = (torch.randn(3, 7, 50) * 3).requires_grad_()
    targets = torch.randint(0, 50, (3, 7))
    logp, entropy = chunked_token_logprobs(logits, targets, temperature, entropy=True)
    expected = torch.distributions.Categorical(logits=logits.detach() / temperature).entropy()
    assert entropy.shape == (3, 7) and not entropy.requires_grad
    assert torch.allclose(entropy, expected, atol=1e-5) and entropy.std() > 0.05  # not a constant
    assert torch.equal(logp, chunked_token_logprobs(logits, targets, temperature))
    (grad,) = torch.autograd.grad(logp.sum(), logits)
    (plain,) = torch.autograd.grad(chunked_token_logprobs(logits, targets, temperature).sum(), logits)
    assert torch.equal(grad, plain)


@pytest.mark.parametrize("logprobs", [token_logprobs, chunked_token_logprobs])
def test_entropy_under_bf16_autocast_stays_float32_accurate(logprobs):
    """The training forward runs under autocast: the entropy of bf16 logits must still be the float32 entropy of
    those logits (a bf16 dot product inside it would be off by ~0.05 nats at a vocabulary of 300)."""
    torch.manual_seed(6)
    logits = (torch.randn(2, 9, 300) * 3).bfloat16()
    targets = torch.randint(0, 300, (2, 9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, entropy = logprobs(logits, targets, 0.7, entropy=True)
    expected = torch.distributions.Categorical(logits=logits.float() / 0.7).entropy()
    assert entropy.dtype == torch.float32 and torch.allclose(entropy, expected, atol=1e-4)


def pg_case():
    torch.manual_seed(4)
    logp = (torch.randn(2, 3) * 0.1 - 1).requires_grad_()
    old = logp.detach() + torch.randn(2, 3) * 0.05
    return logp, old, torch.tensor([1.0, -0.5]), torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_token_tis_with_identical_log_probs_is_todays_loss():
    """pi_old = pi_sampler: every weight is 1 (C >= 1), so the loss and its gradient are those without the
    correction."""
    logp, old, adv, mask = pg_case()
    plain, _ = policy_loss(logp, old, adv, mask, beta=0.0)
    corrected, m = policy_loss(
        logp, old, adv, mask, beta=0.0, is_correction="token-tis", sampler_logp=old.clone(), is_cap=2.0
    )
    assert corrected.item() == plain.item() and m["is_ratio_mean"] == 1.0 and m["is_clip_frac"] == 0.0
    assert torch.equal(torch.autograd.grad(corrected, logp)[0], torch.autograd.grad(plain, logp)[0])


def test_token_tis_weights_by_hand_and_carry_no_gradient():
    """w_t = min(pi_old / pi_sampler, C), computed by hand: ratios 2, 0.5, 4 with C = 3 give weights 2, 0.5, 3.
    The weight multiplies each token's policy-gradient term; it is detached, so the gradient with respect to
    logp is w_t times the uncorrected one, and no gradient reaches pi_old or pi_sampler through it."""
    logp = torch.log(torch.tensor([[0.5, 0.4, 0.2]])).requires_grad_()
    old = logp.detach().clone().requires_grad_()  # on-policy: rho = 1, no clip active
    sampler = old.detach() - torch.log(torch.tensor([[2.0, 0.5, 4.0]]))
    mask, adv = torch.ones(1, 3), torch.tensor([1.0])
    weights, capped = IS_CORRECTIONS["token-tis"](old, sampler, mask, 3.0)
    assert torch.allclose(weights, torch.tensor([[2.0, 0.5, 3.0]])) and not weights.requires_grad
    assert capped.tolist() == [[False, False, True]]
    loss, m = policy_loss(logp, old, adv, mask, beta=0.0, is_correction="token-tis", sampler_logp=sampler, is_cap=3.0)
    assert loss.item() == pytest.approx(-(2.0 + 0.5 + 3.0) / 3)  # -A * rho * w, token mean
    assert m["is_ratio_mean"] == pytest.approx((2 + 0.5 + 4) / 3) and m["is_clip_frac"] == pytest.approx(1 / 3)
    plain, _ = policy_loss(logp, old, adv, mask, beta=0.0)
    g_logp, g_old = torch.autograd.grad(loss, (logp, old))
    g_plain, g_old_plain = torch.autograd.grad(plain, (logp, old))
    assert torch.allclose(g_logp, g_plain * weights)
    assert torch.allclose(g_old, g_old_plain * weights)  # only through rho = pi / pi_old, scaled: none through w


def test_is_correction_is_chosen_by_name_from_its_registry(capsys, tmp_path):
    """--is-correction's choices are IS_CORRECTIONS' names: "none" ignores the sampler's log-probs (no weight, no
    is_* metrics) and is the default, whatever is_cap says; "token-tis" weights."""
    assert {"none", "token-tis"} <= set(IS_CORRECTIONS)
    logp, old, adv, mask = pg_case()
    sampler = old - torch.tensor([[0.7, -0.3, 1.2], [0.1, 0.9, 0.0]])  # pi_old / pi_sampler far from 1
    plain, m_plain = policy_loss(logp, old, adv, mask, beta=0.0)
    none, m_none = policy_loss(logp, old, adv, mask, beta=0.0, is_correction="none", sampler_logp=sampler, is_cap=2.0)
    assert none.item() == plain.item() and m_none == m_plain and "is_ratio_mean" not in m_none
    named, m_named = policy_loss(
        logp, old, adv, mask, beta=0.0, is_correction="token-tis", sampler_logp=sampler, is_cap=2.0
    )
    by_cap, m_cap = policy_loss(logp, old, adv, mask, beta=0.0, sampler_logp=sampler, is_cap=2.0)
    assert named.item() != pytest.approx(plain.item(), rel=1e-3) and "is_clip_frac" in m_named
    assert by_cap.item() == plain.item() and m_cap == m_plain  # a cap alone turns nothing on
    with pytest.raises(KeyError, match="tis"):  # a plain lookup: the command line refuses the name at start
        policy_loss(logp, old, adv, mask, is_correction="tis", sampler_logp=sampler, is_cap=2.0)
    message = f"--is-correction must be one of {', '.join(IS_CORRECTIONS)}"
    assert message in train_refuses(["--is-correction", "tis"], capsys, tmp_path)


# ---- the importance ratio: RATIOS (the paper's token ratio, GSPO's sequence ratio)


def test_the_token_ratio_is_todays_arithmetic_bit_for_bit(capsys, tmp_path):
    """ratio="token" (the default) computes exp(clamp(logp - old_logp)) as before RATIOS existed: the same loss,
    metrics and gradient, bit for bit, with a log-ratio beyond LOG_RATIO_LIMIT that the clamp must catch."""
    assert "token" in RATIOS
    logp, old, adv, mask = pg_case()
    old = old.clone()
    old[0, 1] = 30.0  # log-ratio -31: clamped to -20
    ratio = torch.exp((logp - old).clamp(-loss.LOG_RATIO_LIMIT, loss.LOG_RATIO_LIMIT))
    pg = torch.maximum(-adv[:, None] * ratio, -adv[:, None] * ratio.clamp(0.8, 1.28))
    want = (pg * mask).sum() / mask.sum()
    got, m = policy_loss(logp, old, adv, mask, beta=0.0, ratio="token")
    assert torch.equal(got, want) and m["ratio_mean"] == ((ratio * mask).sum() / mask.sum()).item()
    assert torch.equal(torch.autograd.grad(got, logp)[0], torch.autograd.grad(want, logp)[0])
    with pytest.raises(KeyError, match="tokens"):
        policy_loss(logp, old, adv, mask, ratio="tokens")
    assert f"--ratio must be one of {', '.join(RATIOS)}" in train_refuses(["--ratio", "tokens"], capsys, tmp_path)


def test_the_sequence_ratio_clips_whole_sequences():
    """--ratio sequence, GSPO's (built in): every token of a sequence gets the sequence's ratio, so the clip and its
    clip fraction count whole sequences. By hand: row 0's token log-ratios 0.6, 0.3, 0 average 0.3,
    rho = e^0.3 = 1.35 > 1.28 with A = 1: its three tokens are clipped (token by token only the first two would be);
    row 1's 0.2, -0.2 (and a masked junk token) average 0, rho = 1. So clip_frac_high = 3/5 (token ratio: 2/5), the
    loss is (3 x -1.28 + 2 x 1) / 5, row 0 gets no gradient, and each of row 1's two tokens gets -A rho / 5 = 0.2."""
    assert "sequence" in RATIOS
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.6, 0.3, 0.0], [0.2, -0.2, 5.0]], requires_grad=True)
    adv, mask = torch.tensor([1.0, -1.0]), torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    value, m = policy_loss(logp, old, adv, mask, beta=0.0, ratio="sequence")
    rho = torch.tensor(0.3).exp().item()
    assert m["ratio_mean"] == pytest.approx((3 * rho + 2 * 1.0) / 5)  # each token carries its sequence's ratio
    assert m["clip_frac_high"] == pytest.approx(3 / 5) and m["clip_frac_low"] == 0
    assert value.item() == pytest.approx((3 * -1.28 + 2 * 1.0) / 5)
    (grad,) = torch.autograd.grad(value, logp)
    assert torch.allclose(grad, torch.tensor([[0.0, 0.0, 0.0], [0.2, 0.2, 0.0]]))
    _, m_token = policy_loss(logp, old, adv, mask, beta=0.0)  # the default, token by token
    assert m_token["clip_frac_high"] == pytest.approx(2 / 5)


def test_the_sequence_ratio_has_gspo_tokens_gradient():
    """GSPO-token (Zheng et al. 2025): s_i,t = sg[s_i] pi(z_t) / sg[pi(z_t)], so token t's term -A s_i w_t moves only
    its own log-prob: d loss / d logp_t = -A s_i w_t / N. With per-token weights w_t (token-tis, pi_old / pi_sampler =
    2, 1, 0.5, uncapped) that differs from the gradient of the plain mean log-ratio, which spreads each token's term
    evenly over the sequence: -A s_i mean(w) / N on every token. By hand, one sequence of 3 tokens, A = 1, the
    log-ratios 0.03, 0, -0.03 (mean 0, s = 1, no clip): the gradient is -(2, 1, 0.5) / 3, the mean form's -7/6 / 3."""
    logp = torch.tensor([[0.03, 0.0, -0.03]], requires_grad=True)
    old, mask, adv = torch.zeros(1, 3), torch.ones(1, 3), torch.tensor([1.0])
    sampler = old - torch.log(torch.tensor([[2.0, 1.0, 0.5]]))
    value, _ = policy_loss(
        logp, old, adv, mask, beta=0.0, ratio="sequence", is_correction="token-tis", sampler_logp=sampler, is_cap=10.0
    )
    assert value.item() == pytest.approx(-(2 + 1 + 0.5) / 3)
    (grad,) = torch.autograd.grad(value, logp)
    assert torch.allclose(grad, -torch.tensor([[2.0, 1.0, 0.5]]) / 3)
    assert not torch.allclose(grad, torch.full((1, 3), -3.5 / 3 / 3))  # the plain mean log-ratio's gradient


@pytest.mark.parametrize("agg", list(AGGREGATIONS))
def test_masked_rows_give_the_loss_of_the_batch_without_them(agg):
    """--mask-truncated zeroes whole rows of the mask: the loss and its gradient are those of the batch without
    those rows, under every aggregation (they leave the denominator too), and differ from the unmasked loss."""
    torch.manual_seed(5)
    logp = (torch.randn(5, 6) * 0.1 - 1).requires_grad_()
    old, ref = logp.detach() + torch.randn(5, 6) * 0.05, logp.detach() + torch.randn(5, 6) * 0.05
    adv, mask = torch.randn(5), (torch.rand(5, 6) > 0.2).float()
    mask[:, 0] = 1
    keep = torch.tensor([True, False, True, True, False])
    masked = mask * keep[:, None]

    def loss(rows, m):
        value, _ = policy_loss(
            logp[rows],
            old[rows],
            adv[rows],
            m,
            ref_logp=ref[rows],
            beta=0.1,
            loss_agg=agg,
            denominator=loss_denominator(m, agg, 6),
            norm_len=6,
        )
        return value

    everything = torch.arange(5)
    with_mask, without_rows = loss(everything, masked), loss(keep.nonzero().squeeze(-1), mask[keep])
    assert with_mask.item() == pytest.approx(without_rows.item(), rel=1e-6)
    g_mask, g_rows = (torch.autograd.grad(value, logp)[0] for value in (with_mask, without_rows))
    assert torch.allclose(g_mask, g_rows) and torch.all(g_mask[~keep] == 0)
    assert with_mask.item() != pytest.approx(loss(everything, mask).item(), rel=1e-3)


def test_every_row_masked_is_a_loss_of_zero_not_nan():
    logp, old, adv, mask = pg_case()
    for agg in AGGREGATIONS:
        zero = torch.zeros_like(mask)
        value, _ = policy_loss(
            logp, old, adv, zero, beta=0.0, loss_agg=agg, denominator=loss_denominator(zero, agg, 3), norm_len=3
        )
        assert value.item() == 0.0, agg


# ---- --kl-estimator (KL_ESTIMATORS), --entropy-coef, --loss-terms (LOSS_TERMS), the seq/mask IS corrections


def test_kl_estimators_by_hand(capsys, tmp_path):
    """pi = 1/2, pi_ref = 1/4 on a token: log(pi / pi_ref) = ln 2, so k1 = ln 2, k2 = (ln 2)^2 / 2, and
    k3 = r - ln r - 1 with r = pi_ref / pi = 1/2: ln 2 - 1/2 (Schulman's note); at pi = pi_ref all three are 0.
    policy_loss picks one by name (k3 by default) and adds beta times its token mean."""
    assert {"k1", "k2", "k3"} <= set(KL_ESTIMATORS)
    logp, ref = torch.log(torch.tensor([[0.5, 0.3]])), torch.log(torch.tensor([[0.25, 0.3]]))
    ln2 = math.log(2)
    want = {"k1": ln2, "k2": ln2**2 / 2, "k3": ln2 - 0.5}
    for name, value in want.items():
        got = KL_ESTIMATORS[name](logp, ref)
        assert got[0, 0].item() == pytest.approx(value, rel=1e-6) and got[0, 1].item() == 0.0, name
        loss, m = policy_loss(logp, logp, torch.zeros(1), torch.ones(1, 2), ref_logp=ref, beta=0.5, kl_estimator=name)
        assert m["kl"] == pytest.approx(value / 2, rel=1e-6) and loss.item() == pytest.approx(0.5 * value / 2, rel=1e-6)
    with pytest.raises(KeyError, match="k4"):
        policy_loss(logp, logp, torch.zeros(1), torch.ones(1, 2), ref_logp=ref, kl_estimator="k4")
    message = f"--kl-estimator must be one of {', '.join(KL_ESTIMATORS)}"
    assert message in train_refuses(["--kl-estimator", "k4"], capsys, tmp_path)


def test_the_default_kl_estimator_is_k3_bit_for_bit():
    logp, old, adv, mask = pg_case()
    ref = old + 0.2
    default, m_default = policy_loss(logp, old, adv, mask, ref_logp=ref, beta=0.3)
    named, m_named = policy_loss(logp, old, adv, mask, ref_logp=ref, beta=0.3, kl_estimator="k3")
    assert torch.equal(default, named) and m_default == m_named
    assert m_default["kl"] == aggregate(kl_k3(logp, ref), mask).item()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("rows", [1, 3, 1000])
def test_chunked_entropy_gradient_equals_autograd(rows, temperature, monkeypatch):
    """With entropy_grad the kernel's hand-written backward gives the entropy's gradient: equal to autograd's through
    the plain token_logprobs (float64 logits: the kernel keeps them in float64, the plain version computes in
    float32), for a loss of the log-probs and the
    entropies together, of the entropies alone, and of the log-probs alone, at several chunk sizes."""
    monkeypatch.setattr(CHUNK, 40 * rows)
    torch.manual_seed(8)
    logits = (torch.randn(2, 5, 40, dtype=torch.float64) * 2).requires_grad_()
    targets = torch.randint(0, 40, (2, 5))
    w_logp, w_ent = torch.randn(2, 5, dtype=torch.float64), torch.randn(2, 5, dtype=torch.float64)
    fast, fast_ent = chunked_token_logprobs(logits, targets, temperature, entropy=True, entropy_grad=True)
    plain, plain_ent = token_logprobs(logits, targets, temperature, entropy=True, entropy_grad=True)
    assert fast_ent.requires_grad and plain_ent.requires_grad
    assert fast_ent.dtype == torch.float64 and torch.allclose(fast_ent, plain_ent.double(), atol=1e-5)
    for loss_of in (
        lambda lp, h: (lp * w_logp).sum() + (h * w_ent).sum(),
        lambda lp, h: (h * w_ent).sum(),
        lambda lp, h: (lp * w_logp).sum(),
    ):
        (ours,) = torch.autograd.grad(loss_of(fast, fast_ent), logits, retain_graph=True)
        (want,) = torch.autograd.grad(loss_of(plain, plain_ent), logits, retain_graph=True)
        assert torch.allclose(ours, want, atol=1e-5) and want.abs().max() > 0.1
    (h_only,) = torch.autograd.grad((fast_ent * w_ent).sum(), logits, retain_graph=True)
    expected = torch.autograd.grad(
        (torch.distributions.Categorical(logits=logits / temperature).entropy() * w_ent).sum(), logits
    )[0]  # -p (log p + H) / T per row, by torch
    assert torch.allclose(h_only, expected, atol=1e-5)


def test_entropy_grad_changes_no_log_prob_and_no_log_prob_gradient():
    """Asking for the entropy's gradient leaves the log-probs, the entropies and the gradient of a loss of the
    log-probs alone bit-identical to the default path, whose entropy has no gradient."""
    torch.manual_seed(9)
    logits = (torch.randn(3, 7, 50) * 3).requires_grad_()
    targets, weights = torch.randint(0, 50, (3, 7)), torch.randn(3, 7)
    logp, ent = chunked_token_logprobs(logits, targets, 0.7, entropy=True)
    logp_g, ent_g = chunked_token_logprobs(logits, targets, 0.7, entropy=True, entropy_grad=True)
    assert not ent.requires_grad and ent_g.requires_grad
    assert torch.equal(logp, logp_g) and torch.equal(ent, ent_g)
    (plain,) = torch.autograd.grad((logp * weights).sum(), logits)
    (with_grad,) = torch.autograd.grad((logp_g * weights).sum(), logits)
    assert torch.allclose(plain, with_grad, atol=1e-7)


def test_entropy_bonus_subtracts_the_aggregated_entropy():
    """--entropy-coef c: loss = L_pg + beta KL - c agg(H), logged as loss/entropy (a Share, like loss/pg); its
    gradient with respect to H is -c / N on every loss token. At c = 0 nothing changes and no metric appears."""
    logp, old, adv, mask = pg_case()
    entropy = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 99.0]], requires_grad=True)  # the masked 99 never counts
    plain, m_plain = policy_loss(logp, old, adv, mask, beta=0.0)
    off, m_off = policy_loss(logp, old, adv, mask, beta=0.0, entropy=entropy, entropy_coef=0.0)
    assert torch.equal(off, plain) and m_off == m_plain and "entropy" not in m_off
    bonus, m = policy_loss(logp, old, adv, mask, beta=0.0, entropy=entropy, entropy_coef=0.1)
    assert m["entropy"] == pytest.approx(15 / 5) and isinstance(m["entropy"], Share)
    assert bonus.item() == pytest.approx(plain.item() - 0.1 * 3.0)
    (grad,) = torch.autograd.grad(bonus, entropy)
    assert torch.allclose(grad, -0.1 / 5 * mask)
    with pytest.raises(AttributeError):  # no entropies, no bonus: train.py computes them for any --entropy-coef
        policy_loss(logp, old, adv, mask, entropy_coef=0.1)


def test_every_metric_says_how_it_reduces():
    """train.py reduces policy_loss's metrics by their kind: a Share (over the shared denominator) or a TokenMean."""
    logp, old, adv, mask = pg_case()
    _, m = policy_loss(
        logp,
        old,
        adv,
        mask,
        ref_logp=old,
        is_correction="token-tis",
        sampler_logp=old,
        entropy=torch.ones(2, 3),
        entropy_coef=0.1,
    )
    assert {key for key, value in m.items() if isinstance(value, Share)} >= {"pg", "kl", "entropy"}
    assert {key for key, value in m.items() if isinstance(value, TokenMean)} >= {
        "clip_frac_low",
        "ratio_mean",
        "is_clip_frac",
    }
    assert all(isinstance(value, (Share, TokenMean)) for value in m.values())


def logratio_l2(logp, old_logp, mask):
    return (logp - old_logp) ** 2  # (B, T)


def test_a_loss_term_is_added_with_its_coefficient_and_logged(monkeypatch, capsys, tmp_path):
    """--loss-terms NAME=COEF: policy_loss adds COEF x agg(term) and returns agg(term) under NAME, a Share. By hand,
    log-ratios 0.1, -0.2, 0.3 on one sequence: the term's token mean is (0.01 + 0.04 + 0.09) / 3."""
    monkeypatch.setitem(LOSS_TERMS, "l2", logratio_l2)
    logp = torch.tensor([[0.1, -0.2, 0.3]], requires_grad=True)
    old, mask, adv = torch.zeros(1, 3), torch.ones(1, 3), torch.tensor([0.0])  # A = 0: the pg term is 0
    value, m = policy_loss(logp, old, adv, mask, beta=0.0, loss_terms="l2=2")
    assert m["l2"] == pytest.approx(0.14 / 3) and isinstance(m["l2"], Share)
    assert value.item() == pytest.approx(2 * 0.14 / 3)
    assert torch.allclose(torch.autograd.grad(value, logp)[0], 2 * 2 * logp.detach() / 3)
    _, m_off = policy_loss(logp, old, adv, mask, beta=0.0)
    assert "l2" not in m_off
    for text, message in (
        ("l2", "not NAME=COEF"),
        ("l2=inf", "finite"),
        ("nope=1", "unknown term 'nope'"),
        ("l2=1,l2=2", "given twice"),
    ):
        with pytest.raises(ValueError, match=f"--loss-terms: .*{message}"):
            policy_loss(logp, old, adv, mask, loss_terms=text)
        assert re.search(f"--loss-terms: .*{message}", train_refuses(["--loss-terms", text], capsys, tmp_path))


def is_case():
    """One sequence of 3 tokens (and a padded 4th) with pi_old / pi_sampler = 2, 0.5, 4 (junk 1e6 on the pad)."""
    old = torch.zeros(1, 4)
    sampler = old - torch.log(torch.tensor([[2.0, 0.5, 4.0, 1e6]]))
    return old, sampler, torch.tensor([[1.0, 1.0, 1.0, 0.0]])


def test_sequence_truncated_is_by_hand():
    """seq-tis: w = min(prod_t pi_old / pi_sampler, C) on every token, from the loss tokens only: prod = 2 x 0.5 x 4 =
    4, so C = 3 gives 3 (capped on every token), C = 5 gives 4; computed in log space and detached."""
    assert "seq-tis" in IS_CORRECTIONS
    old, sampler, mask = is_case()
    w, capped = IS_CORRECTIONS["seq-tis"](old, sampler, mask, 3.0)
    assert torch.allclose(w[:, :3], torch.full((1, 3), 3.0)) and capped[:, :3].all()
    w, capped = IS_CORRECTIONS["seq-tis"](old.requires_grad_(), sampler, mask, 5.0)
    assert torch.allclose(w[:, :3], torch.full((1, 3), 4.0)) and not capped[:, :3].any() and not w.requires_grad
    logp = old.detach().clone().requires_grad_()
    loss, m = policy_loss(
        logp,
        old.detach(),
        torch.tensor([1.0]),
        mask,
        beta=0.0,
        is_correction="seq-tis",
        sampler_logp=sampler,
        is_cap=3.0,
    )
    assert loss.item() == pytest.approx(-3.0) and m["is_clip_frac"] == 1.0  # -A rho w, rho = 1
    assert m["is_ratio_mean"] == pytest.approx((2 + 0.5 + 4) / 3)  # the per-token ratios, as for token-tis


def test_token_and_sequence_masks_by_hand(capsys, tmp_path):
    """token-mask: w_t = pi_old / pi_sampler inside [1/C, C], else 0. C = 3: ratios 2, 0.5 stay, 4 is dropped (1/3 of
    the tokens masked). seq-mask: the product 4 is outside [1/3, 3], so the whole sequence drops (weight 0, still in
    the denominator); with C = 5 it stays with weight 4 on every token. C < 1 leaves an empty band: refused at
    start (config.py), whichever mask mode."""
    assert {"token-mask", "seq-mask"} <= set(IS_CORRECTIONS)
    old, sampler, mask = is_case()
    w, masked = IS_CORRECTIONS["token-mask"](old, sampler, mask, 3.0)
    assert torch.allclose(w[:, :3], torch.tensor([[2.0, 0.5, 0.0]])) and masked[:, :3].tolist() == [
        [False, False, True]
    ]
    w, masked = IS_CORRECTIONS["seq-mask"](old, sampler, mask, 3.0)
    assert torch.equal(w[:, :3], torch.zeros(1, 3)) and masked[:, :3].all()
    w, masked = IS_CORRECTIONS["seq-mask"](old, sampler, mask, 5.0)
    assert torch.allclose(w[:, :3], torch.full((1, 3), 4.0)) and not masked[:, :3].any()
    logp = old.clone().requires_grad_()
    loss, m = policy_loss(
        logp, old, torch.tensor([1.0]), mask, beta=0.0, is_correction="token-mask", sampler_logp=sampler, is_cap=3.0
    )
    assert loss.item() == pytest.approx(-(2 + 0.5 + 0) / 3) and m["is_clip_frac"] == pytest.approx(1 / 3)
    assert torch.allclose(torch.autograd.grad(loss, logp)[0], -torch.tensor([[2.0, 0.5, 0.0, 0.0]]) / 3)
    for name in ("token-mask", "seq-mask"):
        argv = ["--is-correction", name, "--is-cap", "0.5"]
        assert "--is-cap 0.5: a mask correction keeps ratios in" in train_refuses(argv, capsys, tmp_path)
