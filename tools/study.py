"""The SoftmaxGRPO-vs-GRPO study's numbers (docs/study.md), read from its collected runs.

Pairs are the two arms at one seed and one reward. For each reward and outcome: SoftmaxGRPO minus GRPO, its mean with
the 95% paired t-interval, the seeds favouring each arm, the power the pairs achieved at the observed SD against the
paper's gain, and the pairs 80% power needs at that SD (tools/power.py).

    python -m tools.study results/softmax-vs-grpo/runs --plot docs/study_pairs.png   # prints docs/study.md's tables
"""

import json
import os

from plumbing.cli import OneLineParser
from tools.power import pairs_needed, power
from tools.sweep import paired_difference, read_run

EFFECTS = {"exact": 0.023, "sim": 0.07}  # the paper's GSM8K gains (Table 2), the effects the study is sized for
OUTCOMES = [("after", "held-out pass@1 after training (primary)"), ("auc", "training pass rate, mean over steps")]
ARMS = ("softmax", "grpo")  # difference = softmax - grpo


def _cpu(path: str) -> str:
    """The collecting machine's `lscpu` model and flags (cpu.txt), or '' when the run has none."""
    cpu = os.path.join(path, "cpu.txt")
    if not os.path.exists(cpu):
        return ""
    return "\n".join(line for line in open(cpu) if line.startswith(("Model name", "Flags"))).strip()


def finished_run(path: str) -> tuple[dict, dict] | None:
    """(args.json, run) of a finished run folder, or None for anything else (a partial run, a stray file); the run is
    read_run's numbers plus its folder name, wall seconds and CPU."""
    try:
        with open(os.path.join(path, "args.json")) as f:
            args = json.load(f)
        run = read_run(path)
    except (OSError, KeyError, ValueError):
        return None
    wall = os.path.join(path, "wall_seconds.txt")
    run.update(
        name=os.path.basename(path), cpu=_cpu(path), wall=float(open(wall).read()) if os.path.exists(wall) else None
    )
    return args, run


def collect(runs_dir: str) -> dict:
    """{reward: {seed: {arm: run}}} over the finished runs in runs_dir (eval.json with "after"); a run is
    finished_run's. The arm and reward come from each run's args.json."""
    out = {}
    for name in sorted(os.listdir(runs_dir)):
        found = finished_run(os.path.join(runs_dir, name))
        if found is None or found[0].get("advantage") not in ARMS:
            continue
        args, run = found
        seeds = out.setdefault(args.get("reward", "exact"), {}).setdefault(args["seed"], {})
        if args["advantage"] in seeds:
            raise ValueError(
                f"{runs_dir}: two {args['advantage']} runs for reward {args.get('reward')} seed "
                f"{args['seed']}: {seeds[args['advantage']]['name']} and {name}"
            )
        seeds[args["advantage"]] = run
    return out


def analyse(runs: dict) -> dict:
    """Per reward: the paired seeds, each outcome's paired difference with its power and pairs needed, and the pairs
    whose two arms ran on different CPUs (they are still counted, and named)."""
    out = {}
    for reward, by_seed in sorted(runs.items()):
        seeds = sorted(s for s, arms in by_seed.items() if all(a in arms for a in ARMS))
        entry = {
            "seeds": seeds,
            "unpaired": sorted(set(by_seed) - set(seeds)),
            "effect": EFFECTS.get(reward),
            "cpu_mismatch": [s for s in seeds if by_seed[s]["softmax"]["cpu"] != by_seed[s]["grpo"]["cpu"]],
            "diffs": {},
            "outcomes": {},
        }
        for key, _ in OUTCOMES:
            soft = [by_seed[s]["softmax"][key] for s in seeds]
            grpo = [by_seed[s]["grpo"][key] for s in seeds]
            entry["diffs"][key] = [a - b for a, b in zip(soft, grpo)]
            if len(seeds) < 2:
                continue
            d = paired_difference(soft, grpo)
            if entry["effect"] is not None and d["sd"]:
                d["power"] = power(len(seeds), d["sd"], entry["effect"])
                d["pairs_needed"] = pairs_needed(d["sd"], entry["effect"])
            entry["outcomes"][key] = d
        out[reward] = entry
    return out


def verdict(d: dict) -> str:
    """One phrase for one interval: which way when it excludes 0, else how far each way it still reaches."""
    if d["lo"] > 0:
        return "SoftmaxGRPO higher"
    if d["hi"] < 0:
        return "GRPO higher"
    # here lo <= 0 <= hi; abs() also turns a -0.0 bound into 0.000
    return (
        f"inconclusive: the interval allows SoftmaxGRPO up to {abs(d['hi']):.3f} higher and GRPO up to "
        f"{abs(d['lo']):.3f} higher"
    )


def _pairs(entry: dict) -> str:
    """'1 pair', '5 pairs': one reward's paired seeds, for headings and labels."""
    n = len(entry["seeds"])
    return f"{n} pair{'s' * (n != 1)}"


