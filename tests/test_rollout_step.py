"""The rollout step (rollout.py: ROLLOUTS, --rollout): plain, DAPO's dynamic sampling with refill, and the
overlong reward term, on a fake sampler whose rewards are written by hand; then under torchrun with 2 ranks
(tests/dist_rollout.py) and train.py end to end with exact resume.

    python -m pytest tests/test_rollout_step.py
"""

import json
import math
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from dist_rollout import FakeSampler, PatternTask, pattern_data

import config
import rollout
import tasks
import train
from plumbing.data import batch_indices
from rewards import REWARD_TERMS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_rollout(name, step, patterns, world=1, rank=0, **flags):
    """ROLLOUTS[name] at `step` on one rank, over prompts whose M rewards are `patterns` (prompt i: patterns[i])."""
    sampler = FakeSampler()
    train_set, train_ids = pattern_data(patterns)
    args = train.Args(**{"M": len(patterns[0]), "rollout_batch": 4, "max_tokens": 8, "seed": 3, **flags})
    batch = rollout.ROLLOUTS[name](
        step,
        sampler=sampler,
        task=PatternTask(),
        train_set=train_set,
        train_ids=train_ids,
        weights={"exact": 1.0},
        args=args,
        rank=rank,
        world=world,
        device=torch.device("cpu"),
    )
    return batch, sampler, args


def uids(batch):
    return [ex.uid for ex in batch.examples]


# ---- plain: the paper's step, as train.py's loop did it inline


def test_plain_samples_the_data_stream_with_the_step_seed():
    patterns = [[i % 2, 1, 0, 1] for i in range(10)]
    batch, sampler, args = run_rollout("plain", 2, patterns)
    want = batch_indices(2, 4, 10, seed=3)
    assert uids(batch) == [f"p{i}" for i in want] and batch.prompts == [[i] for i in want]
    assert sampler.calls == [(len(want), rollout.step_seed(3, 2, 0, 4, 4))]  # one generate, today's seed
    assert batch.scores["rewards"].tolist() == [patterns[i] for i in want]  # (G, M), gathered (one rank: its own)
    assert batch.scores["terms"]["exact"].tolist() == [patterns[i] for i in want] and batch.metrics == {}


# ---- dapo: drop the groups without signal, refill from new prompts


def test_dapo_with_signal_everywhere_is_plain_bit_for_bit():
    patterns = [[1, 0, 0, 1]] * 10
    plain, _, _ = run_rollout("plain", 1, patterns)
    dapo, sampler, _ = run_rollout("dapo", 1, patterns, rollout="dapo")
    assert len(sampler.calls) == 1 and uids(dapo) == uids(plain) and dapo.groups == plain.groups
    assert all(torch.equal(dapo.scores[k], plain.scores[k]) for k in ("rewards", "passed", "lengths", "cut"))
    assert dapo.metrics == {
        "rollout/rounds": 1,
        "rollout/groups_dropped": 0,
        "rollout/signal_frac_first": 1.0,
        "rollout/signal_frac": 1.0,
    }


def test_dapo_refills_until_every_group_has_signal():
    # even prompts: a constant group (all 0 or all 1); odd prompts: mixed
    patterns = [[0, 0, 0, 0] if i % 4 == 0 else [1, 1, 1, 1] if i % 4 == 2 else [1, 0, 0, 0] for i in range(40)]
    batch, sampler, args = run_rollout("dapo", 0, patterns, rollout="dapo", max_refill_rounds=5)
    drawn = [batch_indices(0, 4, 40, 3, r) for r in range(len(sampler.calls))]  # round r's prompts
    with_signal = [i for r in drawn for i in r if i % 2 == 1]
    assert sum(i % 2 for r in drawn[:-1] for i in r) < 4 <= len(with_signal)  # it stopped once the batch was full
    assert uids(batch) == [f"p{i}" for i in with_signal[:4]]  # oldest first
    assert batch.scores["rewards"].tolist() == [patterns[i] for i in with_signal[:4]]  # scores follow the groups
    assert [g[0].text for g in batch.groups] == ["0"] * 4 and batch.prompts == [[i] for i in with_signal[:4]]
    constant = sum(i % 2 == 0 for r in drawn for i in r)
    assert batch.metrics == {
        "rollout/rounds": len(drawn),
        "rollout/groups_dropped": constant,
        "rollout/signal_frac_first": sum(i % 2 for i in drawn[0]) / 4,
        "rollout/signal_frac": 1.0,
    }
    # every round's generate drew streams of its own: no sample of one round repeats another round's stream
    streams = [seed + j for n, seed in sampler.calls for j in range(n * args.M)]
    assert len(set(streams)) == len(streams) and [seed for _, seed in sampler.calls] == [
        rollout.step_seed(3, 0, 0, 4, 4, r) for r in range(len(drawn))
    ]


