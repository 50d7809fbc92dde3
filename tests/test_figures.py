"""figures.py: files are valid PNGs, curves overlay runs and skip missing keys, mean |A| is exact."""

import json
import math

import pytest
import torch

from advantage import compute_advantages
from tools.figures import mean_abs_advantage, plot_figure1, plot_table3, plot_training_curves

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _is_png(path) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == PNG_MAGIC


def test_figure1_writes_png(tmp_path):
    out = plot_figure1(str(tmp_path / "sub" / "figure1.png"), M=4, taus=(0.1, 1.0))
    assert _is_png(out)


def test_curves_two_runs_missing_keys_and_broken_lines(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("\n".join(json.dumps({"step": s, "reward/mean": s / 10, "loss/kl": 0.01 * s}) for s in range(5)))
    # run b logs other keys, a non-number and a half-written last line
    b.write_text(
        "\n".join(json.dumps({"step": s, "reward/mean": 0.1, "grad/norm": None if s == 2 else 1.0}) for s in range(4))
        + '\n{"step": 4, "rew'
    )
    out = plot_training_curves([str(a), str(b)], str(tmp_path / "curves.png"), labels=["softmax", "grpo"])
    assert _is_png(out)
    with pytest.raises(ValueError, match="labels"):
        plot_training_curves([str(a), str(b)], str(tmp_path / "x.png"), labels=["one"])


def test_eval_scores_get_their_own_panel_with_a_point_per_evaluation(tmp_path, monkeypatch):
    from tools import figures

    a = tmp_path / "metrics.jsonl"  # --eval-every 2: the score on every second row only
    a.write_text(
        "".join(
            json.dumps({"step": s, "reward/mean": 0.1 * s, **({"eval/score": 0.5} if s % 2 == 0 else {})}) + "\n"
            for s in range(1, 7)
        )
    )
    saved = []
    monkeypatch.setattr(figures, "_save", lambda fig, out: saved.append(fig) or out)
    plot_training_curves([str(a)], str(tmp_path / "curves.png"))
    panels = {ax.get_ylabel(): ax for ax in saved[0].axes if ax.lines}
    assert sorted(panels) == ["eval/score", "reward/mean"]
    line = panels["eval/score"].lines[0]
    assert list(line.get_xdata()) == [2, 4, 6] and line.get_marker() == "."


def test_curves_with_no_known_keys_still_writes_png(tmp_path):
    a = tmp_path / "metrics.jsonl"
    a.write_text(json.dumps({"step": 0, "something/else": 1.0}) + "\n")
    assert _is_png(plot_training_curves([str(a)], str(tmp_path / "empty.png")))


def test_table3_png_and_validation(tmp_path):
    shares = {"grpo": [4.7, 4.3, 40.1, 14.5, 36.4], "softmax": [7.3, 33.9, 11.9, 36.9, 10.0]}
    assert _is_png(plot_table3(shares, str(tmp_path / "t3.png"), title="test"))
    with pytest.raises(ValueError, match="expected 5"):
        plot_table3({"grpo": [50.0, 50.0]}, str(tmp_path / "bad.png"))


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.83, 1.0])
def test_mean_abs_advantage_hand_values_M2(p):
    # M = 2: only a split group (prob 2p(1-p)) has nonzero advantages, A = +-a:
    # softmax a = tanh(1 / (2 tau)), GRPO a = 1 (up to eps); REINFORCE E|R - p| = 2p(1-p) for any M.
    split = 2 * p * (1 - p)
    assert mean_abs_advantage("softmax", 2, p, tau=0.3).item() == pytest.approx(split * math.tanh(1 / 0.6), abs=1e-12)
    assert mean_abs_advantage("grpo", 2, p).item() == pytest.approx(split, abs=1e-5)
    assert mean_abs_advantage("reinforce", 5, p).item() == pytest.approx(split, abs=1e-12)


@pytest.mark.parametrize("name,kw", [("softmax", {"tau": 0.3}), ("grpo", {}), ("maxrl", {})])
def test_mean_abs_advantage_matches_monte_carlo(name, kw):
    M, p = 8, 0.3
    g = torch.Generator().manual_seed(0)
    rewards = (torch.rand(100_000, M, generator=g) < p).float()  # (G, M)
    mc = compute_advantages(name, rewards, **kw).abs().mean().item()
    exact = mean_abs_advantage(name, M, torch.tensor([p]), **kw).item()
    assert exact == pytest.approx(mc, rel=0.01)


def test_run_table3_averages_steps_with_budget(tmp_path):
    from tools.figures import run_table3

    bins = ["0-0.2", "0.2-0.5", "0.5-0.7", "0.7-0.9", "0.9-1"]
    steps = [[10, 20, 30, 40, 0], [30, 20, 10, 40, 0], [0, 0, 0, 0, 0]]  # last step: all groups zero advantage
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        "".join(
            json.dumps({"step": i, **{f"alloc/softmax/{b}": s for b, s in zip(bins, row)}}) + "\n"
            for i, row in enumerate(steps)
        )
    )
    assert run_table3(str(path), ["softmax"]) == {"softmax": [20.0, 20.0, 20.0, 40.0, 0.0]}
    with pytest.raises(ValueError, match="alloc/grpo"):
        run_table3(str(path), ["grpo"])
