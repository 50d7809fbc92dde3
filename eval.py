"""Evaluation: greedy pass@1, the paper's metric (Sections 5-6, Tables 2 and 5), and sampled pass@k.

A model, an alias (`smollm2-135m`) or a train.py checkpoint is scored with training's sampler, prompts and rewards
(--reward-weights as in train.py, a fork's terms too); train.py's evaluations call `evaluate`. The JSON output is
written whole once the result, judgments included, is ready: a failure never costs an earlier result.

    python eval.py --model smollm2-135m --task arith --limit 100
    python eval.py --model runs/arith/checkpoint-50 --task gsm8k --samples 8   # + pass@1,2,4,8
    python eval.py --model runs/countdown/checkpoint-50 --task countdown --reward sim --demo-file gold.parquet
    python eval.py --model runs/poetry/checkpoint-200 --task poetry --data-file poems.jsonl \
        --judge-url http://127.0.0.1:8000/v1 --judge-model Qwen/Qwen3-30B-A3B-Thinking-2507   # Table 4

Departures from the paper:
1. Tasks without a verifier (poetry, meetingbank) report r_sim (B.5); Table 4's judge scores: --judge-url (judge.py).
2. pass@k: Chen et al.'s unbiased estimator (arXiv 2107.03374) over K samples; a pass is a reward >= 0.5.
3. Sampled scores (`sampled_scores`, shared with train.py's --eval-samples): mean@K, the mean reward of the K samples
   (for a verifier, the pass rate), with a 95% normal interval over prompts; sample k of example j draws stream
   eval_seed(--seed, step) + j * K + k, where step is a train.py checkpoint's own step (0 for any other model):
   eval.py on checkpoint-N scores what train.py's evaluation at step N scored, sample for sample (docs/eval.md).
"""

import hashlib
import math
import os
import sys

from tqdm import tqdm

from plumbing import checks
from plumbing.cli import OneLineParser
from plumbing.eval_cli import add_eval_args, checkpoint_step, format_summary, load_sampler, write_result
from plumbing.files import write_error
from plumbing.models import ModelLoadError, SamplingError
from plumbing.prompts import encode_prompts, valid_prompt
from rewards import declared_lengths
from rollout import make_sampler
from tasks import REWARD_TERMS, DataError, get_task, reward_weights

PASS_THRESHOLD = 0.5  # a reward at or above this counts as a pass (verifier rewards are 0 or 1)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c passes: 1 - C(n - c, k) / C(n, k), written as
    1 - prod_{i = n-c+1..n} (1 - k / i), which never forms the huge binomials."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset contains a pass
        return 1.0
    fail = 1.0
    for i in range(n - c + 1, n + 1):
        fail *= 1.0 - k / i
    return 1.0 - fail


def sampled_scores(rewards: list[list[float]], passes: list[list[bool]] | None) -> dict:
    """The scores of K samples per prompt (train.py and eval.py both report these): mean@K, the mean reward over
    every sample, with the 95% interval of that mean over prompts (mean +- 1.96 s / sqrt(n), s the standard deviation
    of the per-prompt means; one prompt gives no spread), and, given passes, pass@k for k = 1, 2, 4, ... and K."""
    n, K = len(rewards), len(rewards[0]) if rewards else 0
    if n == 0 or K == 0:
        return {}
    per_prompt = [sum(row) / K for row in rewards]  # each prompt's mean@K
    score = sum(per_prompt) / n
    spread = math.sqrt(sum((m - score) ** 2 for m in per_prompt) / (n - 1)) if n > 1 else 0.0
    half = 1.96 * spread / math.sqrt(n)  # normal approximation over prompts
    out = {f"mean@{K}": score, f"mean@{K}_ci95_low": score - half, f"mean@{K}_ci95_high": score + half}
    if passes is not None:
        ks = sorted({2 ** i for i in range(K.bit_length()) if 2 ** i <= K} | {K})
        out["pass@k"] = {str(k): sum(pass_at_k(K, sum(p), k) for p in passes) / n for k in ks}
    return out


def eval_seed(run_seed: int, step: int) -> int:
    """The first sample stream of the sampled evaluation at training step `step`: sample k of example j draws
    stream eval_seed + j * K + k, so a resumed run, another world size, and eval.py on that step's checkpoint draw
    the same samples. 36 bits of a hash of (run seed, step), times 2^22 samples an evaluation: under 2^58 for any
    seed and step, where (seed * 2^20 + step) * 2^22 passed torch's 2^64 from seed 2^22."""
    digest = hashlib.sha256(f"{run_seed}:{step}".encode()).digest()
    return (int.from_bytes(digest[:8], "big") >> 28) * 2**22


