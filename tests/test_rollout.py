"""rollout.py's HF sampler (its plain loop, and speed/cpu_sampler.py's CPU fast path) on the tiny random-weight
model, and the embedded SmolLM2 (slow).

    python -m pytest tests/test_rollout.py
"""

import math
import os
import re
import time
import weakref

import pytest
import torch
from transformers import AutoModelForCausalLM

from plumbing.models import SamplingError
from plumbing.sync import probe_sync
from rollout import HFSampler, draw, make_sampler, next_tokens, resolve_model
from speed import cpu_sampler
from speed.logprobs import pad_batch, sequence_logprobs


@pytest.fixture(scope="module")
def sampler(tiny_model_dir):
    sampler = make_sampler("hf", tiny_model_dir, dtype="float32", seed=0)
    yield sampler
    sampler.close()


@pytest.fixture(scope="module")
def trainer(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def prompts(sampler):
    encode = sampler.tokenizer.encode
    return [encode("abc"), encode("a longer prompt, so the batch needs padding"), encode("x")]


def trainer_logprobs(model, prompts, groups, temperature):
    """The trainer's recomputation (speed/logprobs.py: sequence_logprobs) of every sampled completion's log-probs."""
    rows = [(p, c) for p, group in zip(prompts, groups) for c in group]
    input_ids, attention_mask, completion_mask = pad_batch([p for p, _ in rows], [c.token_ids for _, c in rows], 0)
    with torch.no_grad():
        logp = sequence_logprobs(model, input_ids, attention_mask, completion_mask.shape[1], temperature)
    return [logp[i, : len(c.token_ids)] for i, (_, c) in enumerate(rows)]


def test_shapes_and_seeding(sampler, prompts):
    out = sampler.generate(prompts, n=4, max_tokens=12, seed=7)
    assert [len(group) for group in out] == [4, 4, 4]
    for group in out:
        for c in group:
            assert 1 <= len(c.token_ids) == len(c.logprobs) <= 12
            assert all(lp <= 0 for lp in c.logprobs)
            assert c.text == sampler.tokenizer.decode(c.token_ids, skip_special_tokens=True)
    assert sampler.generate(prompts, n=4, max_tokens=12, seed=7) == out  # same seed, same samples
    other = sampler.generate(prompts, n=4, max_tokens=12, seed=8)
    assert [c.token_ids for g in other for c in g] != [c.token_ids for g in out for c in g]
    # Without a seed, a call draws seed 0's streams: every caller that samples names its own (rollout.step_seed)
    assert sampler.generate(prompts, n=4, max_tokens=12) == sampler.generate(prompts, n=4, max_tokens=12, seed=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_trainer(sampler, prompts, trainer, temperature):
    groups = sampler.generate(prompts, n=3, max_tokens=16, temperature=temperature, seed=0)
    recomputed = trainer_logprobs(trainer, prompts, groups, temperature)
    completions = [c for group in groups for c in group]
    for c, logp in zip(completions, recomputed):
        assert torch.allclose(torch.tensor(c.logprobs), logp, atol=1e-4, rtol=0)


def test_top_p_logprobs_are_renormalised(sampler, prompts, trainer):
    # Over a nucleus of mass m >= top_p, log-probs rise by -log m, a gap in (0, -log top_p].
    groups = sampler.generate(prompts, n=3, max_tokens=16, top_p=0.5, seed=0)
    full = trainer_logprobs(trainer, prompts, groups, 1.0)
    for c, logp in zip([c for group in groups for c in group], full):
        gap = torch.tensor(c.logprobs) - logp
        assert (gap > 0).all() and (gap <= -math.log(0.5) + 1e-4).all()


def test_greedy_matches_hf_generate(sampler, prompts, trainer):
    ours = sampler.generate(prompts, n=1, max_tokens=10, temperature=0)
    for prompt, group in zip(prompts, ours):
        ref = trainer.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=10,
        )[0, len(prompt) :].tolist()
        assert group[0].token_ids == ref
    # A vanishing nucleus keeps only the most likely token: sampling becomes greedy.
    nucleus = sampler.generate(prompts, n=2, max_tokens=10, top_p=1e-6, seed=3)
    assert [[c.token_ids for c in g] for g in nucleus] == [[g[0].token_ids] * 2 for g in ours]


def kept_by(probs, **filters):
    """next_tokens' kept set over one row of probabilities (vLLM's filters), and the renormalised log-prob of
    token 1, which a stub draw picks."""
    seen = []
    _, logp = next_tokens(
        torch.tensor([probs]).log(),
        [torch.Generator()],
        draw=lambda kept, u: seen.append(kept) or torch.tensor([1]),
        **{"temperature": 1.0, "top_p": 1.0, **filters},
    )
    return (seen[0][0] > 0).nonzero().squeeze(-1).tolist(), logp.item()


def test_top_k_and_min_p_keep_by_hand_what_vllm_keeps():
    probs = [0.5, 0.2, 0.15, 0.1, 0.05]
    assert kept_by(probs) == ([0, 1, 2, 3, 4], pytest.approx(math.log(0.2), abs=1e-6))  # off: as before
    assert kept_by(probs, top_k=2) == ([0, 1], pytest.approx(math.log(0.2 / 0.7), abs=1e-6))
    assert kept_by(probs, top_k=9)[0] == [0, 1, 2, 3, 4]  # k past the vocabulary keeps it all
    assert kept_by(probs, min_p=0.35)[0] == [0, 1]  # below 0.35 x 0.5 = 0.175
    # min-p after temperature (vLLM's): at T 0.5 the probabilities are p^2 / 0.325, and 0.15^2 falls below 0.15 x 0.25
    assert kept_by(probs, min_p=0.15)[0] == [0, 1, 2, 3] and kept_by(probs, min_p=0.15, temperature=0.5)[0] == [0, 1]
    # top-p acts on what top-k kept, renormalised (vLLM's order): 0.7 / 0.85 reaches 0.8, 0.7 alone would not
    assert kept_by(probs, top_k=3, top_p=0.8)[0] == [0, 1] and kept_by(probs, top_p=0.8)[0] == [0, 1, 2]


def test_top_k_and_min_p_sample_inside_the_kept_set_with_renormalised_logprobs(sampler, prompts, trainer):
    greedy = [[g[0].token_ids] * 2 for g in sampler.generate(prompts, n=1, max_tokens=10, temperature=0)]
    for filters in (dict(top_k=1), dict(min_p=0.999)):  # one token left: sampling becomes greedy
        assert [
            [c.token_ids for c in g] for g in sampler.generate(prompts, n=2, max_tokens=10, seed=3, **filters)
        ] == greedy
    groups = sampler.generate(prompts, n=3, max_tokens=16, top_k=5, min_p=0.05, seed=0)
    full = trainer_logprobs(trainer, prompts, groups, 1.0)
    for c, logp in zip([c for group in groups for c in group], full):
        gap = torch.tensor(c.logprobs) - logp
        assert (gap > -1e-5).all() and (gap > 1e-3).any()  # the kept set's mass m < 1 raises each by -log m
    assert groups != sampler.generate(prompts, n=3, max_tokens=16, seed=0)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--top-k", "-1"], "--top-k must be an integer >= 0, got -1"),
        (["--min-p", "1"], "--min-p must be in [0, 1), got 1"),
    ],
)
def test_the_sampling_filters_refuse_what_they_cannot_mean(argv, message, capsys, tmp_path):
    from tests.test_nothing_silent import train_refuses

    assert message in train_refuses(argv, capsys, tmp_path)


