"""tools/table5.py: pairing by seed against tau 0.1, mean |A| from the logged groups, and the counterfactual scale.

python -m pytest tests/test_table5.py -q
"""

import json
import os

import pytest

from tools import table5


def make_run(root, name, tau, seed, after, pass_rates, groups, advantage="softmax"):
    path = os.path.join(root, name)
    os.makedirs(path)
    json.dump({"advantage": advantage, "tau": tau, "seed": seed, "reward": "exact"}, open(f"{path}/args.json", "w"))
    json.dump({"before": 0.4, "after": after}, open(f"{path}/eval.json", "w"))
    with open(f"{path}/metrics.jsonl", "w") as f:
        for rate in pass_rates:
            f.write(
                json.dumps(
                    {
                        "reward/mean": rate,
                        "reward/pass_rate": rate,
                        "response/len_mean": 10.0,
                        "response/trunc_frac": 0.0,
                    }
                )
                + "\n"
            )
    with open(f"{path}/completions.jsonl", "w") as f:
        for step, (rewards, adv) in enumerate(groups, 1):
            for r, a in zip(rewards, adv):
                f.write(json.dumps({"step": step, "uid": f"u{step}", "reward": r, "advantage": a}) + "\n")


def test_pairs_by_seed_and_reads_the_logged_advantages(tmp_path):
    base, new = tmp_path / "base", tmp_path / "new"
    for s, after in enumerate([0.8, 0.7, 0.9]):
        make_run(base, f"b{s}", 0.1, s, after, [0.5, 0.5], [([1.0, 0.0], [1.0, -1.0])])
    make_run(base, "grpo0", 0.1, 0, 0.1, [0.5], [([1.0, 0.0], [5.0, -5.0])], advantage="grpo")  # not softmax: out
    for s, after in enumerate([0.6, 0.8, 0.5]):
        make_run(new, f"n{s}", 10.0, s, after, [0.25, 0.75], [([1.0, 0.0], [0.5, -0.25])])
    runs = table5.collect(str(new), str(base))
    assert sorted(runs) == [0.1, 10.0] and sorted(runs[0.1]) == [0, 1, 2]
    a = table5.analyse(runs)
    d = a[10.0]["diffs"]["after"]
    assert d["mean"] == pytest.approx(((0.6 - 0.8) + (0.8 - 0.7) + (0.5 - 0.9)) / 3)
    assert (d["wins"], d["losses"]) == (1, 2)
    assert a[10.0]["means"]["adv_abs"]["mean"] == pytest.approx(0.375)  # (0.5 + 0.25) / 2
    assert a[10.0]["diffs"]["auc"]["mean"] == pytest.approx(0.0)
    assert "| 10 | 3 |" in table5.report(a, runs)


def test_counterfactual_scale_follows_one_over_tau_for_binary_rewards(tmp_path):
    # One group of 8 with 2 successes: at large tau A_i ~ (r_i - 0.25) / tau, so mean |A| ~ 2 * 0.25 * 0.75 / tau
    groups = [([1.0, 1.0] + [0.0] * 6, [0.0] * 8)]
    for tau in (10.0, 100.0):
        assert table5.mean_abs_advantage(groups, tau) == pytest.approx(0.375 / tau, rel=0.1)
    sharp = table5.mean_abs_advantage(groups, 0.1)  # MaxRL-like: successes M/k - 1 = 3, failures -1
    assert sharp == pytest.approx((2 * 3 + 6 * 1) / 8, rel=1e-3)


def test_two_runs_of_one_seed_and_tau_are_refused(tmp_path):
    for name in ("a", "b"):
        make_run(tmp_path, name, 0.1, 0, 0.5, [0.5], [([1.0, 0.0], [1.0, -1.0])])
    with pytest.raises(ValueError, match="two tau 0.1 runs for seed 0"):
        table5.collect(str(tmp_path))
