"""Side by side with Hugging Face TRL's GRPOTrainer: seconds per step, training tokens/s, peak memory.

Both sides do the same work on this machine, each in a fresh process (honest peak resident memory):
the embedded SmolLM2-135M-Instruct, the `arith` task's prompts in train.py's order (written once to a
JSONL both sides check they received), M = 8 completions for each of 4 prompts per step, at most 64
new tokens, temperature 1, micro-batches of 8 sequences, one optimizer step (AdamW, lr 2e-5, weight
decay 0.01, grad clip 1.0) and one PPO epoch per step, clip [0.2, 0.28], k3 KL with beta 1e-3,
token-mean loss, float32 master weights under bfloat16 autocast, Hugging Face generation (no vLLM).
Our side is train.py's main() (bench/ours_step.py); TRL's side is trl==1.16.0 in `.venv-trl`
(bench/trl_grpo.py), which this script creates on first use with `pip install --no-deps` over this
environment's torch and transformers, so neither side gets a different torch.

    python bench/vs_trl.py                                   # 3 repeats x 4 steps per side (~15 min)
    python bench/vs_trl.py --repeats 5 --steps 5
    python bench/vs_trl.py --compile                         # our side with train.py --compile
    python bench/vs_trl.py --model /tmp/tiny --steps 2 --warmup 1 --repeats 1 --max-tokens 8   # smoke

The first --warmup steps of every run (default 1) are excluded: they pay one-off costs (allocator
growth, first-call dispatch) that a long run does not. The sides alternate which goes first in each
repeat. Reported per side (median [min-max] over repeats): seconds per step split into generation,
reward and training (training = the rest of the step: reference forward, forward/backward, optimizer,
and on our side the weight copy into the sampler), training tokens/s (non-pad prompt + completion
tokens / training seconds), end-to-end tokens/s, peak RSS, mean response length; then the per-repeat
ratios ours/TRL. The sides sample different completions (different samplers), so the mean response
length is printed next to the times. Raw results go to --out.
"""

import argparse
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
TRL_PIN = "trl==1.16.0"
TARGETS = {"step_s": ("<=", 0.35), "peak_rss_gb": ("<=", 1.0)}  # ours / TRL: the targets docs/vs_trl.md reports against