def test_eos_and_length(sampler, prompts):
    eos = sampler.tokenizer.eos_token_id
    completions = [c for g in sampler.generate(prompts, n=16, max_tokens=40, seed=0) for c in g]
    reasons = {c.finish_reason for c in completions}
    assert reasons == {"stop", "length"}  # this seed gives both kinds, so both branches are checked
    for c in completions:
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == eos and eos not in c.token_ids[:-1]
        else:
            assert len(c.token_ids) == 40 and eos not in c.token_ids


def test_update_weights_and_probe_sync(tiny_model_dir, prompts):
    sampler = make_sampler("hf", tiny_model_dir, dtype="float32", seed=0)
    trainer = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert probe_sync(sampler, trainer, prompts).diff < 1e-4
    before = sampler.generate(prompts, n=2, max_tokens=16, seed=0)
    torch.manual_seed(1)
    with torch.no_grad():  # a training step stand-in: every weight moves, the tied embedding too
        for p in trainer.parameters():
            p.add_(0.05 * torch.randn_like(p))
    assert probe_sync(sampler, trainer, prompts).diff > 0.1  # stale sampler is caught
    with pytest.raises(ValueError, match="shape"):  # a wrong tensor is refused before it replaces a weight
        sampler.update_weights([("model.embed_tokens.weight", torch.zeros(3, 3))])
    # named_parameters lists the tied embedding once, as model.embed_tokens.weight.
    sampler.update_weights(trainer.named_parameters())
    assert torch.equal(sampler.model.lm_head.weight, trainer.model.embed_tokens.weight)
    assert probe_sync(sampler, trainer, prompts).diff < 1e-4
    assert sampler.generate(prompts, n=2, max_tokens=16, seed=0) != before
    sampler.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bfloat16 on CPU: the packed linears too
