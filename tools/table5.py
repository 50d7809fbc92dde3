"""Table 5 in the demo's setting (docs/sweeps.md section 2): SoftmaxGRPO's tau against the study's tau 0.1.

Each tau's runs (results/table5/runs) are paired by seed with the study's tau 0.1 exact-reward SoftmaxGRPO runs
(results/softmax-vs-grpo/runs): the same prompts, order, held-out set and initial weights; only --tau differs. Per
tau and outcome: the mean over seeds, and tau minus tau 0.1 with its 95% paired t-interval and the seeds better and
worse. Outcomes: held-out pass@1 after training, the training pass rate (mean over steps), and mean |A| over the
logged training groups (completions.jsonl logs one group of M a step, with the advantages the loss used).

The mechanism: for binary rewards and large tau, A_i ~ (r_i - mean r) / tau, so tau 10 scales every
advantage down about 10-fold against tau 1. `counterfactual |A|` applies each tau's estimator to the *same* logged
reward groups (the tau 0.1 runs'), which isolates the scale from the trajectory.

    python -m tools.table5 results/table5/runs results/softmax-vs-grpo/runs --plot docs/table5_demo.png
"""

import json
import math
import os

import torch

from advantage import compute_advantages
from plumbing.cli import OneLineParser
from tools.study import finished_run
from tools.sweep import mean_interval, paired_difference

BASE_TAU = 0.1
# The paper's Table 5(a), GSM8K, M = 8: pass@1 (%) by tau (Qwen2.5-1.5B, 1,000 steps). For the figure's shape only.
PAPER_GSM8K_M8 = {0.1: 75.8, 0.3: 75.7, 0.5: 75.0, 1.0: 61.1, 1.3: 63.4, 1.5: 50.2, 10.0: 52.5}
OUTCOMES = [
    ("after", "held-out pass@1 after training"),
    ("auc", "training pass rate, mean over steps"),
    ("adv_abs", "mean |A|, logged training groups"),
]


