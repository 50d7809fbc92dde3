"""Rollouts (Section 4): M completions per prompt from the current policy, with the sampler's log-probs.

`make_sampler("vllm" | "hf", path)` gives `generate` (completions with per-token log-probs), `update_weights` (the
trainer -> sampler sync), `sleep`/`wake` (memory for training) and `close`: vLLM on GPUs, a short loop over a
transformers model on CPUs. The log-probs are of the distribution each token was drawn from, softmax(logits / T)
over the nucleus, which at top_p = 1 is what `loss.sequence_logprobs` recomputes (pi_old). `sync_check` compares
the two on a probe: a sampler that silently keeps its old weights is how a GRPO trainer fails without an error.
A step's batch comes from one ROLLOUTS entry (--rollout): `plain`, the paper's, or `dapo`, DAPO's dynamic sampling
with refill; each samples and scores (`score`) under the per-rank contract in plain_rollout's docstring.

    python -m pytest tests/test_rollout.py tests/test_rollout_step.py
    python -m pytest tests/test_rollout_vllm.py   # after scripts/setup_vllm_cpu.sh
"""

import functools
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import DynamicCache

from loss import pad_batch, sequence_logprobs
from plumbing.data import batch_indices
from plumbing.hf_weights import SamplerWeights
from plumbing.models import check_finite, load_model, load_tokenizer, resolve_model
from plumbing.parallel import all_reduce_sum, gather_rows
from plumbing.sync import SyncProbe
from plumbing.vllm_sampler import Completion, VLLMSampler  # what a sample is; the colocated vLLM engine
from rewards import declared_lengths, take_error_count
from speed import cpu_sampler


# ---------------------------------------------------------------- sampling one token (HFSampler's decode step)
def next_tokens(logits, generators, *, temperature, top_p, draw):
    """One decode step's choice: (A, V) logits -> (A,) tokens and (A,) log-probs of the distribution each was
    drawn from. Greedy at temperature 0; otherwise one uniform per row from the row's own generator."""
    scaled = logits if temperature in (0, 1) else logits / temperature  # greedy: unscaled; x / 1 is x
    logp_all = torch.log_softmax(scaled, -1)  # (A, V)
    if temperature == 0:
        check_finite(logp_all.amax(-1).exp())  # in [1/V, 1] unless NaN: argmax would pick from NaN silently
        token = logits.argmax(-1)  # (A,)
    else:
        kept = _top_p(logp_all.exp(), top_p)  # (A, V)
        uniforms = torch.cat([torch.rand(1, generator=g, dtype=torch.float64, device=logits.device)
                              for g in generators])  # (A,)
        token = draw(kept, uniforms)  # (A,)
    logp = logp_all.gather(-1, token[:, None]).squeeze(-1)  # (A,)
    if temperature != 0 and top_p < 1.0:  # the renormalised nucleus is what it was drawn from
        logp = logp - kept.sum(-1).log()
    return token, logp


def draw(probs, uniforms):
    """One token per row of `probs` (R, V), non-negative and unnormalised, by inverting the row's float64 CDF at
    its uniform in [0, 1) from `uniforms` (R,). A zero-probability token (cut by top-p) is never drawn."""
    cdf = probs.double().cumsum(-1)  # (R, V)
    total = cdf[:, -1:]  # (R, 1)
    check_finite(total)  # a NaN or inf anywhere in a row reaches its total
    u = torch.minimum(uniforms.double()[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))  # < total
    return torch.searchsorted(cdf, u, right=True).squeeze(-1)  # (R,)