def test_dapo_past_its_rounds_fills_with_zero_signal_groups_and_says_so():
    patterns = [[0, 0, 0, 0]] * 7 + [[0, 1, 0, 0]]  # one prompt of eight has signal
    batch, sampler, args = run_rollout("dapo", 0, patterns, rollout="dapo", max_refill_rounds=2)
    assert len(sampler.calls) == 3  # the first round and both refills
    drawn = [i for r in range(3) for i in batch_indices(0, 4, 8, 3, r)]
    signal = [i for i in drawn if i == 7]
    chosen = (signal + [i for i in drawn if i != 7])[:4]  # the signal groups, then the zero-signal ones, oldest first
    assert uids(batch) == [f"p{i}" for i in chosen] and len(batch.groups) == 4  # the shape is fixed
    kept_signal = min(len(signal), 4)
    assert batch.metrics["rollout/signal_frac"] == kept_signal / 4 < 1
    assert batch.metrics["rollout/groups_dropped"] == (12 - len(signal)) - (4 - kept_signal)
    assert batch.metrics["rollout/rounds"] == 3


def test_dapo_reads_continuous_rewards_through_filter_std():
    patterns = [[0.5, 0.5001, 0.5, 0.5], [0.2, 0.9, 0.4, 0.1]] * 5  # even prompts: std 4e-5
    loose, _, _ = run_rollout("dapo", 0, patterns, rollout="dapo", max_refill_rounds=0, filter_std=1e-3)
    tight, _, _ = run_rollout("dapo", 0, patterns, rollout="dapo", max_refill_rounds=0, filter_std=1e-6)
    drawn = batch_indices(0, 4, 10, 3)
    odd = sum(i % 2 for i in drawn)
    assert loose.metrics["rollout/signal_frac_first"] == odd / 4 and tight.metrics["rollout/signal_frac_first"] == 1


# ---- the overlong term: DAPO Eq. 13, plus 1


@pytest.mark.parametrize("n_tokens, want", [(10, 1.0), (15, 1.0), (16, 0.8), (18, 0.4), (20, 0.0)])
def test_overlong_term_by_hand(n_tokens, want):
    task = tasks.get_task("arith")
    example = task.load("test", limit=1)[0]
    # L_max 20, L_cache 5: free up to 15 tokens, then (15 - L) / 5 of Eq. 13, plus 1
    got = task.reward("12", example, kind="overlong", n_tokens=n_tokens, max_tokens=20, overlong_buffer=5)
    assert got == pytest.approx(want)
    assert REWARD_TERMS["overlong"](
        "12", example, n_tokens=n_tokens, max_tokens=20, overlong_buffer=5
    ) == pytest.approx(want)