def logged_groups(path: str) -> list[tuple[list[float], list[float]]]:
    """(rewards, advantages) of each logged group in completions.jsonl: consecutive rows of one step and one uid."""
    groups, key = [], None
    with open(os.path.join(path, "completions.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            if (row["step"], row["uid"]) != key:
                key = (row["step"], row["uid"])
                groups.append(([], []))
            groups[-1][0].append(row["reward"])
            groups[-1][1].append(row["advantage"])
    return groups


def mean_abs_advantage(groups, tau: float | None = None) -> float:
    """Mean |A| over every logged sample: the logged advantages, or with `tau` those softmax gives the same rewards."""
    values = []
    for rewards, adv in groups:
        if tau is not None:
            adv = compute_advantages("softmax", torch.tensor([rewards], dtype=torch.float64), tau=tau)[0].tolist()
        values += [abs(a) for a in adv]
    return sum(values) / len(values)


def collect(*runs_dirs: str) -> dict:
    """{tau: {seed: run}} over the finished exact-reward softmax runs of the folders; a run is tools.study's
    finished_run with its logged groups and their mean |A|."""
    out = {}
    for runs_dir in runs_dirs:
        for name in sorted(os.listdir(runs_dir)):
            found = finished_run(os.path.join(runs_dir, name))
            if found is None or found[0].get("advantage") != "softmax" or found[0].get("reward", "exact") != "exact":
                continue
            args, run = found
            try:
                groups = logged_groups(os.path.join(runs_dir, name))
            except (OSError, KeyError, ValueError):  # no completions.jsonl: not a run of this study
                continue
            run.update(groups=groups, adv_abs=mean_abs_advantage(groups))
            seeds = out.setdefault(float(args["tau"]), {})
            if args["seed"] in seeds:
                raise ValueError(
                    f"two tau {args['tau']} runs for seed {args['seed']}: {seeds[args['seed']]['name']} and {name}"
                )
            seeds[args["seed"]] = run
    return out


def analyse(runs: dict) -> dict:
    """Per tau: each outcome's mean over seeds and its paired difference against tau 0.1 (seeds both ran), the
    counterfactual |A| on the tau 0.1 runs' logged groups, and the pairs whose runs ran on different CPUs."""
    base = runs.get(BASE_TAU, {})
    base_groups = [g for run in base.values() for g in run["groups"]]
    out = {}
    for tau in sorted(runs):
        seeds = sorted(s for s in runs[tau] if s in base)
        entry = {
            "seeds": sorted(runs[tau]),
            "paired": seeds,
            "means": {},
            "diffs": {},
            "counterfactual_abs": mean_abs_advantage(base_groups, tau) if base_groups else None,
            "cpu_mismatch": [s for s in seeds if runs[tau][s]["cpu"].split("\n")[0] != base[s]["cpu"].split("\n")[0]],
        }
        for key, _ in OUTCOMES:
            entry["means"][key] = mean_interval([runs[tau][s][key] for s in sorted(runs[tau])])
            if tau != BASE_TAU and len(seeds) >= 2:
                entry["diffs"][key] = paired_difference(
                    [runs[tau][s][key] for s in seeds], [base[s][key] for s in seeds]
                )
        out[tau] = entry
    return out


def _interval(d: dict, sign: str = "") -> str:
    if d.get("lo") is None:
        return f"{d['mean']:{sign}.3f}"
    return f"{d['mean']:{sign}.3f} [{d['lo']:{sign}.3f}, {d['hi']:{sign}.3f}]"


def report(analysis: dict, runs: dict) -> str:
    """Markdown: one row per tau (means, paired differences, |A|), then every run's row."""
    lines = [
        "| tau | seeds | held-out pass@1 after | tau - 0.1, paired (better / worse) | training pass rate | "
        "tau - 0.1, paired (better / worse) | mean abs A, logged | counterfactual abs A |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for tau, e in analysis.items():
        cells = []
        for key in ("after", "auc"):
            cells.append(_interval(e["means"][key]))
            d = e["diffs"].get(key)
            cells.append(
                f"{_interval(d, '+')}, {d['wins']} / {d['losses']}" if d else "baseline" if tau == BASE_TAU else "-"
            )
        cf = e["counterfactual_abs"]
        lines.append(
            f"| {tau:g} | {len(e['seeds'])} | {' | '.join(cells)} | {_interval(e['means']['adv_abs'])} | "
            f"{'-' if cf is None else f'{cf:.3f}'} |"
        )
    mismatched = {tau: e["cpu_mismatch"] for tau, e in analysis.items() if e["cpu_mismatch"]}
    if mismatched:
        lines += [
            "",
            "Pairs whose two runs ran on different CPU models: "
            + "; ".join(f"tau {tau:g} seeds {', '.join(map(str, s))}" for tau, s in mismatched.items())
            + ".",
        ]
    lines += [
        "",
        "| tau | seed | before -> after | training pass rate | mean abs A | wall s | CPU |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for tau in sorted(runs):
        for s, run in sorted(runs[tau].items()):
            cpu = run["cpu"].split("\n")[0].removeprefix("Model name:").strip()
            wall = f"{run['wall']:.0f}" if run["wall"] else "-"
            lines.append(
                f"| {tau:g} | {s} | {run['before']:.3f} -> {run['after']:.3f} | {run['auc']:.3f} | "
                f"{run['adv_abs']:.3f} | {wall} | {cpu} |"
            )
    return "\n".join(lines)


def plot(analysis: dict, runs: dict, out: str) -> str:
    """Held-out pass@1 after training against tau (a dot per run, the mean and its 95% t-interval), with the paper's
    Table 5 GSM8K M = 8 column on a second axis, for the shape only (another model, task and budget)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    taus = sorted(analysis)
    for tau in taus:
        afters = [run["after"] for run in runs[tau].values()]
        ax.scatter(
            [tau * math.exp(0.06 * (i - 2)) for i in range(len(afters))],
            afters,
            s=14,
            color="gray",
            zorder=3,
            label="one run (seed)" if tau == taus[0] else None,
        )
    means = [analysis[t]["means"]["after"] for t in taus]
    ax.errorbar(
        taus,
        [m["mean"] for m in means],
        fmt="o-",
        color="C0",
        capsize=4,
        label="mean, 95% t-interval",
        yerr=[
            [m["mean"] - (m["lo"] if m["lo"] is not None else m["mean"]) for m in means],
            [(m["hi"] if m["hi"] is not None else m["mean"]) - m["mean"] for m in means],
        ],
    )
    ax.set(xscale="log", xlabel="tau", ylabel="held-out pass@1 after 20 steps (arith, 135M)")
    paper = ax.twinx()
    paper.plot(
        list(PAPER_GSM8K_M8),
        list(PAPER_GSM8K_M8.values()),
        "s--",
        color="C3",
        alpha=0.7,
        label="paper Table 5, GSM8K M=8 (right axis)",
    )
    paper.set_ylabel("paper: GSM8K pass@1 (%), Qwen2.5-1.5B", color="C3")
    handles = ax.get_legend_handles_labels()[0] + paper.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], fontsize=7, loc="lower left")
    ax.set_title("SoftmaxGRPO's tau in the demo's setting (float32, 20 steps, M=8)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv=None):
    parser = OneLineParser("python -m tools.table5", description=__doc__.splitlines()[0])
    parser.add_argument("runs_dirs", nargs="+", help="folders of finished runs: results/table5/runs and the study's")
    parser.add_argument("--plot", default="", help="write the pass@1-against-tau figure here (a .png)")
    opts = parser.parse_args(argv)
    for runs_dir in opts.runs_dirs:
        if not os.path.isdir(runs_dir):
            parser.error(f"{runs_dir}: no such folder of runs")
    try:
        runs = collect(*opts.runs_dirs)
    except ValueError as err:
        parser.error(str(err))
    if BASE_TAU not in runs:
        parser.error(f"no finished tau {BASE_TAU} exact-reward softmax run in {', '.join(opts.runs_dirs)}")
    analysis = analyse(runs)
    print(report(analysis, runs))
    if opts.plot:
        print(f"figure: {plot(analysis, runs, opts.plot)}")


if __name__ == "__main__":
    main()
