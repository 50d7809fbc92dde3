"""Sampled evaluation: mean@K and pass@k by hand, K samples per prompt, two held-out sets in one run,
resume, torchrun with 2 ranks against one process, and train.py's evaluation against eval.py on its checkpoint."""

import json
import math
import os
import subprocess
import sys

import pytest

import config
import eval as evaluation
import tasks
import train
from eval import evaluate, sampled_scores

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")


class SayTask:
    """Reward 1 when the completion starts with a digit; loads as tasks.Task.load does (eval.py passes demos)."""

    name, has_verifier, hub_id, held_out_only = "say", True, None, False

    def load(self, split="train", *, data_file=None, limit=None, seed=0, demos=False, demo_file=None):
        n = limit or (16 if split == "train" else 8)
        return [
            tasks.Example(
                prompt=[{"role": "user", "content": f"say {split} {i}" + " more" * (i % 3)}],
                gold="digit",
                reference="7",
                uid=f"{split}-{i}",
            )
            for i in range(n)
        ]

    def reward(self, completion, example, kind="exact"):
        return float(completion[:1] in "0123456789") if completion else 0.0

    def extract(self, completion):
        return completion[:1]


@pytest.fixture
def say(monkeypatch):
    monkeypatch.setitem(tasks.TASKS, "say", SayTask())
    return "say"


def run_args(model_dir, out_dir, **overrides):
    base = dict(
        task="say",
        model=model_dir,
        M=4,
        rollout_batch=4,
        micro_batch=8,
        steps=2,
        max_tokens=4,
        lr=3e-3,
        warmup_steps=0,
        eval_examples=5,
        eval_every=2,
        eval_samples=4,
        eval_temperature=0.6,
        dtype="float32",
        out_dir=str(out_dir),
    )
    return train.Args(**{**base, **overrides})


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


# ---- the arithmetic


