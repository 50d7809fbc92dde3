"""Evaluation: greedy pass@1, the paper's metric (Sections 5-6, Tables 2 and 5), and sampled pass@k.

A model, an alias such as `smollm2-135m`, or a checkpoint folder written by train.py is scored with
the same sampler (rollout.py), chat-template prompts and rewards (tasks.py) as training; train.py's
before/after evaluation calls `evaluate`. The JSON output holds the summary and, for every example,
the prompt, completion, extracted answer and reward. Its location is checked writable before anything
loads; the summary is printed first, then the file is written through a temporary file and a rename, so
a full disk never truncates an earlier result.

    python eval.py --model smollm2-135m --task arith --limit 100
    python eval.py --model runs/arith/checkpoint-50 --task gsm8k --samples 8   # + pass@1,2,4,8
    python eval.py --model runs/countdown/checkpoint-50 --task countdown --reward sim --demo-file gold.parquet
    python eval.py --model runs/poetry/checkpoint-200 --task poetry --data-file poems.jsonl \
        --judge-url http://127.0.0.1:8000/v1 --judge-model Qwen/Qwen3-30B-A3B-Thinking-2507   # Table 4

Departures from the paper:
1. Tasks without a verifier (poetry, meetingbank) report the similarity reward r_sim (Appendix B.5);
   Table 4's LLM-judge scores come from --judge-url/--judge-model (judge.py, any OpenAI-compatible server).
2. pass@k uses the unbiased estimator of Chen et al. (2021, arXiv 2107.03374) over K samples at the
   rollout temperature; a sample passes when its reward is >= 0.5 (verifier rewards are 0 or 1).
"""

import argparse
import importlib.util
import json
import os
import sys
import tempfile

import torch
from tqdm import tqdm

from plumbing.checkpoint import model_file_error
from plumbing.models import ModelLoadError, SamplingError, load_tokenizer
from rollout import make_sampler, resolve_model
from tasks import DataError, get_task

PASS_THRESHOLD = 0.5  # a reward at or above this counts as a pass (verifier rewards are 0 or 1)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c passes: 1 - C(n - c, k) / C(n, k).

    Written as 1 - prod_{i = n-c+1..n} (1 - k / i), which never forms the huge binomials.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset contains a pass
        return 1.0
    fail = 1.0
    for i in range(n - c + 1, n + 1):
        fail *= 1.0 - k / i
    return 1.0 - fail


