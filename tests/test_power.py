"""tools/power.py against scipy's noncentral t and the normal-approximation formula."""

import math

import pytest

from tools.power import pairs_needed, power


def test_power_is_close_to_the_noncentral_t():
    stats = pytest.importorskip("scipy.stats")
    for n, sd, effect in [(5, 0.05, 0.05), (10, 0.05, 0.023), (40, 0.1, 0.05), (20, 0.2, 0.07)]:
        crit = stats.t.ppf(0.975, n - 1)
        nc = effect * math.sqrt(n) / sd
        exact = 1 - stats.nct.cdf(crit, n - 1, nc) + stats.nct.cdf(-crit, n - 1, nc)
        assert power(n, sd, effect) == pytest.approx(exact, abs=2e-3), (n, sd, effect)


def test_pairs_needed_is_the_first_n_reaching_the_target_and_near_the_normal_formula():
    n = pairs_needed(0.05, 0.023)
    assert power(n, 0.05, 0.023) >= 0.8 > power(n - 1, 0.05, 0.023)
    normal = ((1.959964 + 0.841621) * 0.05 / 0.023) ** 2  # z-test: t needs a pair or two more
    assert normal <= n <= normal + 3
    assert pairs_needed(1.0, 1e-4, most=1000) == 1001  # out of reach says so


# ---- tools/study.py: the SoftmaxGRPO-vs-GRPO study's tables, from collected runs


def write_run(root, name, advantage, seed, after, pass_rates, reward="exact", cpu="AMD EPYC", finished=True):
    """A collected run as tools/study.py reads it: args.json, eval.json, metrics.jsonl, cpu.txt, wall_seconds.txt."""
    import json

    path = root / name
    path.mkdir()
    (path / "args.json").write_text(json.dumps({"advantage": advantage, "seed": seed, "reward": reward}))
    (path / "eval.json").write_text(json.dumps({"before": 0.4, **({"after": after} if finished else {})}))
    rows = [
        {"step": i + 1, "reward/mean": p, "reward/pass_rate": p, "response/len_mean": 30.0, "response/trunc_frac": 0.5}
        for i, p in enumerate(pass_rates)
    ]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "cpu.txt").write_text(f"commit abc\nModel name: {cpu}\nFlags: avx2\n")
    (path / "wall_seconds.txt").write_text("700.5\n")


def test_the_study_pairs_runs_by_seed_and_its_interval_and_power_are_the_hand_computed_ones(tmp_path, capsys):
    from tools.study import analyse, collect, main, verdict

    soft, grpo = [0.5, 0.7, 0.6], [0.4, 0.5, 0.6]  # differences 0.1, 0.2, 0.0: mean 0.1, SD 0.1
    for s in range(3):
        write_run(tmp_path, f"soft-{s}", "softmax", s, soft[s], [0.2, 0.4])
        write_run(tmp_path, f"grpo-{s}", "grpo", s, grpo[s], [0.3, 0.5], cpu="Intel" if s == 2 else "AMD EPYC")
    write_run(tmp_path, "soft-3", "softmax", 3, 0.9, [0.5])  # its partner has not finished
    write_run(tmp_path, "grpo-3", "grpo", 3, None, [0.5], finished=False)
    write_run(tmp_path, "sim-soft-0", "softmax", 0, 0.5, [0.2], reward="sim")  # another reward: never paired here

    runs = collect(str(tmp_path))
    e = analyse(runs)["exact"]
    assert e["seeds"] == [0, 1, 2] and e["unpaired"] == [3] and e["cpu_mismatch"] == [2]
    d = e["outcomes"]["after"]
    half = 4.302653 * 0.1 / math.sqrt(3)  # t_{0.975, 2} * SD / sqrt(n)
    assert d["mean"] == pytest.approx(0.1) and d["sd"] == pytest.approx(0.1)
    assert (d["lo"], d["hi"]) == (pytest.approx(0.1 - half, abs=1e-5), pytest.approx(0.1 + half, abs=1e-5))
    assert (d["wins"], d["losses"]) == (2, 0)  # seed 2 is a tie
    assert d["power"] == pytest.approx(power(3, 0.1, 0.023)) and d["pairs_needed"] == pairs_needed(0.1, 0.023)
    assert e["outcomes"]["auc"]["mean"] == pytest.approx(-0.1) and e["outcomes"]["auc"]["sd"] == pytest.approx(0)
    assert verdict(e["outcomes"]["auc"]) == "GRPO higher"  # every pair -0.1: the interval is the point, below 0
    assert verdict(d) == "inconclusive: the interval allows SoftmaxGRPO up to 0.348 higher and GRPO up to 0.148 higher"
    assert analyse(runs)["sim"]["seeds"] == [] and analyse(runs)["sim"]["outcomes"] == {}

    main([str(tmp_path)])
    out = capsys.readouterr().out
    assert "+0.100 [-0.148, +0.348]" in out and "different CPUs: seeds 2" in out and "partner yet: seeds 3" in out


def test_the_study_refuses_two_runs_of_one_arm_and_seed_in_one_line(tmp_path, capsys):
    from tools.study import main

    with pytest.raises(SystemExit) as err:
        main([str(tmp_path)])  # empty: nothing finished
    assert err.value.code == 2 and "no finished softmax or grpo run" in capsys.readouterr().err
    write_run(tmp_path, "a", "grpo", 0, 0.5, [0.5])
    write_run(tmp_path, "b", "grpo", 0, 0.6, [0.5])
    with pytest.raises(SystemExit) as err:
        main([str(tmp_path)])
    msg = capsys.readouterr().err.strip()
    assert err.value.code == 2 and "two grpo runs for reward exact seed 0: a and b" in msg and "\n" not in msg
