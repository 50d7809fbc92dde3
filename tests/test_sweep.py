"""sweep.py: its statistics on hand-made run folders, resume by launch counting, bad specs, the smoke grid.

The run folders here are written by the tests (eval.json + metrics.jsonl, as train.py writes them), so the
means, t-intervals and paired differences are known in advance; the launcher is replaced by a fake that
writes such a folder, so resume is checked by counting launches without training anything.
"""

import argparse
import json
import math
import os
import subprocess
import sys

import pytest

from tools import sweep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T975 = {
    1: 12.706204736174698,
    2: 4.302652729749464,
    4: 2.7764451051977987,
    9: 2.2621571628540993,
    30: 2.0422724563012373,
}  # Student t 0.975 quantiles (printed tables, scipy.stats.t.ppf)


def write_run(path, after, before=0.25, curve=(0.2, 0.4, 0.6), lengths=(10.0, 20.0, 30.0), trunc=(0.0, 0.5, 1.0)):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "eval.json"), "w") as f:
        json.dump({"before": before, **({} if after is None else {"after": after})}, f)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        for step, (p, n, t) in enumerate(zip(curve, lengths, trunc), 1):
            f.write(
                json.dumps(
                    {
                        "step": step,
                        "reward/mean": p,
                        "reward/pass_rate": p,
                        "response/len_mean": n,
                        "response/trunc_frac": t,
                    }
                )
                + "\n"
            )


@pytest.mark.parametrize("df", sorted(T975))
def test_t_quantile_matches_the_table(df):
    assert sweep.t_quantile(0.975, df) == pytest.approx(T975[df], abs=1e-7)


def test_t_quantile_matches_scipy_elsewhere():
    from scipy import stats  # requirements-dev.txt: a missing scipy fails, it does not skip

    for q, df in ((0.9, 3), (0.995, 7), (0.975, 100)):
        assert sweep.t_quantile(q, df) == pytest.approx(stats.t.ppf(q, df), abs=1e-7)


def test_summary_on_hand_made_runs(tmp_path):
    a_after = [0.5, 0.6, 0.7, 0.8, 0.9]
    base_after = [0.4, 0.6, 0.5, 0.7, 0.6]
    runs = []
    for seed in range(5):
        for name, after in (("a", a_after[seed]), ("base", base_after[seed])):
            path = tmp_path / f"{name}-{seed}"
            write_run(path, after, curve=(0.2, 0.4, 0.6 + 0.1 * seed) if name == "a" else (0.2, 0.4, 0.6))
            runs.append({"config": name, "seed": seed, "path": str(path)})
    write_run(tmp_path / "a-5", None)  # killed: no "after", so not counted and listed as missing
    runs.append({"config": "a", "seed": 5, "path": str(tmp_path / "a-5")})
    configs = [
        {"name": "a", "flags": ["--tau", "0.1"], "seeds": list(range(6))},
        {"name": "base", "flags": [], "seeds": list(range(5))},
    ]
    summary = sweep.summarize(configs, runs, baseline="base")
    a = summary["configs"]["a"]
    assert a["seeds"] == [0, 1, 2, 3, 4] and a["missing_seeds"] == [5]
    # after: mean 0.7, sd sqrt(0.025) = 0.1581, half = t_{.975,4} sd / sqrt(5)
    assert a["after"]["mean"] == pytest.approx(0.7)
    assert a["after"]["sd"] == pytest.approx(math.sqrt(0.025))
    assert a["after"]["hi"] - a["after"]["mean"] == pytest.approx(T975[4] * math.sqrt(0.025) / math.sqrt(5))
    assert a["gain"]["mean"] == pytest.approx(0.7 - 0.25) and a["before"]["sd"] == 0.0
    # auc: mean over steps of the pass-rate curve, then over seeds: (0.2 + 0.4 + 0.6 + 0.1 s) / 3, s = 0..4
    assert a["auc"]["mean"] == pytest.approx((0.2 + 0.4 + 0.6 + 0.2) / 3)
    assert a["len_mean"]["mean"] == pytest.approx(20.0) and a["trunc_frac"]["mean"] == pytest.approx(0.5)
    assert [p["mean"] for p in a["curve"]] == pytest.approx([0.2, 0.4, 0.8])
    # paired: d = [0.1, 0, 0.2, 0.1, 0.3], mean 0.14, sd sqrt(0.013)
    d = a["vs_baseline"]["after"]
    assert a["vs_baseline"]["seeds"] == [0, 1, 2, 3, 4]
    assert d["mean"] == pytest.approx(0.14) and d["sd"] == pytest.approx(math.sqrt(0.013))
    half = T975[4] * math.sqrt(0.013) / math.sqrt(5)
    assert (d["lo"], d["hi"]) == pytest.approx((0.14 - half, 0.14 + half))
    assert (d["wins"], d["losses"]) == (4, 0)
    assert 0.0 <= d["boot_lo"] < 0.14 < d["boot_hi"] <= 0.3  # inside the range of the five differences
    assert "vs_baseline" not in summary["configs"]["base"]
    text = sweep.table(summary)
    assert "| a | 5 | 0.250 [0.250, 0.250] | 0.700 [0.504, 0.896] |" in text
    assert f"+0.140 [{0.14 - half:+.3f}, {0.14 + half:+.3f}]" in text