def test_mean_at_k_interval_and_pass_at_k_against_hand_counts():
    rewards = [[1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]
    got = sampled_scores(rewards, [[r == 1 for r in row] for row in rewards])
    assert got["mean@4"] == pytest.approx(0.5)  # (2 + 0 + 4) / 12
    half = 1.96 * 0.5 / math.sqrt(3)  # per-prompt means 0.5, 0, 1: sample std 0.5
    assert got["mean@4_ci95_low"] == pytest.approx(0.5 - half) and got["mean@4_ci95_high"] == pytest.approx(0.5 + half)
    # pass@2 of 2 passes in 4: 1 - C(2,2)/C(4,2) = 5/6; of 0 passes 0; of 4 passes 1
    assert got["pass@k"] == pytest.approx({"1": 0.5, "2": (5 / 6 + 0 + 1) / 3, "4": 2 / 3})
    three = sampled_scores([[1, 0, 0]], [[True, False, False]])  # K = 3: k = 1, 2 and K itself
    assert three["pass@k"] == pytest.approx({"1": 1 / 3, "2": 2 / 3, "3": 1.0})
    assert three["mean@3_ci95_low"] == three["mean@3_ci95_high"] == pytest.approx(1 / 3)  # one prompt: no spread
    similarity = sampled_scores([[0.2, 0.4], [0.6, 0.8]], None)  # no verifier: the mean reward, no pass@k
    assert similarity["mean@2"] == pytest.approx(0.5) and "pass@k" not in similarity


def test_eval_seed_is_the_run_seed_and_step():
    assert evaluation.eval_seed(0, 5) != evaluation.eval_seed(0, 6) != evaluation.eval_seed(1, 5)
    assert evaluation.eval_seed(0, 5) == evaluation.eval_seed(0, 5)


# ---- K samples per prompt, shards


def test_k_samples_per_prompt_and_a_shard_draws_what_one_process_draws(tiny_model_dir):
    from rollout import make_sampler

    sampler = make_sampler("hf", tiny_model_dir, dtype="float32", seed=0)
    rows = SayTask().load("test", limit=5)
    whole = evaluate(sampler, SayTask(), rows, samples=3, max_tokens=5, seed=77, temperature=0.6, progress=False)
    records = whole["examples"]
    assert all(len(r["samples"]) == 3 and [s["reward"] for s in r["samples"]] == r["sampled_rewards"] for r in records)
    assert all(s["reward"] == SayTask().reward(s["completion"], None) for r in records for s in r["samples"])
    assert len({s["completion"] for r in records for s in r["samples"]}) > 5  # distinct streams, not one repeated
    tail = evaluate(
        sampler, SayTask(), rows[2:], samples=3, max_tokens=5, seed=77, temperature=0.6, first=2, progress=False
    )["examples"]
    assert [r["samples"] for r in tail] == [r["samples"] for r in records[2:]]
    moved = evaluate(sampler, SayTask(), rows[2:], samples=3, max_tokens=5, seed=77, temperature=0.6, progress=False)[
        "examples"
    ]
    assert [r["samples"] for r in moved] != [r["samples"] for r in records[2:]]  # `first` is what lines them up
    # batches of 2: each batch's streams hang on its rows' places, whatever the batch size
    opts = dict(samples=3, max_tokens=5, seed=77, temperature=0.6, progress=False)
    batched = evaluate(sampler, SayTask(), rows, batch_size=2, **opts)["examples"]
    assert [r["samples"] for r in batched] == [r["samples"] for r in records]
    passes = [[s["passed"] for s in r["samples"]] for r in records]
    assert whole["summary"]["mean@3"] == sum(map(sum, passes)) / 15
    assert whole["summary"]["pass@k"] == sampled_scores([r["sampled_rewards"] for r in records], passes)["pass@k"]
    sampler.close()


# ---- train.py: two sets, resume, eval.py on its checkpoint


def test_two_held_out_sets_each_scored_and_logged(tiny_model_dir, tmp_path, say):
    aime = os.path.join(FIXTURES, "aime24.jsonl")
    final = train.main(run_args(tiny_model_dir, tmp_path, eval_tasks=f"aime24={aime}"))
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert "eval/score" not in rows[0] and "eval/say/mean@4" not in rows[0]  # step 1: not an evaluation step
    logged = rows[1]
    for name in ("say", "aime24"):
        for key in ("mean@4", "mean@4_ci95_low", "mean@4_ci95_high", "pass@1", "pass@2", "pass@4"):
            assert f"eval/{name}/{key}" in logged, (name, key)
    assert "eval/score" in logged and "eval/aime24/greedy" in logged and "eval/say/greedy" not in logged
    generations = read_jsonl(tmp_path / "eval-000002.jsonl")
    assert [r["set"] for r in generations] == ["say"] * 5 + ["aime24"] * 2  # every prompt of both, set by set
    for name, n in (("say", 5), ("aime24", 2)):
        mine = [r for r in generations if r["set"] == name]
        assert all(len(r["samples"]) == 4 for r in mine)
        passed = sum(s["passed"] for r in mine for s in r["samples"])
        assert logged[f"eval/{name}/mean@4"] == passed / (4 * n)  # the logged replies, counted by hand
        assert logged[f"eval/{name}/pass@1"] == pytest.approx(passed / (4 * n))
    assert logged["eval/score"] == sum(r["reward"] for r in generations if r["set"] == "say") / 5
    evals = json.loads((tmp_path / "eval.json").read_text())
    assert set(evals) == {"before", "after", "sets"} and evals["after"] == logged["eval/score"]
    assert evals["sets"]["after"] == {k: v for k, v in logged.items() if k.startswith("eval/") and k != "eval/score"}
    assert final["eval/after"] == logged["eval/score"]


def test_a_resumed_run_scores_as_the_straight_one(tiny_model_dir, tmp_path, say):
    common = dict(steps=4, eval_examples=3, eval_samples=2)
    train.main(run_args(tiny_model_dir, tmp_path / "straight", **common))
    train.main(run_args(tiny_model_dir, tmp_path / "split", **{**common, "steps": 3}))
    train.main(run_args(tiny_model_dir, tmp_path / "split", **common, resume=str(tmp_path / "split")))

    def scores(run):
        return [
            {k: v for k, v in r.items() if k.startswith("eval/")} for r in read_jsonl(tmp_path / run / "metrics.jsonl")
        ]

    assert scores("straight") == scores("split") and "eval/say/mean@2" in scores("straight")[3]
    for step in ("000002", "000004"):
        assert read_jsonl(tmp_path / "split" / f"eval-{step}.jsonl") == read_jsonl(
            tmp_path / "straight" / f"eval-{step}.jsonl"
        )


def test_train_evaluation_equals_eval_py_on_its_checkpoint(tiny_model_dir, tmp_path, say):
    """The HF sampler in bf16 as eval.py runs it: the evaluation at step 2 and eval.py on checkpoint-000002, with the
    run's seed, give the same samples and the same numbers, to the bit."""
    train.main(run_args(tiny_model_dir, tmp_path / "run", dtype="bfloat16", sampler="hf", seed=3, eval_top_p=0.9))
    logged = read_jsonl(tmp_path / "run" / "metrics.jsonl")[1]
    out = tmp_path / "eval.json"
    result = evaluation.main(
        [
            "--model",
            str(tmp_path / "run" / "checkpoint-000002"),
            "--task",
            "say",
            "--limit",
            "5",
            "--samples",
            "4",
            "--temperature",
            "0.6",
            "--top-p",
            "0.9",
            "--max-tokens",
            "4",
            "--seed",
            "3",
            "--sampler",
            "hf",
            "--out",
            str(out),
        ]
    )
    summary = result["summary"]
    trained = read_jsonl(tmp_path / "run" / "eval-000002.jsonl")
    assert [r["samples"] for r in result["examples"]] == [r["samples"] for r in trained]
    assert summary["mean@4"] == logged["eval/say/mean@4"]
    assert summary["mean@4_ci95_low"] == logged["eval/say/mean@4_ci95_low"]
    assert all(summary["pass@k"][k] == logged[f"eval/say/pass@{k}"] for k in ("1", "2", "4"))
    assert summary["pass@1"] == logged["eval/score"]  # the greedy score too


# ---- torchrun


@pytest.mark.slow
def test_two_ranks_score_as_one_process(tiny_model_dir, tmp_path):
    runs = {}
    for launch in ("one", "two"):
        runner = [sys.executable] + (
            ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"] if launch == "two" else []
        )
        result = subprocess.run(
            [*runner, os.path.join(ROOT, "tests", "dist_eval.py"), str(tmp_path / launch), tiny_model_dir],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        runs[launch] = (
            json.loads((tmp_path / launch / "eval.json").read_text()),
            read_jsonl(tmp_path / launch / "eval-000000.jsonl"),
        )
    (one, one_rows), (two, two_rows) = runs["one"], runs["two"]
    assert one["before"] == two["before"] and one["sets"]["before"] == two["sets"]["before"]  # 5 prompts: 3 + 2
    assert [r["samples"] for r in one_rows] == [r["samples"] for r in two_rows]
    assert "eval/aime24/mean@3" in one["sets"]["before"]


# ---- bad input


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(eval_tasks="nope"), "--eval-tasks: unknown task 'nope'"),
        (dict(eval_tasks="math500=/no/such.jsonl"), "does not exist"),
        (dict(eval_tasks="aime24,aime24"), "given twice"),
        (dict(eval_samples=-1), "--eval-samples must be >= 0"),
        (dict(eval_temperature=0.0), "--eval-temperature"),
        (dict(eval_top_p=1.5), "--eval-top-p"),
        (dict(eval_samples=4, eval_examples=0), "need --eval-examples >= 1"),
        (dict(task="math500"), "held-out benchmark"),
    ],
)
def test_bad_eval_flags_are_one_line(tmp_path, overrides, message):
    error = config.check_args(train.Args(**{"out_dir": str(tmp_path / "run"), **overrides}))
    assert error is not None and message in error and "\n" not in error