def _top_p(probs, top_p):
    """Nucleus filter (Holtzman et al., 2020): keep the smallest top set whose mass reaches top_p."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(-1, descending=True)  # (R, V)
    drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p  # mass before this token already enough
    return probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))


# ---------------------------------------------------------------- the rollout step (train.py: ROLLOUTS[--rollout])
@dataclass
class Batch:
    """What one step trains on. Lists are this rank's G_local = G / world groups; `scores` are every rank's,
    gathered in rank order (this rank's at rows rank * G_local onwards): rewards, passed, lengths, cut, each
    (G, M); terms {term: (G, M)}; errors (an int). `metrics`: the rollout's own (rollout/...), {} for plain."""

    examples: list  # G_local tasks.Examples
    prompts: list  # G_local prompts' token ids
    groups: list  # G_local lists of M Completions
    scores: dict
    metrics: dict = field(default_factory=dict)


def plain_rollout(step: int, **run) -> Batch:
    """The paper's step: --rollout-batch prompts of the data stream, M samples each, scored.

    The per-rank contract of every ROLLOUTS entry, `rollout(step, sampler=, task=, train_set=, train_ids=,
    weights=, args=, rank=, world=, device=) -> Batch`. Every rank calls it at every step and makes the same
    collective calls in the same order: each `score` (sample_round calls it) gathers over ranks, so all ranks
    score the same number of rounds. A decision (another round, which groups to keep) is taken from gathered
    scores only, never from this rank's own samples, so every rank takes the same one. Every rank returns
    G_local = --rollout-batch / world groups of M samples, the ones it sampled itself (FSDP2's collectives in
    ppo_update need equal shares). Which prompts and which seeds a round uses is a function of (--seed, step,
    round) alone (sample_round), so a resumed run samples what the straight one did.
    """
    return sample_round(step, 0, **run)


def dapo_rollout(step: int, **run) -> Batch:
    """DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476, Sec. 3.2, the constraint of Eq. 11): a group whose
    rewards are all equal (std <= --filter-std) has zero advantage and no gradient signal, so it is dropped and new
    prompts are sampled (refill rounds of --rollout-batch prompts each) until the batch is full of groups with
    signal, for at most --max-refill-rounds rounds. Each rank fills its own share from the groups it sampled, and
    the rounds go on until every rank's share is full: the gathered rewards decide, so all ranks agree.

    Past the last round a share short of signal is filled with its zero-signal groups, earliest first, so shapes
    stay fixed; these train with advantage 0 (the KL term only) and count in the loss denominator, as in plain.
    rollout/signal_frac (the trained batch's fraction of groups with signal) below 1 says so.
    """
    args, world, rank = run["args"], run["world"], run["rank"]
    n_local, rounds = args.rollout_batch // world, []
    while len(rounds) <= args.max_refill_rounds:
        rounds.append(sample_round(step, len(rounds), **run))
        rewards = torch.stack([b.scores["rewards"] for b in rounds])  # (rounds, G, M), the same on every rank
        signal = (rewards.std(-1, correction=0) > args.filter_std).view(len(rounds), world, n_local)
        if (signal.sum((0, 2)) >= n_local).all():  # every rank's share can be full
            break
    candidates = [(r, i) for r in range(len(rounds)) for i in range(n_local)]  # (round, local index): oldest first
    picks = [sorted(candidates, key=lambda c: not signal[c[0], q, c[1]])[:n_local] for q in range(world)]  # stable
    kept = torch.tensor([float(signal[r, q, i]) for q, chosen in enumerate(picks) for r, i in chosen])  # (G,)
    return assemble(rounds, picks, rank, {
        "rollout/rounds": len(rounds),  # 1 + the refill rounds taken
        "rollout/groups_dropped": int((~signal).sum()) - int((1 - kept).sum()),  # zero-signal groups not trained
        "rollout/signal_frac_first": signal[0].float().mean().item(),  # with signal among the first round's
        "rollout/signal_frac": kept.mean().item()})  # with signal in the trained batch: 1 unless rounds ran out


ROLLOUTS = {"plain": plain_rollout, "dapo": dapo_rollout}  # --rollout; a fork's entry: docs/fork.md


def sample_round(step: int, refill: int, *, sampler, task, train_set, train_ids, weights, args, rank, world,
                 device) -> Batch:
    """Round `refill` of `step` (0: the step's own prompts), scored: every world-th prompt of --rollout-batch on
    this rank (minibatch j as in one process), M samples each from streams of their own (step_seed)."""
    n_local = args.rollout_batch // world
    mine = batch_indices(step, args.rollout_batch, len(train_set), args.seed, refill)[rank::world]
    examples, prompts = [train_set[i] for i in mine], [train_ids[i] for i in mine]
    seed = step_seed(args.seed, step, rank * n_local, args.rollout_batch, args.M, refill)
    groups = sampler.generate(prompts, n=args.M, max_tokens=args.max_tokens, temperature=args.temperature,
                              top_p=args.top_p, seed=seed)  # G_local lists of M completions
    limits = dict(max_tokens=args.max_tokens, overlong_buffer=args.overlong_buffer or max(1, args.max_tokens // 5))
    return Batch(examples, prompts, groups, score(task, examples, groups, weights, device, limits))


def assemble(rounds: list[Batch], picks: list[list[tuple[int, int]]], rank: int, metrics=None) -> Batch:
    """The batch of the groups `picks` names: picks[q] holds rank q's (round, local index) pairs, as many on every
    rank; this rank keeps its own samples, the scores are every rank's, gathered rows in rank order."""
    n_local = len(rounds[0].groups)

    def rows(table):  # (G, M): the picked rows of table(round), a gathered (G, M)
        return torch.stack([table(r)[q * n_local + i] for q, chosen in enumerate(picks) for r, i in chosen])

    scores = {key: rows(lambda r, key=key: rounds[r].scores[key]) for key in ("rewards", "passed", "lengths", "cut")}
    scores["terms"] = {term: rows(lambda r, term=term: rounds[r].scores["terms"][term])
                       for term in rounds[0].scores["terms"]}
    scores["errors"] = sum(b.scores["errors"] for b in rounds)  # every round's, as each was scored
    mine = picks[rank]
    return Batch([rounds[r].examples[i] for r, i in mine], [rounds[r].prompts[i] for r, i in mine],
                 [rounds[r].groups[i] for r, i in mine], scores, metrics or {})


def score(task, examples, groups, weights: dict, device, limits=None) -> dict:
    """This rank's groups scored, then gathered: rewards, verifier passes, lengths, truncations and each reward
    term, each (G, M). The reward is the weighted sum of the terms of `weights` (--reward-weights, or --reward
    alone: tasks.reward_weights). A term declaring `n_tokens` gets the completion's token count, and any of
    `limits`' keywords it declares (max_tokens, overlong_buffer) their values: a length-aware term is one edit."""
    def table(term):  # (G_local, M): one reward term of every sample
        return torch.tensor([[task.reward(c.text, ex, kind=term, **declared_lengths(
            term, n_tokens=len(c.token_ids), **(limits or {}))) for c in g] for ex, g in zip(examples, groups)])

    terms = {term: table(term) for term in weights}
    rewards = sum(weight * terms[term] for term, weight in weights.items())  # r = sum_k w_k r_k
    passed = terms["exact"] if "exact" in terms else table("exact") if task.has_verifier else 0 * rewards
    lengths = torch.tensor([[len(c.token_ids) for c in g] for g in groups], dtype=torch.float32)  # (G_local, M)
    cut = torch.tensor([[c.finish_reason == "length" for c in g] for g in groups], dtype=torch.float32)
    return {"rewards": gather_rows(rewards, device), "passed": gather_rows((passed >= 0.5).float(), device),
            "lengths": gather_rows(lengths, device), "cut": gather_rows(cut, device),
            "terms": {term: gather_rows(terms[term], device) for term in weights},
            "errors": all_reduce_sum([take_error_count()], device)[0]}


# ---------------------------------------------------------------- the samplers
class HFSampler(SamplerWeights):
    """Sampling with Hugging Face transformers on the sampler's own copy of the model."""

    def __init__(self, model_path, *, dtype, seed, device="cpu", fast=None):
        self.tokenizer = load_tokenizer(model_path)
        self.model = load_model(model_path, getattr(torch, dtype), device).eval().requires_grad_(False)
        self.shapes = {name: p.shape for name, p in self.model.named_parameters(remove_duplicate=False)}
        self.dtype = self.model.dtype
        # SPEED: on CPU, speed/cpu_sampler.py's decode loop and packed weights (the same samples as _decode)
        use_fast = self.model.device.type == "cpu" if fast is None else fast  # `fast`: the tests' choice
        self.fast = cpu_sampler.FastPath(self.model) if use_fast else None
        eos = self.model.generation_config.eos_token_id  # None, one id, or a list (chat models)
        self.eos_ids = {self.tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None}
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.eos_ids)
        self.seed, self.calls = seed, 0

    @torch.inference_mode()
    def generate(self, prompts, *, n, max_tokens, temperature=1.0, top_p=1.0, seed=None):
        """G lists of n Completions. Sample k of prompt i draws from its own stream, seed + i * n + k, as
        vLLM seeds it, so a sample does not depend on what else is in the batch. Without a seed each call
        draws fresh samples, still reproducible from the sampler seed."""
        if self._empty_weights():
            raise RuntimeError("the HF sampler is asleep: update_weights must give it weights before it samples")
        self.calls += 1
        device = self.model.device
        base = self.seed * 1_000_003 + self.calls if seed is None else seed
        generators = [torch.Generator(device).manual_seed(base + row) for row in range(len(prompts) * n)]
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts])  # (G, P) left-padded
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # (G, P)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (G, P): real tokens count from 0
        choose = functools.partial(next_tokens, temperature=temperature, top_p=top_p,
                                   draw=cpu_sampler.draw if self.fast else draw)
        decode = self.fast.decode if self.fast else self._decode
        tokens, logps = decode(self.model, input_ids.to(device), mask.to(device), positions.to(device), generators,
                               n=n, max_tokens=max_tokens, pad_id=self.pad_id, choose=choose,
                               eos=torch.tensor(sorted(self.eos_ids), device=device))  # (R, K) each, R = G * n
        results = []
        for ids, lps in zip(tokens.tolist(), logps.tolist()):
            stop = next((i for i, t in enumerate(ids) if t in self.eos_ids), None)
            end = len(ids) if stop is None else stop + 1
            text = self.tokenizer.decode(ids[:end], skip_special_tokens=True)
            results.append(Completion(ids[:end], lps[:end], text, "length" if stop is None else "stop"))
        return [results[i * n:(i + 1) * n] for i in range(len(prompts))]

    @staticmethod
    def _decode(model, input_ids, mask, positions, generators, *, n, max_tokens, pad_id, eos, choose):
        """One prefill per prompt, its KV cache repeated for its n samples (group members adjacent), then one
        decode step per token for every row. Returns the tokens and their log-probs, (R, K) each."""
        cache = DynamicCache(config=model.config)
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                    use_cache=True, logits_to_keep=1)
        cache.batch_repeat_interleave(n)
        logits = out.logits[:, -1].float().repeat_interleave(n, 0)  # (R, V)
        mask, positions = mask.repeat_interleave(n, 0), positions.repeat_interleave(n, 0)[:, -1:]  # (R, P), (R, 1)
        tokens = torch.full((len(logits), max_tokens), pad_id, device=input_ids.device)  # (R, K)
        logps = torch.zeros(len(logits), max_tokens, device=input_ids.device)  # (R, K)
        live = torch.ones(len(logits), dtype=torch.bool, device=input_ids.device)  # (R,): not finished yet
        for i in range(max_tokens):
            token, logp = choose(logits, generators)  # (R,), (R,)
            tokens[live, i], logps[live, i] = token[live], logp[live]
            token = torch.where(live, token, pad_id)  # finished rows feed padding
            live &= ~torch.isin(token, eos)
            if not live.any() or i == max_tokens - 1:
                break
            positions, mask = positions + 1, torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            out = model(input_ids=token[:, None], attention_mask=mask, position_ids=positions,
                        past_key_values=cache, use_cache=True, logits_to_keep=1)
            logits = out.logits[:, -1].float()  # (R, V)
        return tokens, logps