def test_paired_t_interval_agrees_with_scipy():
    from scipy import stats  # requirements-dev.txt: a missing scipy fails, it does not skip

    x, y = [0.61, 0.72, 0.55, 0.80, 0.67, 0.70, 0.59], [0.58, 0.70, 0.57, 0.71, 0.60, 0.66, 0.59]
    d = sweep.paired_difference(x, y)
    diffs = [a - b for a, b in zip(x, y)]
    lo, hi = stats.t.interval(0.95, len(diffs) - 1, loc=sum(diffs) / 7, scale=stats.sem(diffs))
    assert (d["lo"], d["hi"]) == pytest.approx((lo, hi), abs=1e-9)
    assert d["mean"] == pytest.approx(stats.ttest_rel(x, y).statistic * stats.sem(diffs))


def test_paired_bootstrap_is_close_to_the_normal_interval_and_reproducible():
    diffs = [((7 * i) % 11 - 5) / 10 for i in range(30)]
    d = sweep.paired_difference(diffs, [0.0] * 30)
    mean, sd_pop = sum(diffs) / 30, math.sqrt(sum((v - sum(diffs) / 30) ** 2 for v in diffs) / 30)
    normal = 1.959964 * sd_pop / math.sqrt(30)  # the bootstrap's large-sample limit
    assert (d["boot_lo"], d["boot_hi"]) == pytest.approx((mean - normal, mean + normal), abs=0.03)
    assert sweep.paired_difference(diffs, [0.0] * 30)["boot_lo"] == d["boot_lo"]
    same = sweep.paired_difference([0.3] * 4, [0.2] * 4)
    assert same["boot_lo"] == pytest.approx(0.1) and same["boot_hi"] == pytest.approx(0.1) and same["sd"] == 0


def test_one_seed_has_no_interval():
    stat = sweep.mean_interval([0.5])
    assert stat["mean"] == 0.5 and stat["lo"] is None and "(n=1)" in sweep._fmt(stat)


# ---- the spec and resume, with a fake launcher


def sweep_argv(tmp_path, *extra):
    return [
        "--out",
        str(tmp_path / "sw"),
        "--seeds",
        "0-1",
        "--common",
        "--steps 3 --eval-examples 8",
        "--config",
        "soft=--advantage softmax --tau 0.1",
        "--config",
        "grpo=--advantage grpo",
        "--baseline",
        "grpo",
        *extra,
    ]


@pytest.fixture
def fake_train(monkeypatch):
    """sweep.launch replaced: records argv, writes what a finished train.py run leaves (checkpoint included)."""
    calls = []

    def launch(argv, log_path):
        calls.append(argv)
        out = argv[argv.index("--out-dir") + 1]
        seed = int(argv[argv.index("--seed") + 1])
        os.makedirs(os.path.join(out, "checkpoint-000003"), exist_ok=True)
        open(os.path.join(out, "checkpoint-000003", "trainer_state.pt"), "w").close()
        write_run(out, 0.5 + 0.1 * seed)
        return 0

    monkeypatch.setattr(sweep, "launch", launch)
    return calls


