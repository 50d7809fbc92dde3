"""Evaluation: greedy pass@1 (Sections 5-6, Tables 2 and 5), sampled mean@K and pass@k; departures: docs/eval.md.

python eval.py --model smollm2-135m --task arith --limit 100 --samples 8
"""

import hashlib
import importlib.util
import math
import os
import signal
import statistics
import sys

import torch
from tqdm import tqdm
from transformers import AutoConfig

from plumbing import models
from plumbing.checkpoint import CheckpointError, safe_load
from plumbing.cli import OneLineParser, first_line, flag, number, unused_flag_error
from plumbing.data import data_file_error
from plumbing.files import write_error, write_json
from plumbing.parallel import gather_rows
from rewards import reward_model_error, reward_model_flag_error, reward_options, term_rewards
from rollout import EVAL_TURN_STREAMS, MAX_REFILLS, ToolSampler, make_sampler, sampling_memory_error
from tasks import REWARD_TERMS, DataError, encode_prompts, get_task, reward_weights


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (arXiv 2107.03374): 1 - C(n - c, k) / C(n, k)."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def sampled_scores(rewards: list[list[float]], passes: list[list[bool]] | None) -> dict:
    """mean@K with a 95% normal interval over prompts; given passes, pass@k for k = 1, 2, 4, ..., K."""
    if not (n := len(rewards)) or not (K := len(rewards[0])):
        return {}
    per_prompt = [statistics.fmean(row) for row in rewards]
    score = statistics.fmean(per_prompt)
    spread = 0.0  # one prompt: no spread to estimate
    if n > 1:
        spread = statistics.stdev(per_prompt)  # the sample std over prompts
    half = 1.96 * spread / math.sqrt(n)
    out = {f"mean@{K}": score, f"mean@{K}_ci95_low": score - half, f"mean@{K}_ci95_high": score + half}
    if passes is not None:
        ks = sorted({2**i for i in range(K.bit_length())} | {K})
        out["pass@k"] = {str(k): sum(pass_at_k(K, sum(p), k) for p in passes) / n for k in ks}
    return out


def eval_seed(run_seed: int, step: int) -> int:
    """First sample stream of the evaluation at `step`: 36 hash bits x 2^22 stays under 2^64."""
    digest = hashlib.sha256(f"{run_seed}:{step}".encode()).digest()
    return (int.from_bytes(digest[:8], "big") >> 28) * 2**22


def evaluate(
    sampler,
    task,
    examples,
    *,
    samples=0,
    max_tokens=256,
    batch_size=64,
    seed=0,
    reward_kind="exact",
    weights=None,
    temperature=1.0,
    top_p=1.0,
    first=0,
    progress=True,
    options=None,
) -> dict:
    """Greedy pass@1, K samples each; examples[i]'s sample k on stream seed + (first + i) * K + k, so shards agree."""
    if reward_kind == "exact" and not task.has_verifier and weights is None:
        print(
            f"note: task {task.name} has no verifier: reporting the similarity reward "
            "(the paper's LLM-judge scores: --judge-url, --judge-model)"
        )
        reward_kind = "sim"
    weighted = weights is not None
    weights = weights or {reward_kind: 1.0}
    options = options or reward_options(max_tokens)

    def scored(completion, terms) -> dict:
        """What a record keeps of one completion, given its reward terms."""
        return {
            "completion": completion.text,
            "reward": sum(weight * terms[term] for term, weight in weights.items()),  # r = sum_k w_k r_k
            "length": len(completion.token_ids),
            "finish_reason": completion.finish_reason,
            "passed": terms.get("exact", 0.0) >= 0.5,  # the verifier's; False without one
        }

    records = []  # every prompt is chat text: the row gate (plumbing/data.py: check_rows) saw to it
    for start in tqdm(
        range(0, len(examples), batch_size), desc=f"eval {task.name}", unit="batch", disable=not progress
    ):
        batch = examples[start : start + batch_size]
        prompt_ids = encode_prompts(sampler.tokenizer, batch)
        greedy = sampler.generate(prompt_ids, n=1, max_tokens=max_tokens, temperature=0.0)
        sampled = [[]] * len(batch)
        if samples > 0:
            stream = seed + (first + start) * samples  # a prompt's streams hang on its index: shards agree
            sampled = sampler.generate(
                prompt_ids, n=samples, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=stream
            )
        # every completion of the batch scored at once: a reward model's forward takes them together
        per_example = 1 + len(sampled[0])  # the greedy completion, then the samples
        completions = [c for (best,), group in zip(greedy, sampled) for c in (best, *group)]
        scored_examples = [ex for ex in batch for _ in range(per_example)]
        columns = [term_rewards(task, term, scored_examples, completions, options) for term in weights]
        terms = [dict(zip(weights, values)) for values in zip(*columns)]
        replies = [scored(c, t) for c, t in zip(completions, terms)]
        for at in range(0, len(completions), per_example):  # an example's greedy completion's place
            ex = scored_examples[at]
            record = {"uid": ex.uid, "prompt": ex.prompt, "gold": ex.gold, "reference": ex.reference, **replies[at]}
            record["answer"] = task.extract(completions[at].text)
            if weighted:
                record["terms"] = terms[at]
            if samples > 0:
                group = replies[at + 1 : at + per_example]
                record["sampled_rewards"] = [r["reward"] for r in group]
                record["samples"] = group
            records.append(record)

    rewards = [r["reward"] for r in records]
    kind = "weighted" if weighted else reward_kind
    summary = {
        "task": task.name,
        "n": len(records),
        "reward_kind": kind,
        "len_mean": mean([r["length"] for r in records]),
        "trunc_frac": mean([r["finish_reason"] == "length" for r in records]),
    }
    if "exact" in weights:
        summary["pass@1"] = mean([r["passed"] for r in records])  # Table 2
    elif not weighted:
        summary["sim_reward"] = mean(rewards)
    if weighted:
        summary["reward/mean"] = mean(rewards)
        summary.update({f"reward/{term}": mean([r["terms"][term] for r in records]) for term in weights})
    if samples > 0:
        sampled_rewards = [r["sampled_rewards"] for r in records]
        summary.update(temperature=temperature, top_p=top_p)
        summary["sampled_reward_mean"] = mean([x for row in sampled_rewards for x in row])
        sampled_passes = None  # pass@k needs the verifier
        if "exact" in weights:
            sampled_passes = [[sample["passed"] for sample in r["samples"]] for r in records]
        summary.update(sampled_scores(sampled_rewards, sampled_passes))
    return {"summary": summary, "examples": records}