def test_benchmarks_load_whole_from_a_file_and_verify_with_math_verify(capsys):
    for name, n in (("math500", 3), ("aime24", 2)):
        task = tasks.get_task(name)
        rows = task.load("test", data_file=os.path.join(FIXTURES, f"{name}.jsonl"))
        assert len(rows) == n and "\\boxed{}" in rows[0].prompt[-1]["content"]  # every row held out: none by hash
        with pytest.raises(SystemExit) as exit_info:  # eval.py's door: a benchmark is scored, not its train split
            evaluation.main(["--model", "x", "--task", name, "--split", "train"])
        assert exit_info.value.code == 2 and "held-out benchmark" in capsys.readouterr().err
    math500 = tasks.get_task("math500").load("test", data_file=os.path.join(FIXTURES, "math500.jsonl"))
    fraction = next(ex for ex in math500 if ex.gold == "\\frac{3}{4}")
    assert tasks.get_task("math500").reward("So the sum is \\boxed{0.75}.", fraction) == 1.0  # math-verify: equal
    assert tasks.get_task("math500").reward("\\boxed{\\frac{2}{3}}", fraction) == 0.0
    aime = tasks.get_task("aime24").load("test", data_file=os.path.join(FIXTURES, "aime24.jsonl"))
    assert tasks.get_task("aime24").reward("\\boxed{24}", next(ex for ex in aime if ex.gold == "024")) == 1.0
    for name in ("math500", "aime24", "aime25"):
        assert tasks.TASKS[name].hub_id and tasks.TASKS[name].held_out_only


