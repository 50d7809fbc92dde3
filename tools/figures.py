"""Figures: prompt weights (Figure 1, Sections 3.2-3.3), training curves, gradient allocation (Table 3).

1. `plot_figure1`: the exact finite-M prompt weight omega_M(p) of SoftmaxGRPO at several tau, GRPO,
   MaxRL and REINFORCE (`tools/theory.py: population_weight`, the same estimators that train), next to the
   mean |A| per rollout against p. Both are exact: they enumerate the group's success count
   s ~ Binomial(M, p) rather than sample.
2. `plot_training_curves`: a grid of the main curves from one or more `metrics.jsonl` files, overlaid
   (a softmax run next to a grpo run). train.py calls it at the end of a run.
3. `plot_table3`: Table 3 as stacked bars, one bar per estimator, from measured shares
   (grad_alloc.allocation_table), never from the paper's numbers.

    python -m tools.figures figure1 --out docs/figure1.png
    python -m tools.figures curves runs/softmax/metrics.jsonl runs/grpo/metrics.jsonl --labels softmax grpo
    python -m tools.figures table3 --from-json shares.json --out docs/table3.png    # {"grpo": [5 shares], ...}

Departures from the paper:
1. Figure 1's weights are drawn divided by their value at p = 1/2. Only the shape of omega(p) matters
   (Section 3.2: p-independent factors go into the step size), and the raw scales differ by ~100x.
2. REINFORCE's weight and mean |A| use the population baseline: 0 for the weight (a baseline that does
   not depend on the group adds nothing in expectation), p for mean |A| (the batch mean of a batch of
   prompts that all pass with probability p).
"""

import argparse
import json
import math
import os
import re
import sys

import matplotlib

matplotlib.use("Agg")  # files only: no display on training machines
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from advantage import compute_advantages  # noqa: E402
from tools.theory import population_weight  # noqa: E402

BIN_LABELS = ["[0, 0.2)", "[0.2, 0.5)", "[0.5, 0.7)", "[0.7, 0.9)", "[0.9, 1]"]  # Table 3's columns
CURVE_KEYS = [  # (metrics key, panel title), in panel order; keys no run logged are left out
    ("reward/mean", "mean reward"),
    ("reward/pass_rate", "pass rate"),
    ("loss/pg", "policy-gradient loss"),
    ("loss/kl", "KL to reference"),  # and the runs' --kl-estimator (kl_estimator_of)
    ("response/len_mean", "mean response length (tokens)"),
    ("grad/norm", "gradient norm"),
    ("adv/zero_group_frac", "fraction of zero-advantage groups"),
    ("loss/clip_frac_high", "clip fraction (high)"),
    ("eval/score", "held-out score (greedy, --eval-every)"),  # only the steps that evaluated: markers
]


def _weight_rows(taus):
    """(label, estimator name, kwargs, line style) for every curve of Figure 1."""
    rows = [(f"SoftmaxGRPO tau={tau:g}", "softmax", {"tau": tau}, "-") for tau in taus]
    return rows + [("GRPO", "grpo", {}, "--"), ("MaxRL", "maxrl", {}, "-."), ("REINFORCE", "reinforce", {}, ":")]