def mean(values) -> float:
    return sum(values) / len(values) if values else 0.0


def gather_samples(records: list[dict], field: str, size: int, K: int, device) -> torch.Tensor:
    """(n, K) float64: `field` of every rank's samples, in rank order."""
    rows = [[sample[field] for sample in r["samples"]] for r in records]
    rows += [[math.nan] * K] * (size - len(records))  # every rank sends `size` rows: NaN rows pad
    table = gather_rows(torch.tensor(rows, dtype=torch.float64), device)  # (world * size, K)
    real = ~table[:, 0].isnan()  # a rank's padding rows
    return table[real]


def load_sampler(args, examples):
    """rollout.py's sampler, its context sized for the longest prompt plus --max-tokens."""
    backend = args.sampler
    if backend is None:  # vLLM where it can run: it samples much faster than HF
        backend = "vllm" if torch.cuda.is_available() and importlib.util.find_spec("vllm") else "hf"
    try:
        path = models.resolve_model(args.model)
        tokenizer = models.load_tokenizer(path)  # first: its ModelLoadError names what is wrong with the folder
        config = AutoConfig.from_pretrained(path)
        context = getattr(config, "max_position_embeddings", None)  # vLLM needs it up front
        prompts = encode_prompts(tokenizer, examples, args.max_tokens, context)
        longest = max(map(len, prompts), default=0)
        at_once = min(len(prompts), args.batch_size) * max(args.samples, 1)  # sequences a batch samples at once
        kept = len(prompts) * (args.samples + 1)
        lower = "--samples, --limit or --batch-size"
        hf = backend == "hf"
        device = torch.device("cpu")
        error = sampling_memory_error(
            config,
            at_once,
            kept,
            longest,
            max_tokens=args.max_tokens,
            dtype="bfloat16",
            hf=hf,
            device=device,
            lower=lower,
        )
        if error:
            raise models.SamplingError(error)  # said before the model loads, not as an out-of-memory error later
        dtype = "bfloat16" if hf else "auto"
        return make_sampler(backend, path, dtype=dtype, seed=args.seed, max_model_len=longest + args.max_tokens)
    except (models.ModelLoadError, DataError):
        raise  # already one line
    except (OSError, ValueError) as err:
        raise models.ModelLoadError(f"cannot use model {args.model!r}: {first_line(err, limit=None)}") from None


def format_summary(summary: dict) -> str:
    """One line per entry: shares in percent, other floats to 4 digits."""
    names = {"pass@1": "pass@1 (greedy)"}
    shown = {names.get(key, key): value for key, value in summary.items() if key != "pass@k"}
    for k, value in summary.get("pass@k", {}).items():
        shown[f"pass@{k} (sampled)"] = value
    return "\n".join(f"{key:<24}{_shown(key, value)}" for key, value in shown.items())