def test_score_hands_the_token_count_to_a_term_that_declares_it():
    task = tasks.get_task("arith")
    example = task.load("test", limit=1)[0]
    from rollout import Completion

    right = f"<think>add</think> {example.gold}"
    groups = [[Completion([1] * n, [0.0] * n, right, "stop") for n in (4, 8, 10, 12)]]
    scores = rollout.score(
        task,
        [example],
        groups,
        {"exact": 1.0, "overlong": 1.0},
        torch.device("cpu"),
        dict(max_tokens=12, overlong_buffer=4),
    )
    assert scores["terms"]["overlong"].tolist() == [[1.0, 1.0, 0.5, 0.0]]  # free up to 8 tokens, 0 at 12
    assert scores["rewards"].tolist() == [[2.0, 2.0, 1.5, 1.0]]  # exact + overlong
    with pytest.raises(TypeError):  # asked without the count, the term does not guess one
        REWARD_TERMS["overlong"]("x", example)


# ---- flags


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(rollout="nope"), "--rollout must be one of"),
        (dict(rollout="dapo", max_refill_rounds=16), "--max-refill-rounds must be in [0, 15]"),
        (dict(rollout="tools", max_tool_calls=16), "--max-tool-calls must be in [0, 15]"),
        (dict(rollout="dapo", filter_std=-1.0), "--filter-std must be finite and >= 0"),
        (dict(overlong_buffer=4), "read by the overlong reward term only"),
        (
            dict(reward_weights="exact=1,overlong=1", overlong_buffer=48),
            "--overlong-buffer must be in [0, --max-tokens)",
        ),
    ],
)
def test_rollout_flags_are_checked_in_one_line(flags, message, tmp_path):
    error = config.check_args(replace(train.Args(out_dir=str(tmp_path / "run")), **flags))
    assert error is not None and message in error and "\n" not in error
    assert config.check_args(train.Args(out_dir=str(tmp_path / "run"), rollout="dapo", filter_std=0.1)) is None
    assert (
        config.check_args(
            train.Args(out_dir=str(tmp_path / "run"), reward_weights="exact=1,overlong=1", overlong_buffer=8)
        )
        is None
    )
    assert "dapo" in config.choices()["rollout"] and "plain" in rollout.ROLLOUTS


# ---- train.py end to end, one process and torchrun


def read_metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.fixture
def digits(monkeypatch):
    """dist_train's digit bandit, which also scores the reward terms (with their lengths) as tasks.Task does."""
    from dist_train import DigitTask

    class Digits(DigitTask):
        def reward(self, completion, example, kind="exact", **lengths):
            return (
                super().reward(completion, example)
                if kind == "exact"
                else REWARD_TERMS[kind](completion, example, **lengths)
            )

    monkeypatch.setitem(tasks.TASKS, "digits", Digits())


def dapo_args(model_dir, out_dir, **overrides):
    base = dict(
        task="digits",
        model=model_dir,
        M=4,
        rollout_batch=4,
        micro_batch=8,
        steps=3,
        max_tokens=4,
        lr=3e-3,
        warmup_steps=0,
        eval_examples=0,
        dtype="float32",
        out_dir=str(out_dir),
        rollout="dapo",
        max_refill_rounds=2,
        reward_weights="exact=1,overlong=0.5",
        overlong_buffer=2,
    )
    return train.Args(**{**base, **overrides})


def test_dapo_run_resumes_exactly(tiny_model_dir, tmp_path, digits):
    """3 straight steps equal 2 steps and a --resume: the refills a step consumes are a function of its number."""
    train.main(dapo_args(tiny_model_dir, tmp_path / "straight"))
    train.main(dapo_args(tiny_model_dir, tmp_path / "split", steps=2))
    train.main(dapo_args(tiny_model_dir, tmp_path / "split", resume=str(tmp_path / "split")))

    def comparable(rows):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rows]

    straight = read_metrics(tmp_path / "straight" / "metrics.jsonl")
    assert len(straight) == 3 and comparable(straight) == comparable(read_metrics(tmp_path / "split" / "metrics.jsonl"))
    assert read_metrics(tmp_path / "split" / "completions.jsonl") == read_metrics(
        tmp_path / "straight" / "completions.jsonl"
    )
    assert any(r["rollout/rounds"] > 1 for r in straight)  # the digit bandit leaves many groups constant
    assert all(r["rollout/signal_frac"] >= r["rollout/signal_frac_first"] for r in straight)
    assert all(0 <= r["reward/overlong"] <= 1 and math.isfinite(r["loss/pg"]) for r in straight)
    # the trained batch has signal exactly where signal_frac says: zero_group_frac is its complement
    assert all(r["adv/zero_group_frac"] == pytest.approx(1 - r["rollout/signal_frac"]) for r in straight)