# ---- the curves


@pytest.mark.curves
def test_curves_draw_the_sampled_mean_with_its_band_beside_the_greedy_score(tmp_path, monkeypatch):
    import matplotlib.axes

    from tools.figures import plot_training_curves

    rows = [
        {"step": 1, "reward/mean": 0.1},
        {
            "step": 2,
            "reward/mean": 0.2,
            "eval/score": 0.25,
            "eval/arith/mean@8": 0.3,
            "eval/arith/mean@8_ci95_low": 0.2,
            "eval/arith/mean@8_ci95_high": 0.4,
            "eval/aime24/greedy": 0.0,
            "eval/aime24/mean@8": 0.05,
            "eval/aime24/mean@8_ci95_low": 0.0,
            "eval/aime24/mean@8_ci95_high": 0.1,
        },
        {"step": 3, "reward/mean": 0.3},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bands, lines = [], []
    fill_between, plot = matplotlib.axes.Axes.fill_between, matplotlib.axes.Axes.plot
    monkeypatch.setattr(
        matplotlib.axes.Axes,
        "fill_between",
        lambda ax, x, low, high, **kw: (
            bands.append((ax.get_title(), list(low), list(high))) or fill_between(ax, x, low, high, **kw)
        ),
    )
    monkeypatch.setattr(
        matplotlib.axes.Axes, "plot", lambda ax, *a, **kw: lines.append((ax.get_ylabel(), a, kw)) or plot(ax, *a, **kw)
    )
    plot_training_curves([str(path)], str(tmp_path / "curves.png"), labels=["run"])
    assert sorted((low, high) for _, low, high in bands) == [([0.0], [0.1]), ([0.2], [0.4])]
    greedy = [(a[1], kw["label"]) for _, a, kw in lines if kw.get("linestyle") == "--"]
    assert sorted(greedy) == [([0.0], "run greedy"), ([0.25], "run greedy")]  # each set's own greedy score
    assert (tmp_path / "curves.png").stat().st_size > 0