def encode_prompts(tokenizer, examples, max_len: int | None = None) -> list[list[int]]:
    """Chat-template token ids of each example's prompt, ending with the assistant turn's header. With `max_len`
    (the context the model has left beside the completion), a longer prompt is a DataError naming its row."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; use an instruct/chat model")
    ids = [list(tokenizer.apply_chat_template(ex.prompt, add_generation_prompt=True, tokenize=True,
                                              return_dict=False)) for ex in examples]
    too_long = [i for i, p in enumerate(ids) if max_len is not None and len(p) > max_len]
    if too_long:
        i = too_long[0]
        raise DataError(f"row {i} ({getattr(examples[i], 'uid', '')}): its prompt is {len(ids[i])} tokens, more than "
                        f"the {max_len} the model's context leaves beside --max-tokens ({len(too_long)} such rows)")
    return ids


def _valid_prompt(prompt) -> bool:
    return (isinstance(prompt, list) and len(prompt) > 0
            and all(isinstance(m, dict) and m.get("role") and isinstance(m.get("content"), str) for m in prompt)
            and any(m["content"].strip() for m in prompt))


def evaluate(sampler, task, examples, *, samples=0, max_tokens=256, batch_size=64, seed=0,
             reward_kind="exact", temperature=1.0, progress=True) -> dict:
    """Score `examples` with greedy decoding (pass@1) and, if samples = K > 0, K samples each (pass@k).

    Returns {"summary": {...}, "examples": [one record per example]}. reward_kind "exact" uses the
    task's verifier, "sim" the similarity reward; "exact" on a task without a verifier falls back to
    "sim" with a printed note.
    """
    if reward_kind == "exact" and not task.has_verifier:
        print(f"note: task {task.name} has no verifier: reporting the similarity reward "
              "(the paper's LLM-judge scores: --judge-url, --judge-model)")
        reward_kind = "sim"
    kept = [ex for ex in examples if _valid_prompt(ex.prompt)]
    if len(kept) < len(examples):
        print(f"note: skipped {len(examples) - len(kept)} example(s) with an empty or malformed prompt")
    records = []
    batches = range(0, len(kept), batch_size)
    for start in tqdm(batches, desc=f"eval {task.name}", unit="batch", disable=not progress):
        batch = kept[start:start + batch_size]
        prompt_ids = encode_prompts(sampler.tokenizer, batch)
        greedy = sampler.generate(prompt_ids, n=1, max_tokens=max_tokens, temperature=0.0)
        sampled = [[]] * len(batch)
        if samples > 0:
            # seed + (start + i) * K: every (example, sample) stream is distinct across batches too
            sampled = sampler.generate(prompt_ids, n=samples, max_tokens=max_tokens, temperature=temperature,
                                       seed=seed + start * samples)
        for ex, (best,), group in zip(batch, greedy, sampled):
            record = {"uid": ex.uid, "prompt": ex.prompt, "gold": ex.gold, "reference": ex.reference,
                      "completion": best.text,
                      "answer": task.extract(best.text), "reward": task.reward(best.text, ex, kind=reward_kind),
                      "length": len(best.token_ids), "finish_reason": best.finish_reason}
            if samples > 0:
                record["sampled_rewards"] = [task.reward(c.text, ex, kind=reward_kind) for c in group]
            records.append(record)

    n = len(records)
    summary = {"task": task.name, "n": n, "skipped": len(examples) - n, "reward_kind": reward_kind,
               "len_mean": mean([r["length"] for r in records]),
               "trunc_frac": mean([r["finish_reason"] == "length" for r in records])}
    if reward_kind == "exact":
        summary["pass@1"] = mean([r["reward"] >= PASS_THRESHOLD for r in records])  # greedy (Table 2)
    else:
        summary["sim_reward"] = mean([r["reward"] for r in records])
    if samples > 0:
        summary["temperature"] = temperature
        summary["sampled_reward_mean"] = mean([x for r in records for x in r["sampled_rewards"]])
        if reward_kind == "exact":
            ks = sorted({2 ** i for i in range(samples.bit_length()) if 2 ** i <= samples} | {samples})
            passes = [sum(x >= PASS_THRESHOLD for x in r["sampled_rewards"]) for r in records]
            summary["pass@k"] = {str(k): mean([pass_at_k(samples, c, k) for c in passes]) for k in ks}
    return {"summary": summary, "examples": records}


def _first(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0  # an empty evaluation gives zeros, not an error


def format_summary(summary: dict) -> str:
    rows = {("pass@1 (greedy)" if k == "pass@1" else k): v for k, v in summary.items() if k != "pass@k"}
    rows.update({f"pass@{k} (sampled)": v for k, v in summary.get("pass@k", {}).items()})
    shown = {k: f"{100 * v:.1f}%" if k.startswith(("pass@", "trunc_frac"))  # fractions as percentages
             else f"{v:.4g}" if isinstance(v, float) else str(v) for k, v in rows.items()}
    return "\n".join(f"{k:<24}{v}" for k, v in shown.items())


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit status 2, without argparse's usage dump
        print(f"eval.py: error: {message}", file=sys.stderr)
        sys.exit(2)


def parse_args(argv=None):
    from tools import judge  # the LLM judge: loaded by this command line only, never by train.py

    parser = _Parser(description="Greedy pass@1 and sampled pass@k of a model on a task.")
    parser.add_argument("--model", required=True, help="HF folder, hub id, checkpoint folder or alias")
    parser.add_argument("--task", required=True, help="task name (see tasks.py)")
    parser.add_argument("--split", default="test", choices=["train", "test"])
    parser.add_argument("--limit", type=int, default=None, help="evaluate the first N examples")
    parser.add_argument("--samples", type=int, default=0, help="K samples per prompt for pass@k (0: greedy only)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature for pass@k")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--reward", default="exact", choices=["exact", "sim"], help="verifier or similarity")
    parser.add_argument("--sampler", default=None, choices=["hf", "vllm"], help="default: vllm on a GPU, else hf")
    parser.add_argument("--data-file", default=None, help="local data file for the task (passed to task.load)")
    parser.add_argument("--demo-file", default=None, help="countdown --reward sim: a local copy of "
                        "HuggingFaceTB/Countdown-Task-GOLD's demonstrations (same columns), joined to the puzzles")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON path (default: <model dir or .>/eval_<task>_<split>.json)")
    judge.add_judge_args(parser)
    args = parser.parse_args(argv)
    if (error := judge.judge_args_error(args)) or (args.judge_url and args.task not in judge.RUBRICS):
        parser.error(error or f"the LLM judge scores {', '.join(judge.RUBRICS)}, not {args.task}")
    for name in ("limit", "max_tokens", "batch_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.samples < 0 or (args.samples > 0 and not args.temperature > 0):
        parser.error("--samples must be >= 0 and --temperature > 0 when sampling")
    return args


def output_error(out: str) -> str | None:
    """Why the result cannot be written to `out`, as one line, or None: checked before anything loads, by
    creating (and removing) a file beside it, so a read-only folder costs a second, not an evaluation."""
    folder = os.path.dirname(os.path.abspath(out))
    if os.path.isdir(out):
        return f"--out {out} is a folder; pass a file path"
    if not os.path.isdir(folder):
        return f"cannot write {out}: its folder {folder} does not exist (or is a file); pass --out PATH"
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".eval-write-check-")
        os.close(fd)
        os.remove(probe)
    except OSError as err:
        return f"cannot write {out}: {folder} is not writable ({err.strerror}); pass --out PATH"
    return None


def write_json(result: dict, out: str) -> None:
    """`result` into `out` through a temporary file and a rename: a failed write (a full disk) leaves an earlier
    `out` whole and no partial file behind."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(out)), prefix=f".{os.path.basename(out)}.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(result, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        os.remove(tmp)
        raise


def main(argv=None) -> dict:
    from tools import judge

    args = parse_args(argv)
    out = args.out or os.path.join(args.model if os.path.isdir(args.model) else ".",
                                   f"eval_{args.task}_{args.split}.json")  # by default beside the model
    if error := output_error(out) or (os.path.isdir(args.model) and model_file_error(args.model)):
        print(f"eval.py: error: {error}", file=sys.stderr)
        sys.exit(2)
    try:
        task = get_task(args.task)
        examples = task.load(args.split, data_file=args.data_file, limit=args.limit, seed=args.seed,
                             demos=args.reward == "sim", demo_file=args.demo_file)  # countdown: joined (tasks.py)
    except (ValueError, DataError) as err:
        print(f"eval.py: error: {err}", file=sys.stderr)
        sys.exit(2)
    try:  # before the model loads and generates: an unreachable judge should cost seconds, not a run
        judges = judge.connect_judges(args) if args.judge_url else []
    except judge.JudgeError as err:
        print(f"eval.py: error: {err}", file=sys.stderr)
        sys.exit(1)
    backend = args.sampler
    if backend is None:
        backend = "vllm" if torch.cuda.is_available() and importlib.util.find_spec("vllm") else "hf"
    try:
        path = resolve_model(args.model)
        # vLLM needs the context length up front: long-context tasks (meetingbank) exceed its default
        prompts = encode_prompts(load_tokenizer(path), [e for e in examples if _valid_prompt(e.prompt)])
        sampler = make_sampler(backend, path, dtype="bfloat16" if backend == "hf" else "auto", seed=args.seed,
                               max_model_len=max(map(len, prompts), default=0) + args.max_tokens)
    except ModelLoadError as err:  # already one line naming the model, --model and HF_HUB_OFFLINE
        print(f"eval.py: error: {err}", file=sys.stderr)
        sys.exit(2)
    except (OSError, ValueError) as err:
        print(f"eval.py: error: cannot use model {args.model!r}: {str(err).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)
    try:
        result = evaluate(sampler, task, examples, samples=args.samples, max_tokens=args.max_tokens,
                          batch_size=args.batch_size, seed=args.seed, reward_kind=args.reward,
                          temperature=args.temperature)
    except (DataError, SamplingError) as err:  # --reward sim on a task without demonstrations; NaN weights
        print(f"eval.py: error: {err}", file=sys.stderr)
        sys.exit(2)
    finally:
        sampler.close()
    result["summary"] = {"model": args.model, "split": args.split, **result["summary"]}
    if judges:  # reuses the judgments an earlier run left in `out`, and saves new ones there as they come
        try:
            judge.judge_result(result, judges, out, concurrency=args.judge_concurrency)
        except judge.JudgeError as err:
            print(f"eval.py: error: {err}", file=sys.stderr)
            sys.exit(1)
    print(format_summary(result["summary"]))  # first: the result is never only on a disk that failed
    if judges:
        print(judge.format_judge_summary(result["judge_summary"]))
    try:
        write_json(result, out)
    except OSError as err:
        kept = f"; the earlier {out} is intact" if os.path.exists(out) else ""
        print(f"eval.py: error: cannot write {out} ({err.strerror or _first(err)}): the summary above is the "
              f"result{kept}", file=sys.stderr)
        sys.exit(1)
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
