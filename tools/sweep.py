"""Seed-replicated comparisons: a grid of train.py configurations x seeds, each run in a fresh process.

The paper reports one run per setting (Tables 2 and 5). This stage runs every configuration on the same
seeds (same prompts, data order, held-out set and initial model), one `python train.py ...` after another,
and summarises per configuration, each as mean and 95% t-interval over seeds:
held-out pass@1 before / after training and the gain; the area under the training pass-rate curve
(`reward/pass_rate` averaged over steps, so 1.0 is "every rollout of every step passed"); mean response
length and truncation fraction (also averaged over steps). Against a named baseline configuration it
reports the paired differences over the seeds both ran (paired t-interval and a paired bootstrap).

    python -m tools.sweep --out runs/sweep-estimators --seeds 0-9 --baseline grpo --common "--steps 6 --lr 5e-5" \\
        --config "softmax=--advantage softmax --tau 0.1" --config "grpo=--advantage grpo" \\
        --config "rloo@0-4=--advantage rloo"                # NAME[@SEEDS]=FLAGS; @SEEDS narrows --seeds
    python -m tools.sweep --out runs/sweep-table5 --seeds 0-4 --common "--steps 6 --lr 5e-5" \\
        --grid tau=0.1,0.3,0.5,1.0,10 --grid M=4,8 --baseline "tau=0.1 M=8"      # cross product
    python -m tools.sweep --smoke --out /tmp/smoke            # tiny random model: resume and arithmetic checks

Files: OUT/summary.json, OUT/summary.md (the table), OUT/curves.png (pass rate with 95% bands),
OUT/summary.png (intervals and paired differences). Runs live in RUNS/ (default OUT/../sweep-runs), one folder
per resolved train.py configuration and seed, named by a hash of every train.py argument, so sweeps
that share a configuration (tau 0.1 in the estimator comparison and in Table 5) share its runs.

Resume: a run whose eval.json has "after" is finished and never launched again; a run with a checkpoint
continues with train.py --resume (pass --save-every in --common for checkpoints before the last step); a run
killed before its first checkpoint starts over. Finished runs' checkpoints are deleted (about 1.6 GB each for
SmolLM2) unless --keep-checkpoints.

Statistics: the t-intervals assume roughly normal per-seed values (differences, for the paired ones). The
percentile bootstrap makes no such assumption but is too narrow with few seeds (with 5 seeds it covers less
than 95%), so a claim should rest on the t-interval; both are printed.
"""

import argparse
import contextlib
import hashlib
import io
import json
import math
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo
METRICS = [  # (summary key, what), in table order
    ("before", "held-out pass@1 before"),
    ("after", "held-out pass@1 after"),
    ("gain", "gain (after - before)"),
    ("auc", "training pass rate, mean over steps"),
    ("len_mean", "response length, mean over steps"),
    ("trunc_frac", "truncated fraction, mean over steps"),
]
SWEEP_OWNS = ("seed", "out_dir", "resume", "wandb")  # set by the sweep, per run
SMOKE_COMMON = "--task arith --M 4 --rollout-batch 2 --steps 2 --max-tokens 4 --eval-examples 4 --dtype float32"


class SpecError(ValueError):
    """A bad grid spec; the message is one line."""


# ---- statistics: t-intervals and a paired bootstrap, no scipy needed


def t_quantile(q: float, df: int) -> float:
    """The q-quantile of Student's t with df degrees of freedom (q > 0.5), by bisection on its CDF.

    CDF(x) = 1/2 + integral_0^x pdf, the integral by Simpson's rule on 2000 panels (smooth integrand:
    error far below the 4th decimal the tables print; tests/test_sweep.py checks it against scipy).
    """
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def cdf(x):
        n, h = 2000, x / 2000
        pdf = [math.exp(log_c - (df + 1) / 2 * math.log1p((i * h) ** 2 / df)) for i in range(n + 1)]
        return 0.5 + h / 3 * (pdf[0] + pdf[-1] + 4 * sum(pdf[1:-1:2]) + 2 * sum(pdf[2:-1:2]))

    lo, hi = 0.0, 1.0
    while cdf(hi) < q:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < q else (lo, mid)
    return (lo + hi) / 2