def trl_python(venv: str) -> str:
    """The TRL venv's python, creating the venv if needed; torch/transformers stay this environment's."""
    python = os.path.join(venv, "bin", "python")
    probe = "import trl, torch, transformers; print(trl.__version__, torch.__version__, transformers.__version__)"
    version = importlib.metadata.version
    want = f"{TRL_PIN.split('==')[1]} {version('torch')} {version('transformers')}"
    ok = os.path.exists(python) and subprocess.run([python, "-c", probe], capture_output=True, text=True).stdout.strip()
    if ok == want:
        return python
    t0 = time.perf_counter()
    print(f"creating {venv} ({TRL_PIN} over this environment's packages) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", venv], check=True)
    pip = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, "--no-deps", TRL_PIN], check=True)  # --no-deps: never replace torch/transformers
    missing = subprocess.run(
        [
            python,
            "-c",
            (
                "import importlib.metadata as md, re\n"
                "for req in md.requires('trl') or []:\n"
                "    if 'extra ==' in req: continue\n"
                "    name = re.match(r'[A-Za-z0-9_.-]+', req).group(0)\n"
                "    try: md.version(name)\n"
                "    except md.PackageNotFoundError: print(req.split(';')[0].strip())\n"
            ),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    if missing:  # pinned to what we already have, so pip cannot swap them while resolving the rest
        pins = [f"{name}=={version(name)}" for name in ("torch", "transformers")]
        subprocess.run([*pip, *missing, *pins], check=True)
    got = subprocess.run([python, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    if got != want:
        raise SystemExit(f"vs_trl.py: {venv} has trl/torch/transformers {got}, expected {want}")
    print(f"{venv} ready in {time.perf_counter() - t0:.0f} s (trl, torch, transformers: {got})", flush=True)
    return python


def load_note() -> str:
    """The 1-minute load average before the runs, with a warning when other work shares the CPUs (timings then
    mean little: each parallel op waits for a descheduled thread; measured here, 8 ms per elementwise op at load 6)."""
    load = os.getloadavg()[0]
    warning = f" -- NOT QUIET ({os.cpu_count()} CPUs): timings are unreliable" if load > 0.5 else ""
    return f"load average {load:.2f}{warning}"


def write_prompts(path: str, task_name: str, model_path: str, n_prompts: int, seed: int) -> None:
    """The prompts train.py uses at steps 0, 1, ... (its own data order), one JSON row per prompt."""
    from transformers import AutoTokenizer

    from plumbing.data import batch_indices
    from tasks import encode_prompts, get_task

    train_set = get_task(task_name).load("train", seed=seed)  # as train.py loads it
    picked = [train_set[i] for i in batch_indices(0, n_prompts, len(train_set), seed)]  # steps 0.. in a row
    ids = encode_prompts(AutoTokenizer.from_pretrained(model_path), picked)
    with open(path, "w") as f:
        for ex, prompt_ids in zip(picked, ids):
            f.write(
                json.dumps(
                    {
                        "prompt": ex.prompt,
                        "prompt_ids": prompt_ids,
                        "gold": ex.gold,
                        "reference": ex.reference,
                        "meta": ex.meta,
                        "uid": ex.uid,
                    }
                )
                + "\n"
            )


def run_side(cmd: list[str], timeout: float) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-5000:])
        raise SystemExit(f"vs_trl.py: {' '.join(cmd[:2])} failed (exit {proc.returncode})")
    result = json.loads(lines[-1][len("RESULT ") :])
    result["wall_s"] = time.perf_counter() - t0
    return result


def summarise(result: dict, warmup: int) -> dict:
    """Per-run figures over the steps after the warm-up."""
    steps = result["steps"][warmup:]
    n = len(steps)
    total = {
        k: sum(s[k] for s in steps) for k in ("step_s", "gen_s", "reward_s", "train_s", "tokens", "completion_tokens")
    }
    return {
        "step_s": total["step_s"] / n,
        "gen_s": total["gen_s"] / n,
        "reward_s": total["reward_s"] / n,
        "train_s": total["train_s"] / n,
        "train_tok_s": total["tokens"] / total["train_s"],
        "e2e_tok_s": total["tokens"] / total["step_s"],
        "gen_tok_s": total["completion_tokens"] / total["gen_s"],
        "peak_rss_gb": result["peak_rss_gb"],
        "resp_len": total["completion_tokens"] / n / result["batch"],
    }


def spread(values: list[float], fmt: str) -> str:
    text = format(statistics.median(values), fmt)
    return text if len(values) == 1 else f"{text} [{min(values):{fmt}}-{max(values):{fmt}}]"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="embedded alias or HF folder")
    parser.add_argument("--task", default="arith")
    parser.add_argument("--steps", type=int, default=4, help="steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=1, help="first steps of each run left out of the figures")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--M", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--compile",
        action="store_true",
        help="our side runs train.py --compile (TRL's "
        "runs as it does by default, uncompiled); the warm-up step pays the compiling",
    )
    parser.add_argument("--sides", default="ours,trl", help="comma list of ours, trl")
    parser.add_argument("--venv", default=os.path.join(REPO, ".venv-trl"))
    parser.add_argument("--timeout", type=float, default=1800, help="seconds allowed per run")
    parser.add_argument("--out", default=os.path.join(REPO, "runs", "bench", "vs_trl.json"))
    opts = parser.parse_args()
    if not 0 <= opts.warmup < opts.steps:
        parser.error("--warmup must be in [0, --steps)")
    sides = opts.sides.split(",")

    from rollout import resolve_model

    model_path = resolve_model(opts.model)  # converted once here, not inside a timed run
    os.makedirs(os.path.dirname(opts.out), exist_ok=True)
    prompts_file = os.path.splitext(opts.out)[0] + "-prompts.jsonl"
    write_prompts(prompts_file, opts.task, model_path, opts.steps * opts.prompts, opts.seed)
    common = [
        "--task",
        opts.task,
        "--steps",
        str(opts.steps),
        "--prompts",
        str(opts.prompts),
        "--M",
        str(opts.M),
        "--max-tokens",
        str(opts.max_tokens),
        "--micro-batch",
        str(opts.micro_batch),
        "--lr",
        str(opts.lr),
        "--seed",
        str(opts.seed),
    ]
    commands = {
        "ours": [
            sys.executable,
            "bench/ours_step.py",
            "--model",
            model_path,
            "--expect-prompts",
            prompts_file,
            *common,
            *(["--compile"] if opts.compile else []),
        ]
    }
    if "trl" in sides:
        commands["trl"] = [
            trl_python(opts.venv),
            "bench/trl_grpo.py",
            "--model",
            model_path,
            "--prompts-file",
            prompts_file,
            *common,
        ]
    print(
        f"model {model_path}, task {opts.task}: {opts.prompts} prompts x M={opts.M} per step, <= {opts.max_tokens} "
        f"new tokens, {opts.steps} steps per run ({opts.warmup} warm-up left out), {opts.repeats} repeats, "
        f"{os.cpu_count()} CPUs; {load_note()}",
        flush=True,
    )

    runs = []
    for repeat in range(opts.repeats):
        order = sides if repeat % 2 == 0 else sides[::-1]
        for side in order:
            result = run_side(commands[side], opts.timeout)
            if not result.get("prompts_match", False):
                raise SystemExit(f"vs_trl.py: the {side} run did not get the prompts of {prompts_file}")
            result.update(repeat=repeat, batch=opts.prompts * opts.M)
            result["summary"] = summarise(result, opts.warmup)
            runs.append(result)
            s = result["summary"]
            print(
                f"repeat {repeat} {side:<4}: {s['step_s']:.2f} s/step (gen {s['gen_s']:.2f}, train "
                f"{s['train_s']:.2f}), train {s['train_tok_s']:.0f} tok/s, peak RSS {s['peak_rss_gb']:.2f} GB, "
                f"resp len {s['resp_len']:.1f}, run {result['wall_s']:.0f} s",
                flush=True,
            )
    with open(opts.out, "w") as f:
        json.dump({"options": vars(opts), "model_path": model_path, "runs": runs}, f, indent=1)

    keys = [
        ("step_s", "s/step", ".2f"),
        ("gen_s", "gen s", ".2f"),
        ("reward_s", "reward s", ".3f"),
        ("train_s", "train s", ".2f"),
        ("train_tok_s", "train tok/s", ".0f"),
        ("e2e_tok_s", "e2e tok/s", ".0f"),
        ("gen_tok_s", "gen tok/s", ".1f"),
        ("peak_rss_gb", "peak RSS GB", ".2f"),
        ("resp_len", "resp len", ".1f"),
    ]
    print(f"\nmedian [min-max] over {opts.repeats} repeat(s), steps {opts.warmup + 1}-{opts.steps} of each run")
    print(f"{'':<14}" + "".join(f"{side:>24}" for side in sides))
    for key, label, fmt in keys:
        print(
            f"{label:<14}"
            + "".join(f"{spread([r['summary'][key] for r in runs if r['side'] == side], fmt):>24}" for side in sides)
        )
    if set(sides) == {"ours", "trl"}:
        print("\nratio ours / TRL (per repeat, then median [min-max])")
        for key, label, _ in keys:
            if key in ("reward_s", "resp_len"):  # not a speed: scoring is microseconds, lengths are sampled
                continue
            ratios = [
                a["summary"][key] / b["summary"][key]
                for a in runs
                if a["side"] == "ours"
                for b in runs
                if b["side"] == "trl" and b["repeat"] == a["repeat"] and b["summary"][key] > 0
            ]
            target = TARGETS.get(key)
            verdict = ""
            if target:
                med = statistics.median(ratios)
                met = med <= target[1] if target[0] == "<=" else med >= target[1]
                verdict = f"   target {target[0]} {target[1]}: {'met' if met else 'MISSED'}"
            print(f"{label:<14}{spread(ratios, '.3f'):>24}{verdict}")
    print(f"\nraw results: {opts.out}")


if __name__ == "__main__":
    main()