def evaluate(sampler, task, examples, *, samples=0, max_tokens=256, batch_size=64, seed=0,
             reward_kind="exact", weights=None, temperature=1.0, top_p=1.0, first=0, progress=True) -> dict:
    """Score `examples` with greedy decoding (pass@1) and, if samples = K > 0, K samples each (mean@K, pass@k).
    Sample k of examples[i] draws stream seed + (first + i) * K + k: `first`, the index of examples[0] in the
    whole set, lets a shard of it draw what one process draws.

    Returns {"summary": {...}, "examples": [one record per example]}. reward_kind "exact" uses the task's verifier,
    "sim" the similarity reward ("exact" without a verifier falls back to "sim", with a note). `weights` ({term:
    weight}, tasks.reward_weights) scores r = sum_k w_k r_k instead, as train.py does, with each term (reward/TERM).
    """
    if reward_kind == "exact" and not task.has_verifier and weights is None:
        print(f"note: task {task.name} has no verifier: reporting the similarity reward "
              "(the paper's LLM-judge scores: --judge-url, --judge-model)")
        reward_kind = "sim"
    weighted, weights = weights is not None, weights or {reward_kind: 1.0}

    limits = dict(max_tokens=max_tokens, overlong_buffer=max(1, max_tokens // 5))  # as train.py's default

    def score(completion, example) -> tuple[float, dict]:  # (r = sum_k w_k r_k, {term: r_k})
        terms = {term: task.reward(completion.text, example, kind=term, **declared_lengths(
            term, n_tokens=len(completion.token_ids), **limits)) for term in weights}
        return sum(weight * terms[term] for term, weight in weights.items()), terms

    kept = [ex for ex in examples if valid_prompt(ex.prompt)]
    if len(kept) < len(examples):
        print(f"note: skipped {len(examples) - len(kept)} example(s) with an empty or malformed prompt")
    records, passes = [], []  # passes: of each example, whether its greedy and each sampled completion pass
    for start in tqdm(range(0, len(kept), batch_size), desc=f"eval {task.name}", unit="batch", disable=not progress):
        batch = kept[start:start + batch_size]
        prompt_ids = encode_prompts(sampler.tokenizer, batch)
        greedy = sampler.generate(prompt_ids, n=1, max_tokens=max_tokens, temperature=0.0)
        # seed + (first + start + i) * K + k: every (example, sample) stream is distinct across batches and shards
        sampled = sampler.generate(prompt_ids, n=samples, max_tokens=max_tokens, temperature=temperature,
                                   top_p=top_p, seed=seed + (first + start) * samples) if samples > 0 else [
            [] for _ in batch]
        for ex, (best,), group in zip(batch, greedy, sampled):
            (reward, terms), scored = score(best, ex), [score(c, ex) for c in group]
            records.append({"uid": ex.uid, "prompt": ex.prompt, "gold": ex.gold, "reference": ex.reference,
                            "completion": best.text, "answer": task.extract(best.text), "reward": reward,
                            "length": len(best.token_ids), "finish_reason": best.finish_reason,
                            **({"terms": terms} if weighted else {}),
                            **({"sampled_rewards": [r for r, _ in scored],
                                "samples": [{"completion": c.text, "reward": r, "length": len(c.token_ids),
                                             "finish_reason": c.finish_reason,
                                             "passed": t.get("exact", 0.0) >= PASS_THRESHOLD}
                                            for c, (r, t) in zip(group, scored)]}
                               if samples > 0 else {})})
            passes.append([t.get("exact", 0.0) >= PASS_THRESHOLD for _, t in [(reward, terms), *scored]])

    n = len(records)
    summary = {"task": task.name, "n": n, "skipped": len(examples) - n,
               "reward_kind": "weighted" if weighted else reward_kind,
               "len_mean": mean([r["length"] for r in records]),
               "trunc_frac": mean([r["finish_reason"] == "length" for r in records])}
    if "exact" in weights:
        summary["pass@1"] = mean([p[0] for p in passes])  # greedy (Table 2)
    elif not weighted:
        summary["sim_reward"] = mean([r["reward"] for r in records])
    if weighted:  # r = sum_k w_k r_k, and each term r_k
        summary["reward/mean"] = mean([r["reward"] for r in records])
        summary.update({f"reward/{term}": mean([r["terms"][term] for r in records]) for term in weights})
    if samples > 0:
        summary.update(temperature=temperature, top_p=top_p)
        summary["sampled_reward_mean"] = mean([x for r in records for x in r["sampled_rewards"]])
        summary.update(sampled_scores([r["sampled_rewards"] for r in records],
                                      [p[1:] for p in passes] if "exact" in weights else None))
    return {"summary": summary, "examples": records}


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0  # an empty evaluation gives zeros, not an error


def parse_args(argv=None):
    from tools import judge  # the LLM judge: loaded by this command line only, never by train.py

    parser = OneLineParser("eval.py", description="Greedy pass@1 and sampled pass@k of a model on a task.")
    add_eval_args(parser, reward_choices=("exact", *REWARD_TERMS))
    judge.add_judge_args(parser)
    args = parser.parse_args(argv)
    if error := judge.judge_args_error(args) or checks.eval_flag_error(args):  # as train.py's, where both take one
        parser.error(error)
    args.out = args.out or os.path.join(args.model if os.path.isdir(args.model) else ".",
                                        f"eval_{args.task}_{args.split}.json")  # by default beside the model
    # before anything loads: an unwritable --out costs a second, not an evaluation (the model: main, before it loads)
    if error := write_error(args.out, "--out"):
        parser.error(error)
    return args


def main(argv=None) -> dict:
    """Every error is one line, `eval.py: error: ...`: exit status 2 for a bad input, 1 for a failing judge or disk."""
    from tools import judge

    bad_input = (ValueError, ModelLoadError, SamplingError)  # exit 2 (a DataError is a ValueError)
    args = parse_args(argv)
    out, partial = args.out, args.out + ".partial"  # the judgments so far: --out changes only once all are in
    try:
        task = get_task(args.task)
        weights = reward_weights(task, args.reward, args.reward_weights) if args.reward_weights else None
        examples = task.load(args.split, data_file=args.data_file, limit=args.limit, seed=args.seed,
                             demos="sim" in (weights or {args.reward: 1}), demo_file=args.demo_file)  # joined
        if error := checks.model_flag_error(args):  # before the judge and the model: a hub id with no hub, ...
            raise ModelLoadError(error)
        if not examples:  # a pass@1 of 0.0 over no rows would read as a result
            raise DataError(f"no {args.split} rows to evaluate in {args.data_file or task.name} (tasks.py holds out "
                            "~10% by prompt hash; a {split} file holds one split): nothing is scored")
        # before the model loads and generates: an unreachable judge should cost seconds, not a run
        judges = judge.connect_judges(args) if args.judge_url else []
        sampler = load_sampler(args, examples, make_sampler)  # rollout.py's, sized for these prompts
        try:  # DataError: --reward sim on a task without demonstrations; SamplingError: NaN weights
            result = evaluate(sampler, task, examples, samples=args.samples, max_tokens=args.max_tokens,
                              batch_size=args.batch_size, seed=eval_seed(args.seed, checkpoint_step(args.model)),
                              reward_kind=args.reward, weights=weights, temperature=args.temperature,
                              top_p=args.top_p)
        finally:
            sampler.close()
        result["summary"] = {"model": args.model, "split": args.split, **result["summary"]}
        if judges:  # reuses the judgments an earlier run left in `out` or `partial`; saves new ones in `partial`
            judge.judge_result(result, judges, out, save_to=partial, concurrency=args.judge_concurrency)
        print(format_summary(result["summary"]))  # first: the result is never only on a disk that failed
        if judges:
            print(judge.format_judge_summary(result["judge_summary"]))
        write_result(out, result)
    except KeyboardInterrupt:  # Ctrl-C: --out is written whole or not at all; judgments so far stay in `partial`
        sys.exit(f"eval.py: interrupted; {out} is {'as it was' if os.path.exists(out) else 'not written'}")
    except (*bad_input, OSError, judge.JudgeError) as err:
        print(f"eval.py: error: {err}", file=sys.stderr)
        sys.exit(2 if isinstance(err, bad_input) else 1)
    if os.path.exists(partial):
        os.remove(partial)
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