def mean_abs_advantage(name: str, M: int, p, **kwargs) -> torch.Tensor:
    """E|A_i| for binary rewards with pass rate p, exactly: sum over s ~ Binomial(M, p) successes.

    The group with s successes is fed to the estimator itself; its mean |A| over the M rollouts is
    weighted by the binomial pmf. REINFORCE's baseline is p (see the module docstring).
    """
    p = torch.as_tensor(p, dtype=torch.float64)
    s = torch.arange(M + 1, dtype=torch.float64)  # successes in the group, (M+1,)
    groups = (torch.arange(M, dtype=torch.float64) < s[:, None]).double()  # (M+1, M), s ones then zeros
    log_binom = torch.lgamma(torch.tensor(M + 1.0, dtype=torch.float64)) - torch.lgamma(s + 1) - torch.lgamma(M + 1 - s)
    # xlogy(0, 0) = 0 keeps p = 0 and p = 1 exact.
    pmf = torch.exp(log_binom + torch.xlogy(s, p[..., None]) + torch.xlogy(M - s, 1 - p[..., None]))  # (*p, M+1)
    if name == "reinforce":
        # rewards - p: the mean |A| of group s depends on p itself, so it is computed per p.
        per_group = (groups - p.reshape(-1, 1, 1)).abs().mean(-1).reshape(*p.shape, M + 1)  # (*p, M+1)
    else:
        adv = compute_advantages(name, groups, **kwargs).double()  # (M+1, M)
        per_group = adv.abs().mean(-1)  # (M+1,)
    return (pmf * per_group).sum(-1)  # (*p.shape,)


def plot_figure1(out_path: str, M: int = 8, taus=(0.1, 0.3, 1.0)) -> str:
    """Figure 1: omega_M(p) (normalised to 1 at p = 1/2, log scale) and mean |A| against p."""
    p = torch.linspace(0.005, 0.995, 199, dtype=torch.float64)
    half = torch.tensor(0.5, dtype=torch.float64)
    fig, (ax_w, ax_a) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, name, kw, style in _weight_rows(taus):
        w = population_weight(name, M, p, **kw) / population_weight(name, M, half, **kw)  # shape only
        (line,) = ax_w.plot(p, w, style, label=label)
        kw_abs = {} if name == "reinforce" else kw
        ax_a.plot(p, mean_abs_advantage(name, M, p, **kw_abs), style, color=line.get_color(), label=label)
    ax_w.plot(p, 0.5 / p, color="gray", lw=0.8, label="ML  1/p (shape)")  # Table 1's ML row
    ax_w.set_yscale("log")
    ax_w.set_xlabel("pass probability p")
    ax_w.set_ylabel(r"prompt weight $\omega_M(p)\,/\,\omega_M(1/2)$")
    ax_w.set_title(f"Exact prompt weight, M = {M}")
    ax_w.legend(fontsize=8)
    ax_a.set_xlabel("pass probability p")
    ax_a.set_ylabel("mean |advantage| per rollout")
    ax_a.set_title(f"Mean |A| (exact over Binomial(M, p)), M = {M}")
    for ax in (ax_w, ax_a):
        ax.grid(alpha=0.3)
        ax.set_xlim(0, 1)
    return _save(fig, out_path)


def _read_metrics(path: str) -> list[dict]:
    """A run's metrics.jsonl through the run's own reader (a run still writing: its cut-short last line waits)."""
    from plumbing.run_log import read_log

    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist")
    return read_log(path, note=False)


def _series(rows: list[dict], key: str):
    """(steps, values) of the rows that carry a finite number under key; x is "step" or the row index."""
    xs, ys = [], []
    for i, row in enumerate(rows):
        value = row.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        xs.append(row.get("step", i))
        ys.append(value)
    return xs, ys


def kl_estimator_of(metrics_path: str) -> str | None:
    """The --kl-estimator of the run that wrote `metrics_path`, from the args its newest checkpoint saved (k3 where
    they predate the flag: k3 was the only one); None without a readable checkpoint."""
    from plumbing.checkpoint import CheckpointError, find_checkpoint, safe_load

    ckpt = find_checkpoint(os.path.dirname(os.path.abspath(metrics_path)))
    try:  # trainer_state.pt alone: checkpoints from before DCP's shards keep their label
        return safe_load(ckpt, "trainer_state.pt")["args"].get("kl_estimator", "k3") if ckpt else None
    except (CheckpointError, OSError, KeyError, TypeError, AttributeError):
        return None