def test_sleep_frees_the_weights_and_the_sync_brings_them_back(tiny_model_dir, prompts, dtype):
    """sleep() gives back every weight's memory; after update_weights the sampler draws exactly what a
    sampler that never slept draws from the same weights. Sampling asleep, or a sync that leaves a weight
    out, is an error, never samples from empty or stale weights."""
    awake = make_sampler("hf", tiny_model_dir, dtype=dtype, seed=0)
    sleeper = make_sampler("hf", tiny_model_dir, dtype=dtype, seed=0)
    trainer = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    packed = [m.packed_weight for m in sleeper.model.modules() if getattr(m, "packed_weight", None) is not None]
    nbytes = sum(t.numel() * t.element_size() for t in [*sleeper.model.parameters(), *packed])
    assert sleeper.sleep() == nbytes > 0
    assert all(getattr(m, "packed_weight", None) is None for m in sleeper.model.modules())
    assert all(p.numel() == 0 for p in sleeper.model.parameters())
    with pytest.raises(RuntimeError, match="asleep"):
        sleeper.generate(prompts, n=2, max_tokens=4, seed=0)
    sleeper.update_weights([(n, p) for n, p in trainer.named_parameters() if "layers.0." not in n])
    with pytest.raises(RuntimeError, match=r"weights empty \(e\.g\. model\.layers\.0\."):  # a sync left a layer out
        sleeper.generate(prompts, n=2, max_tokens=4, seed=0)
    torch.manual_seed(1)
    with torch.no_grad():  # a training step stand-in
        for p in trainer.parameters():
            p.add_(0.05 * torch.randn_like(p))
    for sampler in (awake, sleeper):
        sampler.update_weights(trainer.named_parameters())
    assert sleeper.model.lm_head.weight is sleeper.model.model.embed_tokens.weight  # still tied
    want = awake.generate(prompts, n=3, max_tokens=16, seed=5)
    got = sleeper.generate(prompts, n=3, max_tokens=16, seed=5)

    def samples(groups):
        return [[(c.token_ids, c.logprobs) for c in g] for g in groups]

    assert samples(got) == samples(want)
    awake.close()
    sleeper.close()