def mean_interval(values: list[float], level: float = 0.95) -> dict:
    """Mean and its t-interval: mean +- t_{(1+level)/2, n-1} * sd / sqrt(n), sd with n - 1. One value: no interval."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return {"n": n, "mean": mean, "sd": None, "lo": None, "hi": None}
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile((1 + level) / 2, n - 1) * sd / math.sqrt(n)
    return {"n": n, "mean": mean, "sd": sd, "lo": mean - half, "hi": mean + half}


def paired_difference(
    values: list[float], baseline: list[float], level: float = 0.95, resamples: int = 10_000, seed: int = 0
) -> dict:
    """Seed-by-seed differences d_s = values_s - baseline_s: mean, paired t-interval (mean_interval of d) and a
    percentile bootstrap over seeds (resampling whole seeds keeps each pair together)."""
    diffs = [v - b for v, b in zip(values, baseline)]
    out = mean_interval(diffs, level)
    rng = random.Random(seed)
    if len(diffs) >= 2:
        means = sorted(sum(rng.choices(diffs, k=len(diffs))) / len(diffs) for _ in range(resamples))
        out["boot_lo"] = means[int(resamples * (1 - level) / 2)]
        out["boot_hi"] = means[int(resamples * (1 + level) / 2) - 1]
    else:
        out["boot_lo"] = out["boot_hi"] = None
    out["wins"] = sum(d > 0 for d in diffs)
    out["losses"] = sum(d < 0 for d in diffs)
    return out


# ---- the grid spec

MAX_SEEDS = 10_000  # one train.py run each: a spec past this is a typo, and its list alone could fill the memory
MAX_RUNS = MAX_SEEDS  # configurations x seeds: the grid's cross product is bounded before it is built


def parse_seeds(text: str) -> list[int]:
    """'0-9' or '0,2,5' or '0-4,7' -> sorted distinct seeds, at most MAX_SEEDS (counted before any list is made)."""
    seeds = set()
    try:
        for part in text.split(","):
            a, _, b = part.strip().partition("-")
            first, last = int(a), int(b) if b else int(a)
            if last - first + 1 + len(seeds) > MAX_SEEDS:
                raise SpecError(f"seeds '{text}': more than {MAX_SEEDS:,} seeds, one train.py run each")
            if last < first:
                raise SpecError(f"seeds '{text}': the range {part.strip()} is empty (write LOW-HIGH)")
            seeds.update(range(first, last + 1))
    except SpecError:
        raise
    except ValueError:
        raise SpecError(f"seeds '{text}': use 0-9, 0,2,5 or 0-4,7") from None
    if not seeds or min(seeds) < 0:
        raise SpecError(f"seeds '{text}': need at least one seed, all >= 0")
    return sorted(seeds)


def expand_grid(configs: list[str], grids: list[str], seeds: list[int]) -> list[dict]:
    """[{name, flags, seeds}] from NAME[@SEEDS]=FLAGS configs crossed with KEY=V1,V2 grid axes."""
    base = []
    for text in configs or []:
        head, sep, flags = text.partition("=")
        name, at, own_seeds = head.strip().partition("@")
        if not sep or not name:
            raise SpecError(f"--config '{text}': write NAME=FLAGS or NAME@SEEDS=FLAGS")
        try:
            split = shlex.split(flags)
        except ValueError as err:  # "No closing quotation"
            raise SpecError(f"--config '{text}': {err} (close each quote, e.g. a=--tau \"0.1\")") from None
        base.append({"name": name, "flags": split, "seeds": parse_seeds(own_seeds) if at else seeds})
    base = base or [{"name": "", "flags": [], "seeds": seeds}]
    sizes = [len(axis.partition("=")[2].split(",")) for axis in grids or []]
    pairs = sum(len(c["seeds"]) for c in base)  # (configuration, seed) pairs before the grid
    if (runs := math.prod(sizes) * pairs) > MAX_RUNS:  # counted before the cross product is made
        raise SpecError(
            f"--grid makes {runs:,} train.py runs (axes of {' x '.join(map(str, sizes))} values, times "
            f"{pairs:,} (configuration, seed) pairs), more than {MAX_RUNS:,}: narrow --grid or --seeds"
        )
    for axis in grids or []:
        key, sep, values = axis.partition("=")
        if not sep or not key.strip() or not values.strip():
            raise SpecError(f"--grid '{axis}': write KEY=V1,V2 (KEY a train.py flag without --, e.g. tau=0.1,0.3)")
        key = key.strip()
        base = [
            {
                "name": f"{c['name']} {key}={v}".strip(),
                "flags": c["flags"] + [f"--{key.replace('_', '-')}", v],
                "seeds": c["seeds"],
            }
            for c in base
            for v in values.split(",")
        ]
    names = [c["name"] for c in base]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise SpecError(f"configuration name '{duplicate}' appears twice")
    return base


def resolve(config: dict, common: list[str], seed: int) -> dict:
    """train.py's full arguments for one run (preset applied), checked by train.py's own parser."""
    import train

    flags = common + config["flags"]
    owned = next((f for f in flags if f.startswith("--") and f[2:].replace("-", "_").split("=")[0] in SWEEP_OWNS), None)
    if owned is not None:
        raise SpecError(f"configuration '{config['name']}': {owned} is set by the sweep, per run")
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):  # train.parse_args prints one line and exits 2
            args = train.parse_args(flags + ["--seed", str(seed), "--out-dir", os.path.join(ROOT, ".no-such-run")])
    except SystemExit:
        message = err.getvalue().strip().removeprefix("train.py: error: ")
        raise SpecError(f"configuration '{config['name']}': {message}") from None
    if args.eval_examples < 1:
        raise SpecError(f"configuration '{config['name']}': the summary needs held-out scores, --eval-examples >= 1")
    return {k: v for k, v in asdict(args).items() if k not in SWEEP_OWNS}


def run_name(args: dict, seed: int) -> str:
    """Readable prefix + a hash of every argument: the same configuration always maps to the same folder."""
    digest = hashlib.sha1(json.dumps(args, sort_keys=True).encode()).hexdigest()[:10]
    return f"{args['task']}-{args['advantage']}-tau{args['tau']:g}-M{args['M']}-{args['reward']}-s{seed}-{digest}"


# ---- running: one fresh train.py process per run, resumable


def run_state(path: str) -> str:
    """'done' (eval.json has "after"), 'checkpoint' (resumable), 'partial' (killed before a checkpoint), 'new'."""
    from plumbing.checkpoint import find_checkpoint

    try:
        with open(os.path.join(path, "eval.json")) as f:
            if "after" in json.load(f):
                return "done"
    except (OSError, ValueError):
        pass
    if find_checkpoint(path):
        return "checkpoint"
    return "partial" if os.path.isdir(path) else "new"


def launch(argv: list[str], log_path: str) -> int:
    """One train.py process, output to its log; the sweep waits for it (the machine runs one at a time). A Ctrl-C
    reaches both: the run is let finish its own exit (a save under way completes or leaves the last one whole), and a
    run that exited as interrupted (130) stops the sweep as one."""
    with open(log_path, "a") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            code = proc.wait()
        except KeyboardInterrupt:
            proc.wait()  # not subprocess.run's kill a quarter second later; a second Ctrl-C stops the wait
            raise
    if code in (130, -signal.SIGINT):
        raise KeyboardInterrupt
    return code


def train_argv(args: dict, seed: int, path: str, state: str) -> list[str]:
    from config import UNUSED_WITHOUT
    from plumbing.cli import reads

    flags = [sys.executable, "train.py"]
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is None:  # an optional hyperparameter left unset (reinforce's --baseline): train.py's default
            continue
        if key in UNUSED_WITHOUT and not reads(UNUSED_WITHOUT[key], args):  # train.py refuses a flag it would not read
            continue
        if isinstance(value, bool):  # on/off flags take no value
            flags.append(flag if value else "--no-" + flag[2:])
            continue
        flags += [flag, repr(value) if isinstance(value, float) else str(value)]
    flags += ["--seed", str(seed), "--out-dir", path]
    return flags + (["--resume", path] if state == "checkpoint" else [])


def wait_for_memory(min_free_gb: float, poll_seconds: float = 30.0):
    """Block until MemAvailable (Linux /proc/meminfo) reaches `min_free_gb`: on a shared machine a run that
    starts short of memory is killed halfway and its work is lost."""
    if min_free_gb <= 0 or not os.path.exists("/proc/meminfo"):
        return
    while True:
        with open("/proc/meminfo") as f:
            free_gb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable")) / 2**20
        if free_gb >= min_free_gb:
            return
        print(f"waiting: {free_gb:.1f} GB available, want {min_free_gb:g}", flush=True)
        time.sleep(poll_seconds)


def run_all(runs: list[dict], keep_checkpoints: bool = False, min_free_gb: float = 0.0) -> dict:
    """Runs every unfinished run in order; returns counts of launched / skipped / failed runs."""
    counts = {"launched": 0, "skipped": 0, "failed": 0, "seconds": 0.0}
    for i, run in enumerate(runs):
        path, state = run["path"], run_state(run["path"])
        tag = f"[{i + 1}/{len(runs)}] {run['config']} seed {run['seed']}"
        if state == "done":
            counts["skipped"] += 1
            continue
        if state == "partial":  # killed before its first checkpoint: nothing to continue from
            shutil.rmtree(path)
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "args.json"), "w") as f:
            json.dump({**run["args"], "seed": run["seed"]}, f, indent=1)
        wait_for_memory(min_free_gb)
        print(f"{tag}: {'resuming' if state == 'checkpoint' else 'starting'} {path}", flush=True)
        t0 = time.time()
        rc = launch(train_argv(run["args"], run["seed"], path, state), os.path.join(path, "train.log"))
        seconds = time.time() - t0
        counts["launched"] += 1
        counts["seconds"] += seconds
        with open(os.path.join(path, "wall_seconds.txt"), "a") as f:
            f.write(f"{seconds:.1f}\n")
        if rc != 0 or run_state(path) != "done":
            counts["failed"] += 1
            last = _last_line(os.path.join(path, "train.log"))
            print(f"{tag}: train.py exited {rc}: {last}", flush=True)
            continue
        print(f"{tag}: done in {seconds:.0f} s", flush=True)
        if not keep_checkpoints:
            for d in os.listdir(path):
                if d.startswith("checkpoint-"):
                    shutil.rmtree(os.path.join(path, d))
    return counts


def _wall_seconds(run: dict) -> float:
    """Seconds train.py ran for this run, over every launch (resumes and restarts included)."""
    try:
        return sum(float(line) for line in open(os.path.join(run["path"], "wall_seconds.txt")) if line.strip())
    except OSError:
        return 0.0


def _last_line(path: str) -> str:
    with open(path, errors="replace") as f:
        lines = [line.strip() for line in f.read().replace("\r", "\n").splitlines() if line.strip()]
    return lines[-1][:200] if lines else "(no output)"


# ---- the summary


def read_run(path: str) -> dict:
    """One finished run's numbers: eval.json's scores, metrics.jsonl's per-step means and its pass-rate curve."""
    with open(os.path.join(path, "eval.json")) as f:
        evals = json.load(f)
    with open(os.path.join(path, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    curve = [row.get("reward/pass_rate", row["reward/mean"]) for row in rows]  # no verifier: the reward itself

    def over_steps(key):
        return sum(row[key] for row in rows) / len(rows)

    return {
        "before": evals["before"],
        "after": evals["after"],
        "gain": evals["after"] - evals["before"],
        "auc": sum(curve) / len(curve),
        "len_mean": over_steps("response/len_mean"),
        "trunc_frac": over_steps("response/trunc_frac"),
        "curve": curve,
    }


def summarize(configs: list[dict], runs: list[dict], baseline: str | None) -> dict:
    """Per-configuration means and t-intervals over its finished seeds; paired differences vs `baseline`."""
    done = {(r["config"], r["seed"]): read_run(r["path"]) for r in runs if run_state(r["path"]) == "done"}
    out = {"baseline": baseline, "configs": {}}
    for c in configs:
        seeds = [s for s in c["seeds"] if (c["name"], s) in done]
        entry = {"flags": " ".join(c["flags"]), "seeds": seeds, "missing_seeds": sorted(set(c["seeds"]) - set(seeds))}
        if seeds:
            entry.update({key: mean_interval([done[c["name"], s][key] for s in seeds]) for key, _ in METRICS})
            curves = [done[c["name"], s]["curve"] for s in seeds]
            steps = min(map(len, curves))
            entry["curve"] = [mean_interval([cv[i] for cv in curves]) for i in range(steps)]
        if baseline is not None and c["name"] != baseline:
            both = [s for s in seeds if (baseline, s) in done]
            if both:
                entry["vs_baseline"] = {
                    key: paired_difference(
                        [done[c["name"], s][key] for s in both], [done[baseline, s][key] for s in both]
                    )
                    for key in ("after", "gain", "auc", "len_mean", "trunc_frac")
                }
                entry["vs_baseline"]["seeds"] = both
        out["configs"][c["name"]] = entry
    return out


def _fmt(stat: dict, digits: int = 3) -> str:
    if stat["lo"] is None:
        return f"{stat['mean']:.{digits}f} (n=1)"
    return f"{stat['mean']:.{digits}f} [{stat['lo']:.{digits}f}, {stat['hi']:.{digits}f}]"


def table(summary: dict) -> str:
    """Markdown: one row per configuration, mean [95% t-interval]; then the paired differences."""
    lines = [
        "| configuration | seeds | " + " | ".join(what for _, what in METRICS) + " |",
        "| --- | --- |" + " --- |" * len(METRICS),
    ]
    for name, c in summary["configs"].items():
        if c["seeds"]:
            digits = {"len_mean": 1}
            cells = [_fmt(c[key], digits.get(key, 3)) for key, _ in METRICS]
            lines.append(f"| {name} | {len(c['seeds'])} | " + " | ".join(cells) + " |")
    if summary["baseline"]:
        lines += [
            "",
            f"Paired differences vs {summary['baseline']} (same seeds): mean [95% paired t-interval] "
            "[95% paired bootstrap], wins/losses over seeds",
            "",
            "| configuration | seeds | after | gain | training pass rate | response length |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for name, c in summary["configs"].items():
            vs = c.get("vs_baseline")
            if vs:
                cells = []
                for key, digits in (("after", 3), ("gain", 3), ("auc", 3), ("len_mean", 1)):
                    d = vs[key]
                    boot = (
                        f" [{d['boot_lo']:+.{digits}f}, {d['boot_hi']:+.{digits}f}]" if d["boot_lo"] is not None else ""
                    )
                    ci = f" [{d['lo']:+.{digits}f}, {d['hi']:+.{digits}f}]" if d["lo"] is not None else ""
                    cells.append(f"{d['mean']:+.{digits}f}{ci}{boot} {d['wins']}/{d['losses']}")
                lines.append(f"| {name} | {len(vs['seeds'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(summary: dict, out: str) -> list[str]:
    """curves.png: training pass rate per step, mean and 95% band over seeds; summary.png: intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    named = [(n, c) for n, c in summary["configs"].items() if c["seeds"]]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, c in named:
        steps = range(1, len(c["curve"]) + 1)
        mean = [p["mean"] for p in c["curve"]]
        (line,) = ax.plot(steps, mean, label=f"{name} (n={len(c['seeds'])})")
        if c["curve"][0]["lo"] is not None:
            ax.fill_between(
                steps, [p["lo"] for p in c["curve"]], [p["hi"] for p in c["curve"]], color=line.get_color(), alpha=0.15
            )
    ax.set(xlabel="step", ylabel="training pass rate", title="mean over seeds, 95% t-band")
    ax.legend(fontsize=7)
    paths = [os.path.join(out, "curves.png")]
    fig.tight_layout()
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)

    panels = [("after", "held-out pass@1 after"), ("gain", "gain"), ("auc", "training pass rate (mean)")]
    with_vs = summary["baseline"] is not None
    fig, axes = plt.subplots(1, len(panels) + with_vs, figsize=(4 * (len(panels) + with_vs), 0.5 * len(named) + 2))
    ys = range(len(named))
    for ax, (key, title) in zip(axes, panels):
        for y, (_, c) in zip(ys, named):
            s = c[key]
            err = [[s["mean"] - s["lo"]], [s["hi"] - s["mean"]]] if s["lo"] is not None else None
            ax.errorbar(s["mean"], y, xerr=err, fmt="o", capsize=3)
        ax.set(title=title, yticks=list(ys), yticklabels=[n for n, _ in named])
    if with_vs:
        ax = axes[-1]
        for y, (_, c) in zip(ys, named):
            d = c.get("vs_baseline", {}).get("after")
            if d:
                err = [[d["mean"] - d["lo"]], [d["hi"] - d["mean"]]] if d["lo"] is not None else None
                ax.errorbar(d["mean"], y, xerr=err, fmt="o", capsize=3)
        ax.axvline(0, color="gray", lw=0.8)
        ax.set(title=f"after - {summary['baseline']} (paired)", yticks=list(ys), yticklabels=[n for n, _ in named])
    fig.tight_layout()
    paths.append(os.path.join(out, "summary.png"))
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)
    return paths


# ---- the whole sweep


def plan(opts) -> tuple[list[dict], list[dict]]:
    """(configs, runs), runs seed-major (every configuration of seed 0, then seed 1, ...) so that an
    interrupted sweep leaves complete pairs behind. Raises SpecError on any bad part of the spec."""
    configs = expand_grid(opts.config, opts.grid, parse_seeds(opts.seeds))
    names = [c["name"] for c in configs]
    if opts.baseline is not None and opts.baseline not in names:
        raise SpecError(f"--baseline '{opts.baseline}' is not a configuration ({', '.join(map(repr, names))})")
    try:
        common = shlex.split(opts.common)
    except ValueError as err:
        raise SpecError(f"--common: {err}") from None
    runs_dir = opts.runs_dir or os.path.join(os.path.dirname(os.path.abspath(opts.out)), "sweep-runs")
    runs = []
    for seed in sorted({s for c in configs for s in c["seeds"]}):
        for c in configs:
            if seed in c["seeds"]:
                args = resolve(c, common, seed)
                runs.append(
                    {
                        "config": c["name"],
                        "seed": seed,
                        "args": args,
                        "path": os.path.join(runs_dir, run_name(args, seed)),
                    }
                )
    return configs, runs


def sweep(opts) -> dict:
    configs, runs = plan(opts)
    os.makedirs(opts.out, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    t0 = time.time()
    if opts.report_only:
        counts = {
            "launched": 0,
            "skipped": sum(run_state(r["path"]) == "done" for r in runs),
            "failed": 0,
            "seconds": 0.0,
        }
    else:
        counts = run_all(runs, keep_checkpoints=opts.keep_checkpoints, min_free_gb=opts.min_free_gb)
    summary = summarize(configs, runs, opts.baseline)
    summary.update(
        command=" ".join(shlex.quote(a) for a in sys.argv),
        commit=commit,
        runs=counts,
        sweep_seconds=time.time() - t0,
        run_seconds_total=sum(map(_wall_seconds, runs)),
        run_dirs={f"{r['config']} s{r['seed']}": r["path"] for r in runs},
    )
    with open(os.path.join(opts.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    text = table(summary)
    with open(os.path.join(opts.out, "summary.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    if any(c["seeds"] for c in summary["configs"].values()):
        print("figures:", ", ".join(plot(summary, opts.out)))
    print(
        f"runs: {counts['launched']} launched ({counts['seconds']:.0f} s), {counts['skipped']} already done, "
        f"{counts['failed']} failed, {len(runs) - counts['launched'] - counts['skipped']} not run; "
        f"train.py ran {summary['run_seconds_total']:.0f} s over all launches of these runs"
    )
    return summary


def smoke(opts) -> int:
    """The grid on the tiny random model, then resume checks and the summary's arithmetic recomputed by hand."""
    from tools.tiny_model import build_tiny_model

    opts.runs_dir = os.path.join(opts.out, "runs")
    shutil.rmtree(opts.runs_dir, ignore_errors=True)  # every smoke starts from nothing: it counts launches
    model = os.path.join(opts.out, "tiny-model")
    if not os.path.isfile(os.path.join(model, "config.json")):
        build_tiny_model(model)
    opts.common = f"{SMOKE_COMMON} --model {model}"
    # the random model passes nothing, so both estimators' advantages are all zero; a longer cap for softmax
    # makes the paired length difference non-zero, so the check below can fail
    opts.config = ["softmax=--advantage softmax --tau 0.1 --max-tokens 6", "grpo=--advantage grpo"]
    opts.grid, opts.seeds, opts.baseline, opts.keep_checkpoints, opts.report_only = [], "0-1", "grpo", True, False
    first = sweep(opts)
    problems = [] if first["runs"]["launched"] == 4 else [f"first pass launched {first['runs']['launched']}, not 4"]
    _, runs = plan(opts)
    again = sweep(opts)
    if again["runs"]["launched"]:
        problems.append(f"a finished sweep launched {again['runs']['launched']} runs again")
    # a run killed after its checkpoint (resumed), one killed before any (restarted): both must come back equal
    resumed, restarted = runs[0]["path"], runs[1]["path"]
    after = {p: json.load(open(os.path.join(p, "eval.json")))["after"] for p in (resumed, restarted)}
    for path in (resumed, restarted):
        evals = json.load(open(os.path.join(path, "eval.json")))
        del evals["after"]
        json.dump(evals, open(os.path.join(path, "eval.json"), "w"))
    for d in os.listdir(restarted):
        if d.startswith("checkpoint-"):
            shutil.rmtree(os.path.join(restarted, d))
    third = sweep(opts)
    if third["runs"]["launched"] != 2 or third["runs"]["failed"]:
        problems.append(
            f"after two kills the sweep launched {third['runs']['launched']} (want 2), {third['runs']['failed']} failed"
        )
    for path in (resumed, restarted):
        now = json.load(open(os.path.join(path, "eval.json"))).get("after")
        if now != after[path]:
            problems.append(f"{os.path.basename(path)}: after {now} on rerun, {after[path]} before the kill")
    # arithmetic, recomputed from metrics.jsonl with the textbook formulas (mean response length varies by seed
    # on the random model; pass@1 is mostly 0 there). Two seeds: sd = |a - b| / sqrt(2), half = t_{.975,1} sd / sqrt(2)
    lengths = {}
    for r in runs:
        rows = [json.loads(line) for line in open(os.path.join(r["path"], "metrics.jsonl"))]
        lengths[r["config"], r["seed"]] = sum(row["response/len_mean"] for row in rows) / len(rows)
    for name in ("softmax", "grpo"):
        a, b = lengths[name, 0], lengths[name, 1]
        stat, half = third["configs"][name]["len_mean"], 12.7062047 * abs(a - b) / 2
        if abs(stat["mean"] - (a + b) / 2) > 1e-9 or abs(stat["hi"] - stat["mean"] - half) > 1e-6:
            problems.append(f"{name}: summary length {stat} != mean {(a + b) / 2}, half {half}")
    diffs = [lengths["softmax", s] - lengths["grpo", s] for s in (0, 1)]
    paired = third["configs"]["softmax"]["vs_baseline"]["len_mean"]
    if abs(paired["mean"] - sum(diffs) / 2) > 1e-9:
        problems.append(f"paired length difference {paired['mean']} != {sum(diffs) / 2}")
    for problem in problems:
        print(f"sweep.py --smoke: FAILED: {problem}", file=sys.stderr)
    if not problems:
        print("sweep.py --smoke: ok")
    return 1 if problems else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="sweep folder: summary.json, summary.md, PNGs")
    parser.add_argument("--config", action="append", help="NAME=FLAGS or NAME@SEEDS=FLAGS (train.py flags)")
    parser.add_argument("--grid", action="append", help="KEY=V1,V2,...: crossed with every --config")
    parser.add_argument("--seeds", default="0-4", help="seeds of every configuration: 0-9, 0,2,5 (default 0-4)")
    parser.add_argument("--common", default="", help="train.py flags shared by every configuration")
    parser.add_argument("--baseline", help="configuration name the paired differences are taken against")
    parser.add_argument("--runs-dir", default="", help="run folders (default OUT/../sweep-runs, shared between sweeps)")
    parser.add_argument("--keep-checkpoints", action="store_true", help="keep finished runs' checkpoints")
    parser.add_argument(
        "--min-free-gb",
        type=float,
        default=0.0,
        help="before each run, wait until this much memory is available (a SmolLM2 run: ~7)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the runs and their state, launch nothing")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="summarise the runs finished so far (e.g. while the sweep still runs), launch nothing",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny-model grid with resume and arithmetic checks")
    parser.error = lambda message: (print(f"sweep.py: error: {message}", file=sys.stderr), sys.exit(2))
    opts = parser.parse_args(argv)
    if not 0 <= opts.min_free_gb < math.inf:  # NaN fails both: it would never wait
        parser.error(f"--min-free-gb must be finite and >= 0, got {opts.min_free_gb:g}")
    try:
        if opts.smoke:
            return smoke(opts)
        if opts.dry_run:
            for run in plan(opts)[1]:
                print(f"{run['config']} seed {run['seed']}: {run_state(run['path'])} {run['path']}")
            return 0
        summary = sweep(opts)
    except SpecError as err:
        print(f"sweep.py: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the run under way got the Ctrl-C too, and kept its newest checkpoint
        print(
            "sweep.py: interrupted; finished runs are kept, and the same command continues the rest (a run with a "
            "checkpoint resumes from it)",
            file=sys.stderr,
        )
        return 130
    return 1 if summary["runs"]["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