def plot_training_curves(metrics_paths: list[str], out_path: str, labels: list[str] | None = None) -> str:
    """A panel per main metric (CURVE_KEYS that any run logged), every run overlaid with its label."""
    if isinstance(metrics_paths, str):
        metrics_paths = [metrics_paths]
    if labels is None:
        labels = [os.path.basename(os.path.dirname(os.path.abspath(p))) or p for p in metrics_paths]
    if len(labels) != len(metrics_paths):
        raise ValueError(f"plot_training_curves: {len(labels)} labels for {len(metrics_paths)} metrics files")
    runs = [(label, _read_metrics(path)) for label, path in zip(labels, metrics_paths)]
    keys = [(k, t) for k, t in CURVE_KEYS if any(_series(rows, k)[1] for _, rows in runs)]
    sampled = sorted({k for _, rows in runs for row in rows for k in row if re.fullmatch(r"eval/[^/]+/mean@\d+", k)})
    keys += [(k, f"held-out {k.split('/')[1]}: sampled {k.split('/')[2]}, greedy dashed") for k in sampled]
    if not keys:  # nothing to draw yet: still write a valid PNG that says so
        fig, ax = plt.subplots(figsize=(5, 2))
        ax.text(0.5, 0.5, "no metrics logged yet", ha="center", va="center")
        ax.axis("off")
        return _save(fig, out_path)
    ncols = min(3, len(keys))
    nrows = math.ceil(len(keys) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.2 * nrows), squeeze=False)
    estimators = sorted(set(filter(None, map(kl_estimator_of, metrics_paths))))  # the KL panel names them
    for ax, (key, title) in zip(axes.flat, keys):
        title = f"{title} ({' / '.join(estimators)})" if key == "loss/kl" and estimators else title
        for label, rows in runs:
            xs, ys = _series(rows, key)
            if ys:
                (line,) = ax.plot(xs, ys, label=label, marker="." if len(ys) < 30 or key.startswith("eval/") else None)
            if ys and key in sampled:  # --eval-samples: its 95% interval over prompts as a band, the greedy score
                _, low = _series(rows, f"{key}_ci95_low")
                _, high = _series(rows, f"{key}_ci95_high")
                if len(low) == len(high) == len(ys):
                    ax.fill_between(xs, low, high, color=line.get_color(), alpha=0.2)
                other = f"eval/{key.split('/')[1]}/greedy"  # an --eval-tasks set's; the task's own is eval/score
                gx, gy = _series(rows, other if any(other in row for row in rows) else "eval/score")
                if gy:
                    ax.plot(gx, gy, linestyle="--", marker=".", color=line.get_color(), label=f"{label} greedy")
        if key in sampled:
            ax.legend(fontsize=7)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    return _save(fig, out_path)


def plot_table3(tables: dict[str, list[float]], out_path: str, title: str | None = None) -> str:
    """Table 3 as stacked bars: one bar per estimator, one segment per pass-rate bin (shares in %)."""
    if not tables:
        raise ValueError("plot_table3: no estimators given")
    for name, shares in tables.items():
        if len(shares) != len(BIN_LABELS):
            raise ValueError(f"plot_table3: {name!r} has {len(shares)} shares, expected {len(BIN_LABELS)}")
    names = list(tables)
    fig, ax = plt.subplots(figsize=(2.0 + 1.6 * len(names), 4.5))
    colors = plt.get_cmap("viridis")([0.1, 0.3, 0.5, 0.7, 0.9])
    bottom = [0.0] * len(names)
    for b, (bin_label, color) in enumerate(zip(BIN_LABELS, colors)):
        heights = [float(tables[n][b]) for n in names]
        bars = ax.bar(names, heights, bottom=bottom, color=color, label=f"p in {bin_label}", width=0.6)
        for bar, h in zip(bars, heights):
            if h >= 4:  # label segments that have room for the text
                ax.text(
                    bar.get_x() + bar.get_width() / 2,
                    bar.get_y() + h / 2,
                    f"{h:.1f}%",
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="white" if b < 3 else "black",
                )
        bottom = [lo + h for lo, h in zip(bottom, heights)]
    ax.set_ylabel("share of gradient budget (%)")
    ax.set_xlabel("advantage estimator")
    ax.set_ylim(0, max(100.0, max(bottom)) * 1.02)
    ax.set_title(title or "Gradient allocation by prompt pass rate (Table 3)")
    handles, names_ = ax.get_legend_handles_labels()
    ax.legend(
        handles[::-1], names_[::-1], fontsize=8, bbox_to_anchor=(1.02, 1), loc="upper left", title="pass-rate bin"
    )  # top-to-bottom, as the bars stack
    return _save(fig, out_path)