@pytest.mark.slow
def test_embedded_model_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("SOFTMAX_GRPO_CACHE", str(tmp_path))
    path = resolve_model("smollm2-135m")
    stamp = os.path.getmtime(os.path.join(path, "config.json"))
    time.sleep(0.01)
    assert resolve_model("smollm2-135m") == path  # second call reuses the converted folder
    assert os.path.getmtime(os.path.join(path, "config.json")) == stamp
    assert os.listdir(tmp_path) == ["smollm2-135m"]  # no temporary folder left behind
    # Greedy text in float32: bf16 rounds differently on CPUs with and without bf16 units (native units against
    # oneDNN's emulation), and its greedy answer changes with it (an AVX-512 Xeon without bf16 wrote no "Paris").
    sampler = make_sampler("hf", "smollm2-135m", dtype="float32")
    prompt = sampler.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, return_dict=False
    )
    answer = sampler.generate([prompt], n=1, max_tokens=32, temperature=0)[0][0]
    assert "Paris" in answer.text
    sampler.close()
    # bf16 works too, by what does not hinge on one rounding: the bf16 model's log-probs of the float32 answer
    # stay near float32's, and the bf16 sampler's log-probs of its own sample near the bf16 trainer's (means
    # over tokens, with room for bf16 on any CPU).
    bf16 = make_sampler("hf", "smollm2-135m", dtype="bfloat16")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    ids, attention, mask = pad_batch([prompt], [answer.token_ids], 0)
    with torch.no_grad():
        bf16_logp = sequence_logprobs(model, ids, attention, mask.shape[1])[0]  # (K,)
    assert (bf16_logp - torch.tensor(answer.logprobs)).abs().mean() < 0.1, (bf16_logp, answer.logprobs)
    probe = bf16.generate([prompt], n=1, max_tokens=16, seed=0)[0][0]  # a bf16 sample, scored by the bf16 trainer
    ids, attention, mask = pad_batch([prompt], [probe.token_ids], 0)
    with torch.no_grad():
        trainer_logp = sequence_logprobs(model, ids, attention, mask.shape[1])[0]
    assert (trainer_logp - torch.tensor(probe.logprobs)).abs().mean() < 0.1, (trainer_logp, probe.logprobs)
    bf16.close()


@pytest.mark.parametrize("draw", [draw, cpu_sampler.draw], ids=["plain", "blocked"])
def test_draw_follows_the_probabilities_and_never_picks_a_zero(draw):
    """The samplers' inverse-CDF draws (one uniform per row) have multinomial's distribution."""
    probs = torch.tensor([0.1, 0.0, 0.45, 0.0, 0.3, 0.15, 0.0]) * 3  # unnormalised, zeros as top-p leaves them
    n = 200_000
    generator = torch.Generator().manual_seed(0)
    tokens = draw(probs.expand(n, -1), torch.rand(n, generator=generator, dtype=torch.float64))  # (n,)
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    p = (probs / probs.sum()).double()
    assert counts[p == 0].sum() == 0
    sigma = (n * p * (1 - p)).sqrt()
    assert ((counts - n * p).abs() <= 4 * sigma + 1e-9).all(), (counts / n, p)
    # a row with all its mass on the last token, and one with a single tiny entry, still draw it
    edge = torch.zeros(2, 49152)
    edge[0, -1], edge[1, 1234] = 1.0, 1e-30
    assert draw(edge, torch.tensor([0.0, 1 - 2**-53], dtype=torch.float64)).tolist() == [49151, 1234]
    assert draw(edge, torch.tensor([0.5, 0.5])).tolist() == [49151, 1234]


@pytest.mark.parametrize("draw", [draw, cpu_sampler.draw], ids=["plain", "blocked"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0])
def test_draw_refuses_a_distribution_that_is_not_finite(bad, draw):
    probs = torch.tensor([[0.2, 0.3, 0.5], [0.0, 0.0, 0.0]])
    probs[1, 1] = bad  # a NaN or inf entry, or a row with no mass at all
    with pytest.raises(SamplingError, match="not finite"):
        draw(probs, torch.rand(2))