def _shown(key: str, value) -> str:
    if key.startswith(("pass@", "trunc_frac")):
        return f"{100 * value:.1f}%"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


SEED_LIMIT = 2**32  # np.random.seed and vLLM's seed take 32 bits
SAMPLING_RULES = [  # (flags, valid, what valid means); NaN breaks each
    (
        "temperature eval_temperature",
        lambda v: 1e-3 <= v < math.inf,
        "finite and >= 0.001 (below it logits / T overflow; a small --top-p samples near-greedily)",
    ),
    ("top_p eval_top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("top_k", lambda v: isinstance(v, int) and v >= 0, "an integer >= 0"),
    ("min_p", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("max_tokens", lambda v: 1 <= v <= 2**24, f">= 1 and at most {2**24:,}"),  # 2^24: beyond any model's context
    ("seed", lambda v: v >= 0, ">= 0"),
]
EVAL_RULES = [
    ("limit batch_size", lambda v: v >= 1, ">= 1"),
    ("samples", lambda v: v >= 0, ">= 0"),
    ("max_tool_calls", lambda v: 0 <= v <= MAX_REFILLS, f"in [0, {MAX_REFILLS}]"),  # as train.py's
    ("seed", lambda v: v < SEED_LIMIT, f"at most {SEED_LIMIT - 1:,} (the sampler's seed takes 32 bits)"),
]


def number_error(args, rules) -> str | None:
    """The first number flag of `args` that breaks its rule, as one line, or None (NaN breaks each rule)."""
    for names, valid, means in rules:
        for name in names.split():
            value = vars(args).get(name)
            if value is not None and not valid(value):
                return f"{flag(name)} must be {means}, got {value:,}"
    return None


def demo_file_error(task, demo_file: str | None, sim: bool) -> str | None:
    """Why --demo-file would go unread, or None: the one rule eval.py's main and config.reward_error both read."""
    if demo_file and task.demos is None:
        return (
            f"--demo-file: {task.name} takes no --demo-file (its demonstrations are its own; a 'reference' "
            "column in --data-file replaces them)"
        )
    if demo_file and not sim:
        return "--demo-file is read only when the reward uses sim (--reward sim, or a sim term in --reward-weights)"
    return None


# Flags read only when another is set (config.py holds train.py's table); their default, 1.0, is filled after the check
UNUSED_WITHOUT = {"temperature": "samples", "top_p": "samples"}


def out_error(args) -> str | None:
    """The line for an --out that names one of the run's inputs, which writing the result would replace, or None."""
    data_file = args.data_file and args.data_file.replace("{split}", args.split)
    inputs = {os.path.realpath(path) for path in (data_file, args.demo_file) if path}
    if os.path.realpath(args.out) in inputs:
        return f"--out {args.out} is an input of this run (--data-file or --demo-file): writing it would replace it"
    return None


def parse_args(argv=None):
    from tools import judge  # never imported by train.py

    parser = OneLineParser("eval.py", description="Greedy pass@1 and sampled pass@k of a model on a task.")
    add = parser.add_argument
    add("--model", required=True, help="HF folder, hub id, checkpoint folder or alias")
    add("--task", required=True, help="task name (see tasks.py)")
    add("--split", default="test", choices=["train", "test"])
    add("--limit", type=int, default=None, help="evaluate the first N examples")
    add("--samples", type=int, default=0, help="K samples per prompt for pass@k (0: greedy only)")
    add("--temperature", type=number, default=None, help="sampling temperature for pass@k (default 1.0)")
    add("--top-p", type=number, default=None, help="nucleus sampling for pass@k and mean@K (default 1.0)")
    add("--max-tokens", type=int, default=256)
    add("--max-tool-calls", type=int, default=0, help="tool calls a completion may make, as train.py --rollout tools")
    add("--batch-size", type=int, default=64)
    add("--reward", default="exact", choices=("exact", *REWARD_TERMS), help="verifier, or a term")
    add("--reward-weights", default="", help="reward terms as train.py takes them: exact=1,format=0.1")
    add("--reward-model", default="", help="the rm term's model, as train.py takes it")
    add("--sampler", default=None, choices=["hf", "vllm"], help="default: vllm on a GPU, else hf")
    add("--data-file", default=None, help="local data file for the task (passed to task.load)")
    add("--demo-file", default=None, help="countdown --reward sim: local Countdown-Task-GOLD demonstrations file")
    add("--seed", type=int, default=0)
    add("--out", default=None, help="JSON path (default: <model dir or .>/eval_<task>_<split>.json)")
    judge.add_judge_args(parser)
    args = parser.parse_args(argv)
    # None marks a sampling flag the command line left out: given without --samples, it would go unread
    given = [name for name in UNUSED_WITHOUT if getattr(args, name) is not None]
    for name in UNUSED_WITHOUT:
        if getattr(args, name) is None:
            setattr(args, name, 1.0)
    folder = args.model if os.path.isdir(args.model) else "."  # a checkpoint keeps its own evaluations
    args.out = args.out or os.path.join(folder, f"eval_{args.task}_{args.split}.json")
    if error := (
        judge.judge_args_error(args)
        or number_error(args, SAMPLING_RULES + EVAL_RULES)
        or (args.data_file and data_file_error(args.data_file, splits=(args.split,)))
        or write_error(args.out, "--out")
        or out_error(args)
        or unused_flag_error(given, vars(args), UNUSED_WITHOUT)
    ):
        parser.error(error)
    return args


def main(argv=None) -> dict:
    """Errors are one line: exit 2 for a bad input, 1 for a failing judge or disk."""
    from tools import judge

    bad_input = (ValueError, models.ModelLoadError, models.SamplingError, CheckpointError)  # exit 2
    args = parse_args(argv)
    out = args.out
    partial = out + ".partial"  # tools/judge.py's verdicts so far: an interrupted judging resumes from them
    try:
        task = get_task(args.task)
        weights = None  # None: the one --reward term, reported unweighted
        if args.reward_weights:
            weights = reward_weights(task, args.reward, args.reward_weights)
        terms = weights or {args.reward: 1}
        sim = "sim" in terms
        error = demo_file_error(task, args.demo_file, sim) or reward_model_flag_error(args.reward_model, terms)
        if error or args.reward_model and (error := reward_model_error(args.reward_model)):
            raise ValueError(error)
        if args.split == "train" and task.held_out_only:  # a benchmark has no train split to score
            raise DataError(f"{task.name} is a held-out benchmark: score its test split (--split test)")
        examples = task.load(
            args.split, data_file=args.data_file, limit=args.limit, seed=args.seed, demos=sim, demo_file=args.demo_file
        )
        if error := models.model_error(args.model):  # the context's room: load_sampler, from the model's config
            raise models.ModelLoadError(error)
        if not examples:
            raise DataError(
                f"no {args.split} rows to evaluate in {args.data_file or task.name} (tasks.py holds out "
                "~10% by prompt hash; a {split} file holds one split): nothing is scored"
            )
        judges = judge.connect_judges(args) if args.judge_url else []
        sampler = load_sampler(args, examples)
        try:
            step = 0  # a checkpoint's step seeds the samples, as train.py's evaluation at that step
            if os.path.isfile(os.path.join(args.model, "trainer_state.pt")):
                state = safe_load(args.model, "trainer_state.pt")
                step = int(state.get("step", 0)) if isinstance(state, dict) else 0  # a foreign file: step 0
            seed = eval_seed(args.seed, step)
            calling = sampler
            if args.max_tool_calls:  # completions may call rollout.TOOLS
                calling = ToolSampler(sampler, args.max_tool_calls, EVAL_TURN_STREAMS)
            result = evaluate(
                calling,
                task,
                examples,
                samples=args.samples,
                max_tokens=args.max_tokens,
                batch_size=args.batch_size,
                seed=seed,
                reward_kind=args.reward,
                weights=weights,
                temperature=args.temperature,
                top_p=args.top_p,
                options=reward_options(args.max_tokens, reward_model=args.reward_model),
            )
        finally:
            sampler.close()
        result["summary"] = {"model": args.model, "split": args.split, **result["summary"]}
        print(format_summary(result["summary"]))  # before judging and writing: a failing judge or disk loses nothing
        if judges:
            judge.judge_result(result, judges, out, save_to=partial, concurrency=args.judge_concurrency)
            print(judge.format_judge_summary(result["judge_summary"]))
        try:  # --out written whole: a WriteError (plumbing/files.py) says the file is as it was
            write_json(out, result, indent=1)
        except OSError as err:
            raise OSError(f"{err} The summary above is the result.") from None
    except KeyboardInterrupt:
        kept = "as it was" if os.path.exists(out) else "not written"
        sys.exit(f"eval.py: interrupted; {out} is {kept}")
    except (*bad_input, OSError, judge.JudgeError) as err:
        print(f"eval.py: error: {err}", file=sys.stderr)
        sys.exit(2 if isinstance(err, bad_input) else 1)
    if os.path.exists(partial):
        os.remove(partial)
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a scheduler's stop: as a Ctrl-C
    main()