def report(analysis: dict, runs: dict) -> str:
    """Markdown: per reward, the outcomes' table, then every run's row (pairs, outcomes, wall time, CPU)."""
    lines = []
    for reward, e in analysis.items():
        lines += [f"### Reward `{reward}`: {_pairs(e)} (seeds {', '.join(map(str, e['seeds'])) or '-'})", ""]
        if e["unpaired"]:
            lines += [f"Runs without their partner yet: seeds {', '.join(map(str, e['unpaired']))}.", ""]
        if e["cpu_mismatch"]:
            lines += [f"Pairs whose arms ran on different CPUs: seeds {', '.join(map(str, e['cpu_mismatch']))}.", ""]
        if e["outcomes"]:
            lines += [
                "| outcome | SoftmaxGRPO - GRPO, mean [95% paired t-interval] | SD of the difference | "
                "seeds softmax / grpo higher (ties) | power at the SD for "
                f"+{e['effect']} | pairs for 80% power | verdict |",
                "| --- | --- | --- | --- | --- | --- | --- |",
            ]
            for key, what in OUTCOMES:
                d = e["outcomes"][key]
                ties = len(e["seeds"]) - d["wins"] - d["losses"]
                sized = f"{d['power']:.2f} | {d['pairs_needed']:,}" if "power" in d else "- | -"  # SD 0: none
                lines.append(
                    f"| {what} | {d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}] | {d['sd']:.3f} | "
                    f"{d['wins']} / {d['losses']} ({ties}) | {sized} | {verdict(d)} |"
                )
            lines.append("")
        lines += [
            "| seed | softmax: before -> after, train pass | grpo: before -> after, train pass | "
            "difference: after, train pass | wall s softmax / grpo |",
            "| --- | --- | --- | --- | --- |",
        ]
        for s in sorted(runs[reward]):
            arms = runs[reward][s]
            cells = [
                f"{arms[a]['before']:.3f} -> {arms[a]['after']:.3f}, {arms[a]['auc']:.3f}" if a in arms else "-"
                for a in ARMS
            ]
            diff = (
                (
                    f"{arms['softmax']['after'] - arms['grpo']['after']:+.3f}, "
                    f"{arms['softmax']['auc'] - arms['grpo']['auc']:+.3f}"
                )
                if s in e["seeds"]
                else "-"
            )
            wall = " / ".join(f"{arms[a]['wall']:.0f}" if a in arms and arms[a]["wall"] else "-" for a in ARMS)
            lines.append(f"| {s} | {cells[0]} | {cells[1]} | {diff} | {wall} |")
        lines.append("")
    return "\n".join(lines)


def plot_pairs(analysis: dict, out: str) -> str:
    """One panel per outcome: each pair's difference (a dot per seed, one row per reward), the mean and its 95%
    paired t-interval, 0, and the paper's gain for that reward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rewards = list(analysis)
    fig, axes = plt.subplots(1, len(OUTCOMES), figsize=(6 * len(OUTCOMES), 1.2 * len(rewards) + 1.8), squeeze=False)
    for ax, (key, what) in zip(axes[0], OUTCOMES):
        for y, reward in enumerate(rewards):
            e = analysis[reward]
            ax.scatter(
                e["diffs"][key],
                [y + 0.15] * len(e["diffs"][key]),
                s=18,
                color="gray",
                zorder=3,
                label="one pair (seed)" if y == 0 else None,
            )
            d = e["outcomes"].get(key)
            if d:
                ax.errorbar(
                    d["mean"],
                    y - 0.15,
                    xerr=[[d["mean"] - d["lo"]], [d["hi"] - d["mean"]]],
                    fmt="o",
                    color="C0",
                    capsize=4,
                    label="mean, 95% paired t-interval" if y == 0 else None,
                )
            if e["effect"] is not None:
                ax.plot(
                    [e["effect"]] * 2,
                    [y - 0.4, y + 0.4],
                    color="C3",
                    lw=1.5,
                    label="paper's gain (Table 2)" if y == 0 else None,
                )
        ax.axvline(0, color="black", lw=0.8)
        ax.set(
            title=what,
            xlabel="SoftmaxGRPO - GRPO",
            yticks=range(len(rewards)),
            ylim=(-0.6, len(rewards) - 0.4),
            yticklabels=[f"{r} ({_pairs(analysis[r])})" for r in rewards],
        )
        ax.legend(fontsize=7, loc="best")
    fig.suptitle("SmolLM2-135M, arith, 20 steps, float32: per-pair differences")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv=None):
    parser = OneLineParser("python -m tools.study", description=__doc__.splitlines()[0])
    parser.add_argument("runs_dir", help="results/softmax-vs-grpo/runs (one folder a finished run)")
    parser.add_argument("--plot", default="", help="write the per-pair differences' figure here (a .png)")
    opts = parser.parse_args(argv)
    if not os.path.isdir(opts.runs_dir):
        parser.error(f"{opts.runs_dir}: no such folder of runs")
    try:
        runs = collect(opts.runs_dir)
    except ValueError as err:
        parser.error(str(err))
    if not runs:
        parser.error(f"{opts.runs_dir}: no finished softmax or grpo run (eval.json with 'after') in it")
    analysis = analyse(runs)
    print(report(analysis, runs))
    if opts.plot:
        print(f"figure: {plot_pairs(analysis, opts.plot)}")


if __name__ == "__main__":
    main()