SAMPLERS = ("hf", "vllm")  # --sampler's kinds (and auto: vllm on a GPU, hf on CPU)


def make_sampler(backend, model_path, *, dtype="bfloat16", max_model_len=2048, seed=0, gpu_memory_utilization=0.3,
                 device="cpu", max_num_seqs=None):
    if backend not in SAMPLERS:
        raise ValueError(f"unknown backend {backend!r}: use one of {', '.join(SAMPLERS)}")
    if backend == "hf":
        return HFSampler(resolve_model(model_path), dtype=dtype, seed=seed, device=device)
    return VLLMSampler(resolve_model(model_path), dtype=dtype, max_model_len=max_model_len, seed=seed,
                       gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max_num_seqs)  # None: vLLM's


MAX_REFILLS = 15  # refill rounds a step may take (--max-refill-rounds): each draws from a step lane of its own


def step_seed(run_seed: int, step: int, first_prompt: int, prompts_per_step: int, n: int, refill: int = 0) -> int:
    """The `seed` of one rank's generate() call in a training step. Sample k of the call's prompt i then draws
    stream ((run_seed * 2^24 + step) * prompts_per_step + first_prompt + i) * n + k: one stream per (run seed,
    step, prompt, sample) when rank r passes first_prompt = r * its prompts per step (runs under 2^24 steps).
    Refill round r draws as step + r * 2^20 would: no other round's or step's streams in runs under 2^20 steps."""
    return ((run_seed * 2**24 + refill * 2**20 + step) * prompts_per_step + first_prompt) * n


@torch.no_grad()
def sync_check(sampler, model, probe_prompts, max_tokens=4) -> SyncProbe:
    """Sample a short seeded probe from the sampler and score the same tokens with the trainer's model (trl#3189
    is the failure it catches; plumbing/sync.py:check_sync judges it). Four tokens a prompt: each decode step
    reads all the sampler's weights, and a sampler on other weights is off from the first token."""
    completions = [group[0] for group in sampler.generate(probe_prompts, n=1, max_tokens=max_tokens, seed=1234)]
    input_ids, attention_mask, completion_mask = pad_batch(probe_prompts, [c.token_ids for c in completions], 0)
    device = next(model.parameters()).device
    logp = sequence_logprobs(model, input_ids.to(device), attention_mask.to(device),
                             completion_mask.shape[1]).float().cpu()  # (B, K), temperature 1 as sampled
    sampler_logp = torch.zeros_like(logp)  # (B, K)
    for i, c in enumerate(completions):
        sampler_logp[i, :len(c.logprobs)] = torch.tensor(c.logprobs)
    return SyncProbe([c.token_ids for c in completions], sampler_logp, logp, completion_mask.float())