def test_resume_skips_finished_runs_and_continues_killed_ones(tmp_path, fake_train):
    assert sweep.main(sweep_argv(tmp_path)) == 0
    assert len(fake_train) == 4
    assert [argv[argv.index("--seed") + 1] for argv in fake_train] == ["0", "0", "1", "1"]  # seed-major
    assert all("--resume" not in argv for argv in fake_train)
    summary = json.load(open(tmp_path / "sw" / "summary.json"))
    assert summary["configs"]["soft"]["after"]["mean"] == pytest.approx(0.55)
    assert summary["runs"] == {**summary["runs"], "launched": 4, "skipped": 0, "failed": 0}
    runs = sorted(set(summary["run_dirs"].values()))
    assert all(not any(d.startswith("checkpoint-") for d in os.listdir(r)) for r in runs)  # deleted when done

    fake_train.clear()
    assert sweep.main(sweep_argv(tmp_path)) == 0
    assert fake_train == []  # nothing recomputed

    os.remove(tmp_path / "sw" / "summary.json")  # --report-only: the summary of what is there, no launch
    write_run(summary["run_dirs"]["grpo s0"], None)
    assert sweep.main(sweep_argv(tmp_path, "--report-only")) == 0
    partial = json.load(open(tmp_path / "sw" / "summary.json"))
    assert fake_train == [] and partial["configs"]["grpo"]["seeds"] == [1] and partial["runs"]["skipped"] == 3
    assert partial["configs"]["soft"]["vs_baseline"]["seeds"] == [1]
    assert sweep.main(sweep_argv(tmp_path)) == 0 and len(fake_train) == 1  # the run has no checkpoint: restarted
    fake_train.clear()

    # kill two runs: one after a checkpoint (resumed), one before any (started over, its folder cleared)
    with_ckpt, without = summary["run_dirs"]["soft s0"], summary["run_dirs"]["grpo s1"]
    for path in (with_ckpt, without):
        write_run(path, None)
    os.makedirs(os.path.join(with_ckpt, "checkpoint-000002"))
    open(os.path.join(with_ckpt, "checkpoint-000002", "trainer_state.pt"), "w").close()
    open(os.path.join(without, "stale.txt"), "w").close()
    assert sweep.main(sweep_argv(tmp_path)) == 0
    assert len(fake_train) == 2
    resumed = next(a for a in fake_train if a[a.index("--out-dir") + 1] == with_ckpt)
    restarted = next(a for a in fake_train if a[a.index("--out-dir") + 1] == without)
    assert resumed[resumed.index("--resume") + 1] == with_ckpt and "--resume" not in restarted
    assert not os.path.exists(os.path.join(without, "stale.txt"))


def test_a_failed_run_is_reported_and_the_sweep_goes_on(tmp_path, monkeypatch, capsys):
    calls = []

    def launch(argv, log_path):
        calls.append(argv)
        with open(log_path, "a") as f:
            f.write("train.py: error: the policy diverged\n")
        return 1

    monkeypatch.setattr(sweep, "launch", launch)
    assert sweep.main(sweep_argv(tmp_path)) == 1
    out = capsys.readouterr().out
    assert len(calls) == 4 and "train.py exited 1: train.py: error: the policy diverged" in out


@pytest.mark.parametrize("how", ["exit 130", "killed by SIGINT"])
def test_a_run_that_exits_as_interrupted_is_an_interrupt_of_the_sweep(how, tmp_path):
    import sys

    exits = "os.kill(os.getpid(), signal.SIGINT)" if how == "killed by SIGINT" else "sys.exit(130)"
    with pytest.raises(KeyboardInterrupt):
        sweep.launch(
            [sys.executable, "-c", f"import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); {exits}"],
            str(tmp_path / "log.txt"),
        )
    assert sweep.launch([sys.executable, "-c", "import sys; sys.exit(1)"], str(tmp_path / "log.txt")) == 1


def test_a_ctrl_c_stops_the_sweep_in_one_line_and_a_rerun_continues(tmp_path, fake_train, monkeypatch, capsys):
    fake = sweep.launch

    def interrupted_at_the_third(argv, log_path):
        if len(fake_train) == 2:
            raise KeyboardInterrupt
        return fake(argv, log_path)

    monkeypatch.setattr(sweep, "launch", interrupted_at_the_third)
    assert sweep.main(sweep_argv(tmp_path)) == 130
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("sweep.py: interrupted; finished runs are kept"), err
    fake_train.clear()
    monkeypatch.setattr(sweep, "launch", fake)
    assert sweep.main(sweep_argv(tmp_path)) == 0 and len(fake_train) == 2  # the 2 finished are kept, 2 run now