def _save(fig, out_path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
    return out_path


def run_table3(metrics_path: str, estimators=("grpo", "softmax")) -> dict[str, list[float]]:
    """Table 3 from a training run: each estimator's per-step shares (train.py's alloc/<name>/<bin>,
    all computed on the run's own rollouts) averaged over the steps where it had any budget."""
    rows = _read_metrics(metrics_path)
    table = {}
    for name in estimators:
        keys = (
            sorted(
                (k for k in rows[0] if k.startswith(f"alloc/{name}/")),
                key=lambda k: float(k.rsplit("/", 1)[1].split("-")[0]),
            )
            if rows
            else []
        )
        steps = [[r[k] for k in keys] for r in rows if all(k in r for k in keys) and sum(r[k] for k in keys) > 0]
        if len(keys) != 5 or not steps:
            raise ValueError(f"{metrics_path} has no alloc/{name}/* shares")
        table[name] = [sum(col) / len(steps) for col in zip(*steps)]
    return table


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    f1 = sub.add_parser("figure1", help="omega_M(p) and mean |A| against p")
    f1.add_argument("--out", default="docs/figure1.png")
    f1.add_argument("--M", type=int, default=8, help="group size")
    f1.add_argument("--taus", type=float, nargs="+", default=[0.1, 0.3, 1.0], help="SoftmaxGRPO temperatures")
    cu = sub.add_parser("curves", help="training curves from metrics.jsonl files")
    cu.add_argument("metrics", nargs="+", help="metrics.jsonl files, one per run")
    cu.add_argument("--labels", nargs="+", default=None, help="one label per file (default: run folder name)")
    cu.add_argument("--out", default="curves.png")
    t3 = sub.add_parser("table3", help="stacked bars from measured shares")
    source = t3.add_mutually_exclusive_group(required=True)
    source.add_argument("--from-json", help='JSON file {"estimator": [5 shares in %%], ...}')
    source.add_argument("--from-metrics", help="a run's metrics.jsonl: average its per-step alloc/* shares")
    t3.add_argument("--estimators", nargs="+", default=["grpo", "softmax"])
    t3.add_argument("--title", default=None)
    t3.add_argument("--out", default="docs/table3.png")
    args = parser.parse_args(argv)
    from plumbing.checkpoint import CheckpointError  # what a damaged log line raises

    try:
        path = _draw(args)
    except (OSError, ValueError, CheckpointError) as err:
        sys.exit(f"figures: error: {err}")
    print(f"wrote {path}")


def _draw(args) -> str:
    if args.cmd == "figure1":
        path = plot_figure1(args.out, M=args.M, taus=tuple(args.taus))
    elif args.cmd == "curves":
        path = plot_training_curves(args.metrics, args.out, labels=args.labels)
    else:
        if args.from_metrics:
            table = run_table3(args.from_metrics, args.estimators)
            for name, shares in table.items():
                print(f"{name:<10}" + "".join(f"{s:7.1f}%" for s in shares))
        else:
            with open(args.from_json) as f:
                table = json.load(f)
        path = plot_table3(table, args.out, title=args.title)
    return path


if __name__ == "__main__":
    main()