class Curriculum:
    """A stateful --rollout entry made in one file: each step samples the prompts with the fewest passes so far (ties
    in an order turned by the step), and its state, the per-prompt pass counts, is checkpoint state."""

    def __init__(self):
        self.passes = {}  # prompt index -> samples that passed, over the run

    def __call__(self, step: int, **run) -> rollout.Batch:
        n, world, size = len(run["train_set"]), run["world"], run["args"].rollout_batch
        indices = sorted(range(n), key=lambda i: (self.passes.get(i, 0), (i + 5 * step) % n))[:size]
        batch = rollout.sample_round(step, 0, indices, **run)
        gathered = [i for q in range(world) for i in indices[q::world]]  # the scores' rank order
        for i, passed in zip(gathered, batch.scores["passed"].sum(-1).tolist()):
            self.passes[i] = self.passes.get(i, 0) + int(passed)
        batch.metrics = {"curriculum/passes": sum(self.passes.values()), "curriculum/first": indices[0]}
        return batch

    def state_dict(self) -> dict:
        return {"passes": dict(self.passes)}

    def load_state_dict(self, state: dict):
        self.passes = dict(state["passes"])


def test_a_stateful_rollout_entry_resumes_exactly(tiny_model_dir, tmp_path, digits, monkeypatch):
    """ROLLOUTS' one hook: a class entry is made once a run, its state_dict() saved in trainer_state.pt and given back
    to load_state_dict() at --resume, so 4 straight steps equal 2 steps and a resume, to the bit."""
    from safetensors.torch import load_file

    from plumbing.checkpoint import read_trainer_state
    from tests.test_train import tiny_args

    monkeypatch.setitem(rollout.ROLLOUTS, "curriculum", Curriculum)
    split = tmp_path / "split"
    train.main(tiny_args(tiny_model_dir, tmp_path / "straight", rollout="curriculum", steps=4))
    train.main(tiny_args(tiny_model_dir, split, rollout="curriculum", steps=2))
    saved = read_trainer_state(str(split / "checkpoint-000002"))["rollout"]
    train.main(tiny_args(tiny_model_dir, split, rollout="curriculum", steps=4, resume=str(split)))

    def comparable(rows):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rows]

    straight = read_metrics(tmp_path / "straight" / "metrics.jsonl")
    assert len(straight) == 4 and comparable(straight) == comparable(read_metrics(tmp_path / "split" / "metrics.jsonl"))
    assert read_metrics(tmp_path / "split" / "completions.jsonl") == read_metrics(
        tmp_path / "straight" / "completions.jsonl"
    )
    a, b = (load_file(tmp_path / run / "checkpoint-000004" / "model.safetensors") for run in ("straight", "split"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the state mattered: it was saved, and the steps after the resume read it
    assert sum(saved["passes"].values()) == straight[1]["curriculum/passes"] > 0
    assert straight[-1]["curriculum/passes"] > straight[1]["curriculum/passes"]


def torchrun(*job):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            os.path.join(ROOT, "tests", "dist_rollout.py"),
            *job,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_ranks_agree_under_torchrun_2(tiny_model_dir, tmp_path):
    """The fake sampler on 2 ranks: the same rounds, metrics and gathered scores on both, each rank's share its own
    samples, all with signal; then train.py with --rollout dapo for 2 steps (its collectives in step: it ends)."""
    result = torchrun("refill", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert ranks[0]["metrics"] == ranks[1]["metrics"] and ranks[0]["metrics"]["rollout/rounds"] > 1
    assert torch.equal(ranks[0]["rewards"], ranks[1]["rewards"])  # the gathered batch: the same on both
    for r, share in enumerate(ranks):
        assert share["rewards"][2 * r : 2 * r + 2].tolist() == share["own"]  # this rank's rows are its own samples
        assert all(len(set(p)) > 1 for p in share["own"])  # every group with signal
    assert ranks[0]["uids"] != ranks[1]["uids"]
    result = torchrun("e2e", str(tmp_path / "run"), tiny_model_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and all(r["rollout/rounds"] >= 1 for r in rows)
    assert all(r["adv/zero_group_frac"] == pytest.approx(1 - r["rollout/signal_frac"]) for r in rows)


def test_eval_py_scores_a_length_aware_term_as_training_does(monkeypatch):
    # eval.evaluate hands each reply's token count (and --max-tokens) to the term, as rollout.score does; before, a
    # term declaring n_tokens was a TypeError there (scored 0 and counted, or raised under strict rewards)
    import eval as eval_py
    from rollout import Completion

    monkeypatch.setattr(eval_py, "encode_prompts", lambda tokenizer, batch: [[1] for _ in batch])
    task = tasks.get_task("arith")
    example = task.load("test", limit=1)[0]

    class Sampler:
        tokenizer = None

        def generate(self, prompts, *, n, max_tokens, temperature=1.0, top_p=1.0, seed=None):
            return [
                [Completion([1] * 10, [0.0] * 10, f"<think>add</think> {example.gold}", "stop")] * n for _ in prompts
            ]

    result = eval_py.evaluate(
        Sampler(), task, [example], max_tokens=12, weights={"exact": 1.0, "overlong": 1.0}, progress=False
    )
    # 10 tokens with --max-tokens 12 and the default buffer of 12 // 5 = 2 tokens: free up to 10, so 1.0
    record = result["examples"][0]
    assert record["terms"]["overlong"] == 1.0 and record["reward"] == 2.0
    result = eval_py.evaluate(
        Sampler(), task, [example], max_tokens=11, weights={"exact": 1.0, "overlong": 1.0}, progress=False
    )  # buffer 2, free up to 9: 10 tokens is half way down the ramp
    record = result["examples"][0]
    assert record["terms"]["overlong"] == pytest.approx(0.5) and record["reward"] == pytest.approx(1.5)


class NumpyCurriculum(Curriculum):
    def state_dict(self) -> dict:
        import numpy as np

        return {"passes": np.array(list(self.passes.values()))}  # torch.save takes it; weights_only refuses it


def test_a_rollout_state_a_resume_cannot_load_is_refused_at_the_first_save(
    tiny_model_dir, tmp_path, digits, monkeypatch
):
    """Issue 61, class 4: a state_dict() holding a numpy array saved fine; every checkpoint then refused to resume."""
    from tests.test_train import tiny_args

    monkeypatch.setitem(rollout.ROLLOUTS, "numpy-curriculum", NumpyCurriculum)
    with pytest.raises(
        train.CheckpointError, match=r"--rollout numpy-curriculum: its state_dict\(\) holds what a resume"
    ):
        train.main(tiny_args(tiny_model_dir, tmp_path / "run", rollout="numpy-curriculum", steps=1))
    assert not [name for name in os.listdir(tmp_path / "run") if "checkpoint" in name]  # nothing half saved


def test_a_resume_whose_stateful_rollout_has_no_saved_state_is_one_line(tiny_model_dir, tmp_path, digits, monkeypatch):
    """Issue 61, class 4: a plain run resumed with a stateful --rollout was a 20-line KeyError."""
    from tests.test_train import tiny_args

    monkeypatch.setitem(rollout.ROLLOUTS, "curriculum", Curriculum)
    train.main(tiny_args(tiny_model_dir, tmp_path / "run", steps=1))
    resumed = tiny_args(tiny_model_dir, tmp_path / "run", rollout="curriculum", steps=2, resume=str(tmp_path / "run"))
    with pytest.raises(train.CheckpointError, match="holds no state for --rollout curriculum") as info:
        train.main(resumed)
    assert "it was saved by --rollout plain" in str(info.value) and "\n" not in str(info.value)