def test_the_same_configuration_maps_to_the_same_run_folder(tmp_path):
    def paths(*configs):
        opts = argparse.Namespace(
            out=str(tmp_path / "x"), config=list(configs), grid=[], seeds="0", common="", baseline=None, runs_dir=""
        )
        return [r["path"] for r in sweep.plan(opts)[1]]

    assert paths("a=--tau 0.1") == paths("b=--tau 0.10 --advantage softmax")  # defaults spelled out, same run
    assert paths("a=--tau 0.1") != paths("a=--tau 0.3")
    grid = sweep.expand_grid(["s=--advantage softmax"], ["tau=0.1,10", "M=4,8"], [0, 1])
    assert [c["name"] for c in grid] == ["s tau=0.1 M=4", "s tau=0.1 M=8", "s tau=10 M=4", "s tau=10 M=8"]
    assert grid[3]["flags"] == ["--advantage", "softmax", "--tau", "10", "--M", "8"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--baseline", "nope"], "--baseline 'nope' is not a configuration"),
        (["--config", "soft=--tau 0.3"], "configuration name 'soft' appears twice"),
        (["--seeds", "a-b"], "seeds 'a-b'"),
        (["--config", "no-equals-sign"], "write NAME=FLAGS"),
        (["--config", "x=--seed 3"], "--seed is set by the sweep"),
        (["--config", "x=--advantage nope"], "configuration 'x': --advantage must be one of"),
        (["--config", "x=--eval-examples 0"], "--eval-examples >= 1"),
        (["--grid", "tau"], "write KEY=V1,V2"),
        (["--grid", "no_such_flag=1", "--baseline", "grpo no_such_flag=1"], "unrecognized arguments: --no-such-flag"),
        (["--common", "--steps 'x"], "--common: No closing quotation"),
    ],
)
def test_bad_spec_is_one_line_and_exit_2(tmp_path, capsys, fake_train, extra, message):
    assert sweep.main(sweep_argv(tmp_path, *extra)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("sweep.py: error: ") and message in err
    assert fake_train == [] and not (tmp_path / "sw").exists()


def test_cli_bad_spec_exits_2_with_one_line(tmp_path):
    argv = [sys.executable, "-m", "tools.sweep", *sweep_argv(tmp_path, "--config", "x=--M 0")]
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == ["sweep.py: error: configuration 'x': --M must be >= 2, got 0"]
    missing = subprocess.run(
        [sys.executable, "-m", "tools.sweep"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert missing.returncode == 2 and missing.stderr.strip().splitlines() == [
        "sweep.py: error: the following arguments are required: --out"
    ]


@pytest.mark.slow
def test_smoke_grid_end_to_end(tmp_path):
    """The CI smoke grid: 4 tiny-model runs, a rerun that launches nothing, a resumed and a restarted run
    that reproduce their scores, and the summary's arithmetic recomputed from the run folders."""
    argv = [sys.executable, "-m", "tools.sweep", "--smoke", "--out", str(tmp_path / "smoke")]
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "sweep.py --smoke: ok" in result.stdout
    summary = json.load(open(tmp_path / "smoke" / "summary.json"))
    assert {name: c["seeds"] for name, c in summary["configs"].items()} == {"softmax": [0, 1], "grpo": [0, 1]}
    assert summary["configs"]["softmax"]["vs_baseline"]["len_mean"]["mean"] != 0
    assert (tmp_path / "smoke" / "curves.png").stat().st_size > 0 and (tmp_path / "smoke" / "summary.png").exists()


@pytest.mark.parametrize(
    "grids, seeds, runs",
    [
        ([f"k{i}=" + ",".join(map(str, range(20))) for i in range(8)], "0-1", "102,400,000,000"),  # 20^8 x 2 x 2
        (["tau=" + ",".join(map(str, range(2501)))], "0-1", "10,004"),  # one long axis: 2 configs x 2501 x 2 seeds
        (["tau=0.1,0.3", "M=" + ",".join(map(str, range(2, 1252)))], "0-1", "10,000"),  # the limit itself: allowed
    ],
)
def test_a_grid_past_the_run_limit_is_refused_before_its_cross_product_is_made(
    grids, seeds, runs, tmp_path, capsys, fake_train, monkeypatch
):
    """8 axes of 20 values took 2 GB in 21 s to build; the product of the axes' lengths is bounded first."""
    made = []
    args = {"task": "arith", "advantage": "softmax", "tau": 0.1, "M": 8, "reward": "exact"}
    monkeypatch.setattr(sweep, "resolve", lambda config, common, seed: made.append(config) or {**args, "seed": seed})
    argv = sweep_argv(tmp_path, "--seeds", seeds, "--dry-run", *[f for g in grids for f in ("--grid", g)])
    code = sweep.main([a for a in argv if a not in ("--baseline", "grpo")])
    err = capsys.readouterr().err
    if runs == "10,000":  # at the limit the plan is made: 2 x 1250 x 2 configurations x 2 seeds
        assert code == 0 and err == "" and len(made) == 10_000
        return
    assert code == 2 and made == [] and fake_train == []
    assert err == (
        f"sweep.py: error: --grid makes {runs} train.py runs (axes of "
        f"{' x '.join(str(len(g.split('=')[1].split(','))) for g in grids)} values, times 4 (configuration, "
        f"seed) pairs), more than 10,000: narrow --grid or --seeds\n"
    )