def test_every_step_rank_prompt_and_sample_gets_its_own_stream():
    """train.py seeds rank r's call with step_seed; both samplers give sample k of prompt i stream seed + i*n + k."""
    from rollout import step_seed

    for world, batch, M in [(1, 4, 8), (2, 4, 8), (4, 8, 3)]:
        streams = [
            step_seed(run_seed, step, rank * (batch // world), batch, M) + i * M + k
            for run_seed in range(3)
            for step in range(6)
            for rank in range(world)
            for i in range(batch // world)
            for k in range(M)
        ]
        assert len(set(streams)) == len(streams) == 3 * 6 * batch * M
    # ranks differing by one in their base seed is exactly what made vLLM repeat samples across ranks
    assert step_seed(0, 0, 1, 4, 8) - step_seed(0, 0, 0, 4, 8) == 8


def test_a_sample_depends_only_on_its_stream(sampler, prompts):
    """Sample k of prompt i drawn in a batch equals the same stream drawn alone: nothing else in the batch (or on
    another rank) changes it."""
    together = sampler.generate(prompts, n=3, max_tokens=12, seed=40)
    for i, prompt in enumerate(prompts):
        for k in range(3):
            alone = sampler.generate([prompt], n=1, max_tokens=12, seed=40 + i * 3 + k)[0][0]
            assert alone.token_ids == together[i][k].token_ids


def test_finished_rows_leave_the_batch_without_changing_samples(sampler, prompts, trainer):
    """Rows that drew EOS leave the decode batch (once an eighth of it has). The rows still decoding keep their
    own streams (each equals its stream drawn alone) and their caches, masks and positions (log-probs equal the
    trainer's recomputation)."""
    n, seed = 16, 0
    groups = sampler.generate(prompts, n=n, max_tokens=40, seed=seed)
    lengths = sorted(len(c.token_ids) for g in groups for c in g)
    assert lengths[len(lengths) // 8] < 35 and lengths[-1] == 40  # an eighth left the batch, others ran on after
    for c, logp in zip([c for g in groups for c in g], trainer_logprobs(trainer, prompts, groups, 1.0)):
        assert torch.allclose(torch.tensor(c.logprobs), logp, atol=1e-4, rtol=0)
    for i, prompt in enumerate(prompts):
        for k in range(0, n, 5):
            alone = sampler.generate([prompt], n=1, max_tokens=40, seed=seed + i * n + k)[0][0]
            assert alone.token_ids == groups[i][k].token_ids


@pytest.mark.parametrize(
    "temperature,top_p,filters",
    [(1.0, 1.0, {}), (0.7, 0.9, {}), (0.0, 1.0, {}), (0.9, 0.95, dict(top_k=20, min_p=0.01))],
)
def test_cpu_fast_path_samples_what_the_plain_loop_samples(
    tiny_model_dir, prompts, trainer, temperature, top_p, filters
):
    """speed/cpu_sampler.py against rollout.HFSampler's plain loop (DynamicCache, eager attention, the full-CDF
    draw, every row decoded to the end): the same tokens, log-probs equal to float rounding, on sampled, nucleus
    and greedy rows, with rows leaving the fast batch; and again after a weight sync."""
    fast, plain = (HFSampler(tiny_model_dir, dtype="float32", fast=use) for use in (True, False))
    assert fast.fast is not None and plain.fast is None

    def compare():
        a = fast.generate(prompts, n=16, max_tokens=40, temperature=temperature, top_p=top_p, seed=3, **filters)
        b = plain.generate(prompts, n=16, max_tokens=40, temperature=temperature, top_p=top_p, seed=3, **filters)
        assert [[c.token_ids for c in g] for g in a] == [[c.token_ids for c in g] for g in b]
        assert [[c.finish_reason for c in g] for g in a] == [[c.finish_reason for c in g] for g in b]
        for x, y in zip([c for g in a for c in g], [c for g in b for c in g]):
            assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)
        return a

    before = compare()
    lengths = sorted(len(c.token_ids) for g in before for c in g)
    if temperature:  # rows left the fast batch while others decoded on
        assert lengths[len(lengths) // 8] < 35 and lengths[-1] == 40
    moved = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    torch.manual_seed(2)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.05 * torch.randn_like(p))
    for s in (fast, plain):
        s.sleep()
        s.update_weights(moved.named_parameters())
    assert compare() != before


@pytest.mark.parametrize("vocab,block", [(49152, 256), (1000, 64), (777, 256)])
def test_blocked_draw_equals_the_full_cdf(vocab, block):
    """The fast draw inverts the CDF block by block; it picks the same token as the plain draw's full float64 CDF,
    on peaked and flat softmax rows and on top-p rows full of zeros. Only a uniform within float64 rounding of 1
    may pick another token (the two sums differ in their last bits there, and tokens below that rounding cannot
    move either CDF), and still never a zero."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(512, vocab, generator=generator) * torch.linspace(0.5, 8, 512)[:, None]  # (R, V)
    probs = torch.softmax(logits, -1)
    nucleus = probs.masked_fill(probs < probs.amax(-1, keepdim=True) / 50, 0.0)  # a top-p-like cut, many zeros
    for p in (probs, nucleus):
        for _ in range(4):
            uniforms = torch.rand(512, generator=generator, dtype=torch.float64)
            assert torch.equal(cpu_sampler.draw(p, uniforms, block=block), draw(p, uniforms))
        lowest = torch.zeros(512, dtype=torch.float64)
        assert torch.equal(cpu_sampler.draw(p, lowest, block=block), draw(p, lowest))
        top = cpu_sampler.draw(p, torch.full((512,), 1 - 2**-53, dtype=torch.float64), block=block)  # (R,)
        assert (p.gather(-1, top[:, None]) > 0).all()


@pytest.mark.parametrize("bucket", [None, 3, 4, 64])
def test_grouped_attention_matches_eager(tiny_model_dir, bucket):
    """The HF sampler's attention (query heads grouped onto their shared key/value head, no repeat_kv copy) gives
    eager attention's logits through a padded prefill, the cache repeat for n samples, decode steps and rows
    leaving the batch; so does its KV cache (speed/cpu_sampler.py's BucketedLayer: a buffer a multiple of `bucket`
    long, masked past the cached tokens; 3 fits the 9-token prefill exactly, 4 regrows it twice, 64 never) against
    transformers' DynamicCache."""
    from transformers.cache_utils import Cache, DynamicCache

    from plumbing.models import load_model
    from speed.cpu_sampler import BucketedLayer

    eager, grouped = load_model(tiny_model_dir), load_model(tiny_model_dir)
    grouped.set_attn_implementation("grouped_eager")
    assert eager.config._attn_implementation == "eager"
    assert eager.config.num_key_value_heads < eager.config.num_attention_heads  # the grouping is exercised
    generator = torch.Generator().manual_seed(0)
    lengths = [5, 9, 2]
    input_ids = torch.randint(3, eager.config.vocab_size, (3, 9), generator=generator)  # (G, P)
    mask = (torch.arange(9)[None] >= 9 - torch.tensor(lengths)[:, None]).long()  # (G, P) left-padded
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    caches = [
        DynamicCache(config=eager.config),
        DynamicCache(config=eager.config)
        if bucket is None
        else Cache(layers=[BucketedLayer(bucket) for _ in range(eager.config.num_hidden_layers)]),
    ]
    with torch.no_grad():
        outs = [
            m(input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=c, use_cache=True)
            for m, c in zip((eager, grouped), caches)
        ]
        real = mask.bool()
        assert torch.allclose(outs[0].logits[real], outs[1].logits[real], atol=1e-5, rtol=0)
        for c in caches:
            c.batch_repeat_interleave(2)
        mask, positions = mask.repeat_interleave(2, 0), positions.repeat_interleave(2, 0)[:, -1:]  # (R, P), (R, 1)
        for step in range(8):
            if step == 3:  # rows 1, 4, 5 finished
                keep = torch.tensor([0, 2, 3])
                for c in caches:
                    c.batch_select_indices(keep)
                mask, positions = mask[keep], positions[keep]
            token = torch.randint(3, eager.config.vocab_size, (len(mask), 1), generator=generator)  # (A, 1)
            positions, mask = positions + 1, torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            logits = [
                m(
                    input_ids=token, attention_mask=mask, position_ids=positions, past_key_values=c, use_cache=True
                ).logits
                for m, c in zip((eager, grouped), caches)
            ]
            assert torch.allclose(logits[0], logits[1], atol=1e-5, rtol=0)
    if bucket is not None:  # the buffer: the 9 + 8 tokens, rounded up to the bucket
        assert caches[1].get_seq_length() == 17 and caches[1].layers[0].keys.shape[2] == -(-17 // bucket) * bucket


def test_packed_bf16_linears_compute_the_plain_linears(tiny_model_dir, prompts, monkeypatch):
    """A bfloat16 sampler on CPU computes its linear layers from oneDNN-packed weights and frees the plain ones
    (all but a tied lm_head's, which is the embedding table): the same samples and log-probs, bit for bit, as a
    sampler with plain layers, before and after update_weights (which packs the new weights straight in)."""
    sampler = make_sampler("hf", tiny_model_dir, dtype="bfloat16", seed=0)
    with monkeypatch.context() as patch:
        patch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
        plain = make_sampler("hf", tiny_model_dir, dtype="bfloat16", seed=0)
    assert not plain.fast.packed

    def generate(s):
        return s.generate(prompts, n=4, max_tokens=16, seed=5)

    supported = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert sampler.fast.packed == supported
    if not supported:  # this CPU's oneDNN has no bf16 kernels (AVX2 only): the fast path keeps plain layers
        assert not any(getattr(m, "packed_weight", None) is not None for m in sampler.model.modules())
        assert generate(sampler) == generate(plain)
        return
    embedding = sampler.model.get_input_embeddings().weight
    assert sampler.model.lm_head.weight is embedding and embedding.numel() > 0  # tied: still read as the table
    linears = [m for m in sampler.model.modules() if isinstance(m, torch.nn.Linear) and m.weight is not embedding]
    assert linears and all(m.weight.numel() == 0 and m.packed_weight.numel() > 0 for m in linears)

    before = generate(sampler)
    assert before == generate(plain)
    trainer = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.05 * torch.randn_like(p))
    for s in (sampler, plain):
        s.update_weights(trainer.named_parameters())
    after = generate(sampler)
    assert after != before and after == generate(plain)
    with pytest.raises(ValueError, match="shape"):  # a packed-only weight is checked as a copy_ would check it
        sampler.update_weights([("model.layers.0.mlp.up_proj.weight", torch.zeros(3, 3))])
    sampler.close()


# ---- the weight sync: streamed, and a sleeping engine woken in two steps around it (rollout.py: VLLMSampler)


def gathered(model, alive_before):
    """plumbing.parallel.full_weights as FSDP2 runs it: each parameter gathered afresh (here a copy) only when
    asked for. Before gathering one, it records how many of the earlier ones are still alive."""
    earlier = []
    for name, p in model.named_parameters():
        alive_before.append(sum(ref() is not None for ref in earlier))
        full = p.detach().clone()
        earlier.append(weakref.ref(full))
        yield name, full
        del full


class FakeEngine:
    """The calls VLLMSampler makes on vllm.LLM, recorded in order; reload_weights reads its iterator one tensor at a
    time and keeps none, as vLLM's loader does layer by layer."""

    def __init__(self):
        self.calls, self.loaded = [], {}

    def sleep(self, level):
        self.calls.append(f"sleep({level})")

    def wake_up(self, tags=None):
        self.calls.append(f"wake_up({tags})")

    def collective_rpc(self, method, kwargs):
        self.calls.append(method)
        for name, tensor in kwargs["weights_iterator"]:
            self.loaded[name] = tuple(tensor.shape)
            del tensor

    def apply_model(self, fn):
        self.calls.append("apply_model")

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")


def fake_vllm_sampler(on_gpu):
    from rollout import VLLMSampler

    sampler = VLLMSampler.__new__(VLLMSampler)  # no engine built: FakeEngine stands in for vllm.LLM
    sampler.llm, sampler.on_gpu, sampler.asleep = FakeEngine(), on_gpu, False
    return sampler


def test_the_weight_sync_holds_one_gathered_parameter_at_a_time(tiny_model_dir, trainer):
    """Both samplers consume the sync's iterator as it comes: when a parameter is gathered, no earlier gathered
    parameter is still alive (a sampler that listed them first would hold the whole model at once)."""
    names = [name for name, _ in trainer.named_parameters()]
    hf = make_sampler("hf", tiny_model_dir, dtype="float32", seed=0)
    for sampler in (hf, fake_vllm_sampler(on_gpu=False)):
        alive = []
        sampler.update_weights(gathered(trainer, alive))
        assert len(alive) == len(names) > 10 and max(alive) == 0, alive
    listing = []  # the check can fail: consuming the iterator into a list keeps every earlier one alive
    held = list(gathered(trainer, listing))
    assert max(listing) == len(names) - 1 and held
    assert probe_sync(hf, trainer, [[5, 6, 7]]).diff < 1e-4  # and the streamed weights did arrive
    hf.close()


def test_a_sleeping_engine_wakes_in_two_steps_around_the_sync(trainer, monkeypatch):
    """On a GPU: asleep at level 2 (weights discarded, not copied to host: the sync overwrites them), then weights
    first (after the allocator's cache is emptied), the streamed reload, the cache emptied again, then the KV cache;
    nothing else between. On CPU (no sleep mode) the same calls wake nothing."""
    events = []
    free = iter([10e9, 25e9])  # device memory free before and after sleep
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (next(free), 80e9))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    gpu = fake_vllm_sampler(on_gpu=True)
    gpu.llm.calls = events
    assert gpu.sleep() == 15e9 and gpu.asleep
    with pytest.raises(RuntimeError, match="asleep"):  # level 2 kept no weights: nothing to sample from
        gpu.generate([[1, 2]], n=1, max_tokens=1)
    assert events == ["sleep(2)"]
    gpu.update_weights(gathered(trainer, []))
    assert events == [
        "sleep(2)",
        "empty_cache",
        "wake_up(['weights'])",
        "reload_weights",
        "empty_cache",
        "wake_up(['kv_cache'])",
        "reset_prefix_cache",
    ]
    assert set(gpu.llm.loaded) == {name for name, _ in trainer.named_parameters()} and not gpu.asleep
    events.clear()
    gpu.update_weights(gathered(trainer, []))  # awake already: a sync wakes nothing
    assert events == ["reload_weights", "reset_prefix_cache"]
    cpu = fake_vllm_sampler(on_gpu=False)
    cpu.llm.calls = events
    events.clear()
    assert cpu.sleep() == 0 and not cpu.asleep
    cpu.update_weights(gathered(trainer, []))
    assert events == ["reload_weights", "apply_model", "reset_prefix_cache"]  # apply_model: the tied lm_head repack


# ---- the weight check (plumbing/sync.py: check_weights): an engine that took only part of an update

# {what the SyncError names: the trainer's names a half sync leaves out}
SKIPS = {
    "norms": "norm",
    "biases": ".bias",
    "embedding rows": "embed_tokens",
    "q/k/v rows": "k_proj.weight",
    "gate/up rows": "up_proj.weight",
    "other weights": "o_proj.weight",
}


def updated(model_dir, step_size):
    """The trainer after one step: every parameter moved by +-step_size, as AdamW moves it by about lr."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(step_size * torch.randn_like(p).sign())
    return model


@pytest.mark.parametrize("dtype, step_size", [("float32", 1e-6), ("bfloat16", 1e-2)])  # bf16: a step past its ulps
def test_the_weight_check_names_the_family_a_sync_skipped(tmp_path, dtype, step_size):
    from plumbing.sync import SyncError, check_weights, weight_checksums
    from tools.tiny_model import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "bias", attention_bias=True)  # q/k/v/o biases, as Qwen2's q/k/v
    sampler = make_sampler("hf", model_dir, dtype=dtype, seed=0)
    old, trainer = AutoModelForCausalLM.from_pretrained(model_dir), updated(model_dir, step_size)
    for label, skipped in SKIPS.items():
        sampler.update_weights(old.named_parameters())  # the engine before the step
        sampler.update_weights((n, p) for n, p in trainer.named_parameters() if skipped not in n)
        with pytest.raises(SyncError, match=f"^the engine's {re.escape(label)}.* after the step-3 sync") as info:
            check_weights(weight_checksums(sampler, trainer), 3, torch.device("cpu"))
        also = "; also lm_head rows" if label == "embedding rows" else "; also"  # a tied lm_head is the embedding
        assert "\n" not in str(info.value) and str(info.value).count(also) == (also != "; also")  # that family alone
        sampler.update_weights(trainer.named_parameters())  # a full sync
        assert check_weights(weight_checksums(sampler, trainer), 3, torch.device("cpu")) == {"sync/weight_diff": 0.0}
    sampler.update_weights(old.named_parameters())  # a sync that never happened
    with pytest.raises(SyncError, match=r"^the engine's embedding rows .*; also lm_head rows .*, norms, biases, q/k/v"):
        check_weights(weight_checksums(sampler, trainer), 3, torch.device("cpu"))
    sampler.close()
