"""train.py end to end on the tiny model: flags, checkpoints, exact resume, learning, FSDP2 parity.

The single-process runs call train.main in this process with a toy task registered in tasks.TASKS
(dist_train.DigitTask: reward 1 when the completion starts with a digit); the torchrun runs go
through tests/dist_train.py. float32 everywhere a comparison must be exact.
"""

import hashlib
import json
import math
import os
import pickle
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import warm_python
from dist_train import DigitTask
from torch.distributed.checkpoint.metadata import Metadata

import config
import plumbing.data
import rollout
import speed.allocator
import speed.backward
import speed.compile
import tasks
import train
from advantage import compute_advantages, estimator_params
from loss import AGGREGATIONS
from tasks import digest, in_test

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def digits(monkeypatch):
    monkeypatch.setitem(tasks.TASKS, "digits", DigitTask())
    return "digits"


def tiny_args(model_dir, out_dir, **overrides):
    base = dict(
        task="digits",
        model=model_dir,
        M=4,
        rollout_batch=4,
        micro_batch=8,
        steps=2,
        max_tokens=4,
        lr=3e-3,
        warmup_steps=0,
        eval_examples=0,
        dtype="float32",
        out_dir=str(out_dir),
    )
    return train.Args(**{**base, **overrides})


def read_metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def cli(*flags, env=None):
    return warm_python.run_script("train.py", *flags, env=env)


# ---- flags, presets, checkpoints on disk (fast)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--advantage", "nope"], "--advantage must be one of"),
        (["--tau", "0"], "--tau must be"),
        (["--M", "0"], "--M must be >= 2"),
        (["--lr", "-1"], "--lr"),
        (["--task", "no_such_task"], "no_such_task"),
        (["--M", "eight"], "invalid int value"),
        (["--rollout-batch", "6", "--minibatches", "4"], "must divide evenly"),
        (["--sampler", "tpu"], "--sampler"),
        (["--resume", "/no/such/run"], "no checkpoint there"),
        (["--data-file", "/no/such/file.jsonl"], "does not exist"),
        (["--no-such-flag"], "unrecognized arguments"),
    ],
)
def test_bad_flags_exit_2_with_one_line(flags, message, tmp_path, capsys):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        train.parse_args([*flags, "--out-dir", str(out)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.count("\n") == 1 and err.startswith("train.py: error: ") and message in err
    assert not out.exists()  # nothing written


@pytest.mark.skipif(torch.cuda.is_available(), reason="the rule is for CPU runs")
def test_compile_without_a_cpu_compiler_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no g++, c++ or clang++ to be found
    monkeypatch.setenv("CXX", "no-such-compiler")
    test_bad_flags_exit_2_with_one_line(["--compile"], "--compile on CPU needs a C++ compiler", tmp_path, capsys)
    monkeypatch.undo()
    assert train.parse_args(["--compile", "--out-dir", str(tmp_path / "run")]).compile  # with one, it is accepted


def test_every_loss_agg_and_estimator_hyperparameter_is_a_flag(tmp_path):
    for agg in AGGREGATIONS:
        assert train.parse_args(["--loss-agg", agg, "--out-dir", str(tmp_path / agg)]).loss_agg == agg
    assert train.Args().loss_agg == "token-mean"  # the paper's (Appendix B.1)
    for name, (default, kind) in estimator_params().items():  # --tau, --eps, --baseline: one flag each
        assert getattr(train.Args(), name) == default
        flag = "--" + name.replace("_", "-")
        assert getattr(train.parse_args([flag, "0.25", "--out-dir", str(tmp_path / name)]), name) == kind("0.25")
    assert train.parse_args(["--advantage", "grpo", "--eps", "0.5", "--out-dir", str(tmp_path / "g")]).eps == 0.5
    with pytest.raises(SystemExit):  # a bad hyperparameter stops at the command line
        train.parse_args(["--advantage", "softmax", "--tau", "nan", "--out-dir", str(tmp_path / "t")])


def test_a_bad_loss_agg_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train.parse_args(["--loss-agg", "seq-sum", "--out-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err == f"train.py: error: --loss-agg must be one of {', '.join(AGGREGATIONS)}\n"


def test_an_unloadable_model_is_one_line_and_exit_2(tmp_path):
    result = cli(
        "--model",
        str(tmp_path / "no_such_model"),
        "--eval-examples",
        "0",
        "--out-dir",
        str(tmp_path / "run"),
        env={"HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("train.py: error: cannot load model ") and "--model" in lines[0]
    assert "HF_HUB_OFFLINE" in lines[0]


def test_no_held_out_rows_is_said_in_one_line(tmp_path, capsys):
    rows = [{"question": f"What is {a} plus 1?", "answer": f"#### {a + 1}"} for a in range(20)]
    rows = [row for row in rows if not in_test(digest(row["question"]))]  # the hash split's train rows
    data = tmp_path / "small.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = train.Args(task="gsm8k", data_file=str(data), eval_examples=8, out_dir=str(tmp_path / "run"))
    task = tasks.get_task("gsm8k")
    train_set, test_set, _ = tasks.load_data(args, task, {"exact": 1.0})
    out = capsys.readouterr().out
    assert train_set and test_set == []
    assert out.count("\n") == 1 and "no held-out rows" in out and str(data) in out
    tasks.load_data(replace(args, eval_examples=0), task, {"exact": 1.0})
    assert capsys.readouterr().out == ""  # no evaluation asked for: nothing to say


def test_reward_errors_are_counted_and_summed_per_step(monkeypatch, capsys):
    import rewards

    monkeypatch.setattr(rewards, "STRICT", False)  # the training default: score 0 and count
    monkeypatch.setitem(rewards._errors, "printed", False)  # as at a run's start, whatever earlier tests counted
    rewards.take_error_count()
    fragile = rewards.safe_reward(lambda completion, example: 1.0 if completion == "ok" else int(completion))
    task = SimpleNamespace(has_verifier=True, reward=lambda text, ex, kind="exact": fragile(text, ex))
    groups = [[SimpleNamespace(text=text, token_ids=[5, 6], finish_reason="stop") for text in ("ok", "x", "y")]]
    scores = rollout.score(task, [None], groups, {"exact": 1.0}, torch.device("cpu"))
    assert scores["errors"] == 2 and scores["rewards"].tolist() == [[1.0, 0.0, 0.0]]
    assert rollout.score(task, [None], groups[:1], {"exact": 1.0}, torch.device("cpu"))["errors"] == 2  # per step
    assert capsys.readouterr().err.count("Traceback") == 1  # the first traceback of the run, once


def test_cli_bad_flag_prints_one_line_before_loading_anything():
    result = cli("--tau", "-0.5")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "train.py: error: --tau must be finite and > 0 (at least 1.2e-38, float32's smallest normal number: a "
        "smaller value rounds to 0), got -0.5"
    ]


def test_preset_then_explicit_flags_win(tmp_path):
    args = train.parse_args(["--task", "gsm8k", "--lr", "3e-6", "--out-dir", str(tmp_path / "r")])
    assert (args.model, args.M, args.tau, args.rollout_batch, args.max_tokens) == ("Qwen/Qwen2.5-1.5B", 8, 0.1, 64, 256)
    assert args.lr == 3e-6 and args.clip_low == 0.2 and args.clip_high == 0.28 and args.beta == 1e-3
    deepmath = train.parse_args(["--task", "deepmath", "--out-dir", str(tmp_path / "d")])
    assert (deepmath.M, deepmath.tau, deepmath.rollout_batch, deepmath.max_tokens) == (16, 0.3, 512, 1024)
    demo = train.parse_args(["--out-dir", str(tmp_path / "demo")])
    assert (demo.task, demo.model, demo.advantage, demo.lr) == ("arith", "smollm2-135m", "softmax", 2e-5)
    # the official configs' top_p, test_freq and gradient checkpointing in every paper preset; not in the demo
    for task in ("gsm8k", "countdown", "deepmath", "poetry", "meetingbank"):
        preset = train.parse_args(["--task", task, "--out-dir", str(tmp_path / task)])
        assert (preset.top_p, preset.eval_every, preset.grad_checkpointing) == (0.999, 25, True), task
    assert (demo.top_p, demo.eval_every, demo.grad_checkpointing) == (1.0, 0, False)
    off = train.parse_args(
        ["--task", "gsm8k", "--no-grad-checkpointing", "--eval-every", "0", "--out-dir", str(tmp_path / "off")]
    )
    assert (off.grad_checkpointing, off.eval_every) == (False, 0)


def test_help_lists_the_plan_eval_and_checkpointing_flags(capsys):
    with pytest.raises(SystemExit) as exit_info:
        train.parse_args(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    for flag in (
        "--grad-checkpointing",
        "--no-grad-checkpointing",
        "--eval-every",
        "--plan",
        "--plan-gpus",
        "--plan-gpu-gb",
        "--top-p",
    ):
        assert f"  {flag} " in out or f"  {flag}," in out or f" {flag}\n" in out, flag


def test_plan_prints_the_preset_and_exits_without_loading_or_refusing_a_taken_run_folder(tmp_path):
    taken = tmp_path / "run"
    taken.mkdir()
    (taken / "metrics.jsonl").write_text("")  # a run folder training would refuse
    result = cli(
        "--task",
        "deepmath",
        "--plan",
        "--plan-gpus",
        "16",
        "--plan-gpu-gb",
        "80",
        "--out-dir",
        str(taken),
        env={"HF_HUB_OFFLINE": "1"},
    )  # nothing to download: the shape is known without weights
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0] == "deepmath (Qwen/Qwen2.5-1.5B) on 16 x 80 GiB, with gradient checkpointing"
    peak = float(lines[-1].split("fits: peak ")[1].split(" GiB")[0])
    assert lines[-1].endswith(f"of 80 GiB per GPU ({peak / 80:.0%})") and peak < 80
    assert f"micro-batches of {config.PRESETS['deepmath']['micro_batch']}" in result.stdout
    assert (taken / "metrics.jsonl").read_text() == ""
    without = cli(
        "--task",
        "deepmath",
        "--plan",
        "--plan-gpus",
        "16",
        "--plan-gpu-gb",
        "80",
        "--no-grad-checkpointing",
        "--out-dir",
        str(taken),
    )
    assert without.returncode == 0 and "without gradient checkpointing" in without.stdout
    assert "every layer's saved tensors" in without.stdout and without.stdout != result.stdout
    bad = cli("--task", "deepmath", "--plan", "--plan-gpus", "0")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().splitlines() == ["train.py: error: --plan-gpus must be >= 1, got 0"]  # train.py's checks


def test_batch_indices_cover_each_epoch_once_and_reshuffle():
    n, batch = 10, 4
    first = [i for step in range(5) for i in plumbing.data.batch_indices(step, batch, n, seed=0)]  # 2 epochs exactly
    assert sorted(first[:10]) == list(range(10)) and sorted(first[10:]) == list(range(10))
    assert first[:10] != first[10:]
    assert plumbing.data.batch_indices(3, batch, n, seed=0) == first[12:16]  # a pure function of the step: resumable
    assert plumbing.data.batch_indices(0, batch, n, seed=1) != first[:4]


def fake_checkpoint(run, step, state=None):
    path = run / f"checkpoint-{step:06d}"
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "trainer").mkdir()  # the DCP folder: metadata of no tensors
    (path / "trainer" / ".metadata").write_bytes(pickle.dumps(Metadata({})))
    if state is not None:
        torch.save(state, path / "trainer_state.pt")
    return path


def test_find_checkpoint_picks_newest_complete_and_ignores_interrupted_saves(tmp_path):
    run = tmp_path / "run"
    fake_checkpoint(run, 5, {"step": 5})
    fake_checkpoint(run, 20, None)  # no trainer_state.pt: an incomplete folder is never picked
    (run / ".tmp-checkpoint-000030-abc").mkdir()  # a save killed before its rename
    newest = fake_checkpoint(run, 10, {"step": 10})
    assert train.find_checkpoint(str(run)) == str(newest)
    assert train.find_checkpoint(str(newest)) == str(newest)
    assert train.find_checkpoint(str(tmp_path / "empty")) is None


def test_corrupt_or_mismatched_checkpoint_is_refused_with_one_line(tmp_path, capsys):
    corrupt = fake_checkpoint(tmp_path / "a", 3)
    (corrupt / "trainer_state.pt").write_bytes(b"not a torch file")
    other = fake_checkpoint(tmp_path / "b", 3, {"step": 3, "args": {"task": "gsm8k", "model": "smollm2-135m"}})
    for ckpt, message in ((corrupt, "is corrupt"), (other, "was trained with --task gsm8k")):
        with pytest.raises(SystemExit) as exit_info:
            train.parse_args(["--resume", str(ckpt), "--out-dir", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.count("\n") == 1 and message in err


def test_existing_run_is_not_overwritten(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(SystemExit):
        train.parse_args(["--out-dir", str(tmp_path)])
    assert "already holds a run: continue it with --resume" in capsys.readouterr().err
    assert (tmp_path / "metrics.jsonl").read_text() == ""


@pytest.mark.slow
def test_missing_dataset_is_one_line_and_writes_nothing(tiny_model_dir, tmp_path):
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    bad_file = tmp_path / "bad.jsonl"
    bad_file.write_text('{"foo": 1}\n')
    for extra in ([], ["--data-file", str(bad_file)]):  # hub dataset unreachable; a file without its columns
        result = cli(
            "--task", "gsm8k", "--model", tiny_model_dir, "--out-dir", str(tmp_path / "run"), *extra, env=offline
        )
        last = result.stderr.strip().splitlines()[-1]
        assert result.returncode == 1 and last.startswith("train.py: error: ") and "gsm8k" in last
        assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_a_diverged_policy_stops_with_one_line(tiny_model_dir, tmp_path):
    """NaN weights (a run that blew up) give NaN logits: one line naming the cause, not samples from garbage."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        model.model.norm.weight.fill_(float("nan"))
    model.save_pretrained(tmp_path / "nan")
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(tmp_path / "nan")
    result = cli(
        "--task",
        "arith",
        "--model",
        str(tmp_path / "nan"),
        "--steps",
        "1",
        "--eval-examples",
        "0",
        "--max-tokens",
        "2",
        "--out-dir",
        str(tmp_path / "run"),
    )
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 1 and last.startswith("train.py: error: ") and "not finite" in last
    assert "Traceback" not in result.stderr


# ---- the loop on the tiny model


@pytest.mark.curves
def test_end_to_end_writes_metrics_and_a_loadable_checkpoint(tiny_model_dir, tmp_path, digits):
    from transformers import AutoModelForCausalLM

    final = train.main(tiny_args(tiny_model_dir, tmp_path, steps=2, beta=1e-3))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and final["step"] == 2
    for key in (
        "reward/mean",
        "reward/pass_rate",
        "adv/zero_group_frac",
        "response/len_max",
        "loss/pg",
        "loss/kl",
        "loss/clip_frac_high",
        "grad/norm",
        "lr",
        "sync/logprob_diff",
        "time/rollout",
        "perf/tokens_per_s",
    ):
        assert all(math.isfinite(r[key]) for r in rows), key
    assert all(r["sync/logprob_diff"] < 1e-4 for r in rows)  # float32 sampler holds the trainer's weights
    assert all(r["reward/errors"] == 0 for r in rows)  # a healthy reward: nothing caught
    assert all(r["reward/exact"] == r["reward/mean"] for r in rows)  # --reward exact: one term, weight 1
    vocab = AutoModelForCausalLM.from_pretrained(tiny_model_dir).config.vocab_size
    assert all(0 < r["policy/entropy"] <= math.log(vocab) for r in rows)
    assert not any(key.startswith("loss/is_") for key in rows[0])  # --is-correction none: nothing to report
    ckpt = tmp_path / "checkpoint-000002"
    assert sorted(os.listdir(tmp_path)) == [
        ".lock",
        "checkpoint-000002",
        "completions.jsonl",
        "curves.png",
        "metrics.jsonl",
    ]  # .lock: the run folder's lock file, released
    samples = read_metrics(tmp_path / "completions.jsonl")  # --log-completions 8: 8 of each step's 16 samples
    assert [r["step"] for r in samples] == [1] * 8 + [2] * 8
    assert set(samples[0]) == {
        "step",
        "uid",
        "prompt",
        "completion",
        "reward",
        "passed",
        "advantage",
        "length",
        "finish_reason",
    }
    first_group = samples[:4]  # M = 4: one prompt, its four samples, advantages summing to 0 (softmax: M w - 1)
    assert len({r["uid"] for r in first_group}) == 1 and abs(sum(r["advantage"] for r in first_group)) < 1e-5
    assert all(r["passed"] == (r["reward"] >= 0.5) and r["finish_reason"] in ("stop", "length") for r in samples)
    model = AutoModelForCausalLM.from_pretrained(ckpt)  # a plain HF folder, no conversion step
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not torch.equal(model.model.norm.weight, initial.model.norm.weight)  # it trained
    assert torch.load(ckpt / "trainer_state.pt", weights_only=False)["step"] == 2


def test_a_corrupt_model_file_in_a_checkpoint_raises_a_one_line_error(tiny_model_dir, tmp_path, digits):
    train.main(tiny_args(tiny_model_dir, tmp_path / "run", steps=1))
    ckpt = tmp_path / "run" / "checkpoint-000001"
    (ckpt / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(train.CheckpointError, match="is corrupt") as info:
        train.main(tiny_args(tiny_model_dir, tmp_path / "run", steps=2, resume=str(ckpt)))
    assert "\n" not in str(info.value)


def test_resume_gives_identical_weights_and_metrics(tiny_model_dir, tmp_path, digits):
    from safetensors.torch import load_file

    common = dict(steps=4, beta=1e-3, minibatches=2, ppo_epochs=2, micro_batch=3, warmup_steps=3)
    train.main(tiny_args(tiny_model_dir, tmp_path / "straight", **common))
    train.main(tiny_args(tiny_model_dir, tmp_path / "split", **{**common, "steps": 2}))
    train.main(tiny_args(tiny_model_dir, tmp_path / "split", **common, resume=str(tmp_path / "split")))

    def comparable(rows):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rows]

    straight = read_metrics(tmp_path / "straight" / "metrics.jsonl")
    split = read_metrics(tmp_path / "split" / "metrics.jsonl")
    assert len(straight) == 4 and comparable(straight) == comparable(split)
    samples = read_metrics(tmp_path / "straight" / "completions.jsonl")
    assert [r["step"] for r in samples] == [s for s in (1, 2, 3, 4) for _ in range(8)]
    assert read_metrics(tmp_path / "split" / "completions.jsonl") == samples  # resume appends the same rows
    a = load_file(tmp_path / "straight" / "checkpoint-000004" / "model.safetensors")
    b = load_file(tmp_path / "split" / "checkpoint-000004" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(r["loss/ratio_mean"] != 1.0 for r in straight)  # the off-policy path (old_logp pass) ran


def scheduled_lrs(**flags) -> list[float]:
    """The lr of each optimizer step of a run with `flags` (train.make_scheduler)."""
    args = replace(train.Args(), lr=1.0, **flags)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=args.lr)
    scheduler, out = train.make_scheduler(optimizer, args), []
    for _ in range(args.steps * args.ppo_epochs * args.minibatches):
        out.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return out


def test_the_cosine_schedule_keeps_the_warmup_then_falls_to_its_floor_at_the_last_step():
    got = scheduled_lrs(steps=10, warmup_steps=2, lr_schedule="cosine", min_lr_ratio=0.1)
    assert got[:3] == [0.5, 1.0, 1.0]  # the warmup, as before; its end is the cosine's top
    assert got[-1] == pytest.approx(0.1)  # the last optimizer step: --min-lr-ratio x --lr
    assert got[5] == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi * 3 / 7)) / 2)
    assert all(a >= b for a, b in zip(got[2:], got[3:]))
    two = scheduled_lrs(steps=5, ppo_epochs=2, warmup_steps=0, lr_schedule="cosine")  # counted in optimizer steps
    assert len(two) == 10 and two[0] == 1.0 and two[-1] == pytest.approx(0.0, abs=1e-12)
    # the paper's constant schedule, to the bit
    assert scheduled_lrs(steps=6, warmup_steps=3) == [min(1.0, (s + 1) / 3) for s in range(6)]
    assert scheduled_lrs(steps=3, warmup_steps=0) == [1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--min-lr-ratio", "0.1"], "--min-lr-ratio is read only with --lr-schedule cosine"),
        (["--lr-schedule", "cosine", "--min-lr-ratio", "1.5"], "--min-lr-ratio must be in [0, 1]"),
        (["--lr-schedule", "linear"], "--lr-schedule must be one of constant, cosine"),
    ],
)
def test_the_schedule_flags_refuse_what_they_cannot_mean(argv, message, capsys, tmp_path):
    from tests.test_nothing_silent import train_refuses

    assert message in train_refuses(argv, capsys, tmp_path)


def test_a_run_logs_its_cosine_lr(tiny_model_dir, tmp_path, digits):
    train.main(tiny_args(tiny_model_dir, tmp_path, steps=3, warmup_steps=1, lr_schedule="cosine", min_lr_ratio=0.5))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [row["lr"] for row in rows] == pytest.approx([3e-3, 3e-3, 1.5e-3])  # a 1-step warmup, the top, the floor


def test_resume_restores_the_rng_after_an_engine_reseeds_it(tiny_model_dir, tmp_path, digits, monkeypatch):
    """vLLM's engine set-up seeds python's, numpy's and torch's global RNGs (as this stand-in does): a resumed run
    continues with the states its checkpoint saved, not the engine's."""
    import random

    import numpy as np

    import rollout
    from plumbing.checkpoint import read_trainer_state, rng_state

    def reseeding_sampler(*args, **kwargs):
        sampler = make_sampler(*args, **kwargs)
        random.seed(99), np.random.seed(99), torch.manual_seed(99)
        return sampler

    make_sampler, check_probe = rollout.make_sampler, train.check_probe
    seen = []  # the RNG states when the run starts its first sync check, right after the sampler is built
    monkeypatch.setattr(
        train, "check_probe", lambda probe, before, *a: seen.append(rng_state()) or check_probe(probe, before, *a)
    )
    train.main(tiny_args(tiny_model_dir, tmp_path, steps=2))
    saved = read_trainer_state(tmp_path / "checkpoint-000002")["rng"][0]
    monkeypatch.setattr(train, "make_sampler", reseeding_sampler)
    seen.clear()
    train.main(tiny_args(tiny_model_dir, tmp_path, steps=3, resume=str(tmp_path)))
    assert seen[0]["python"] == saved["python"] and seen[0]["numpy"] == list(saved["numpy"])
    assert torch.equal(seen[0]["torch"], saved["torch"])
    torch.manual_seed(99)
    assert not torch.equal(saved["torch"], torch.get_rng_state())  # the check can fail: the engine's seed differs


def test_eval_every_logs_held_out_scores_at_absolute_steps_and_resume_keeps_them(tiny_model_dir, tmp_path, digits):
    common = dict(steps=4, eval_every=2, eval_examples=4, minibatches=2, micro_batch=3)
    train.main(tiny_args(tiny_model_dir, tmp_path / "straight", **common))
    train.main(tiny_args(tiny_model_dir, tmp_path / "split", **{**common, "steps": 3}))  # stops between evaluations
    train.main(tiny_args(tiny_model_dir, tmp_path / "split", **common, resume=str(tmp_path / "split")))

    def comparable(rows):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rows]

    straight = read_metrics(tmp_path / "straight" / "metrics.jsonl")
    split = read_metrics(tmp_path / "split" / "metrics.jsonl")
    assert [("eval/score" in r, "time/eval" in r) for r in straight] == [(False, False), (True, True)] * 2
    for run, steps in (("straight", (0, 2, 4)), ("split", (0, 2, 3, 4))):  # every evaluation's generations:
        files = sorted(f for f in os.listdir(tmp_path / run) if f.startswith("eval-"))  # before, during, after
        assert files == [f"eval-{step:06d}.jsonl" for step in steps]  # the split run's first "after" is step 3
    generations = read_metrics(tmp_path / "straight" / "eval-000004.jsonl")
    assert len(generations) == 4 and {r["step"] for r in generations} == {4}
    assert sum(r["reward"] >= 0.5 for r in generations) / 4 == straight[3]["eval/score"]
    assert read_metrics(tmp_path / "split" / "eval-000004.jsonl") == generations
    assert comparable(straight) == comparable(split)
    assert all(0 <= r["eval/score"] <= 1 for r in straight[1::2])
    for run in ("straight", "split"):  # the last step's score is the after-training score
        evals = json.loads((tmp_path / run / "eval.json").read_text())
        assert evals == {"before": evals["before"], "after": straight[3]["eval/score"]}
    no_test_set = tmp_path / "none"
    train.main(tiny_args(tiny_model_dir, no_test_set, steps=2, eval_every=1, eval_examples=0))
    assert all("eval/score" not in r for r in read_metrics(no_test_set / "metrics.jsonl"))
    assert not (no_test_set / "eval.json").exists()


def test_resume_after_a_crash_logs_each_step_once(tiny_model_dir, tmp_path, digits):
    """A run that logged step 3 and died before saving it (mid-append) resumes from checkpoint 2: steps 3 and 4 run
    again, and completions.jsonl and metrics.jsonl hold each step once, as an uninterrupted run does."""
    import shutil

    train.main(tiny_args(tiny_model_dir, tmp_path / "straight", steps=4))
    train.main(tiny_args(tiny_model_dir, tmp_path / "crashed", steps=3, save_every=2))
    shutil.rmtree(tmp_path / "crashed" / "checkpoint-000003")  # as if killed between logging and saving step 3
    with open(tmp_path / "crashed" / "completions.jsonl", "a") as f:  # ... while it appended a row
        f.write('{"step": 4, "uid": "train-1", "compl')
    (tmp_path / "crashed" / "eval-000003.jsonl").write_text("{}\n")  # an evaluation of a step that runs again
    train.main(tiny_args(tiny_model_dir, tmp_path / "crashed", steps=4, resume=str(tmp_path / "crashed")))
    assert not (tmp_path / "crashed" / "eval-000003.jsonl").exists()
    samples = read_metrics(tmp_path / "crashed" / "completions.jsonl")
    assert [r["step"] for r in samples] == [s for s in (1, 2, 3, 4) for _ in range(8)]
    assert samples == read_metrics(tmp_path / "straight" / "completions.jsonl")
    assert [r["step"] for r in read_metrics(tmp_path / "crashed" / "metrics.jsonl")] == [1, 2, 3, 4]


def test_token_tis_and_mask_truncated_reach_the_run(tiny_model_dir, tmp_path, digits, monkeypatch):
    """--is-correction token-tis logs the mean pi_old / pi_sampler and the capped fraction: 1 and 0 for a float32
    sampler holding the trainer's weights. --mask-truncated with every completion cut (a sampler that never
    stops): no token is trained (the policy does not move), while the group's advantages are still computed."""
    from safetensors.torch import load_file

    import rollout

    init = rollout.HFSampler.__init__

    def never_stops(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.eos_ids = {-1}

    monkeypatch.setattr(rollout.HFSampler, "__init__", never_stops)

    final = train.main(tiny_args(tiny_model_dir, tmp_path / "tis", steps=1, is_correction="token-tis", is_cap=2.0))
    assert final["loss/is_ratio_mean"] == pytest.approx(1.0, abs=1e-4) and final["loss/is_clip_frac"] == 0.0
    args = tiny_args(
        tiny_model_dir,
        tmp_path / "cut",
        steps=1,
        max_tokens=2,
        mask_truncated=True,
        beta=0.0,
        weight_decay=0.0,
        log_completions=16,
    )
    cut = train.main(args)
    samples = read_metrics(tmp_path / "cut" / "completions.jsonl")
    assert cut["response/trunc_frac"] == 1.0 and all(r["finish_reason"] == "length" for r in samples)
    assert cut["loss/pg"] == 0.0 and cut["grad/norm"] == 0.0
    rewards = torch.tensor([r["reward"] for r in samples]).view(4, 4)  # the groups, in order
    expected = compute_advantages("softmax", rewards, **config.estimator_hparams(args))
    assert torch.allclose(torch.tensor([r["advantage"] for r in samples]).view(4, 4), expected)
    before, after = (
        load_file(f"{tiny_model_dir}/model.safetensors"),
        load_file(tmp_path / "cut" / "checkpoint-000001" / "model.safetensors"),
    )
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_weighted_reward_terms_and_joined_demonstrations_reach_the_run(tiny_model_dir, tmp_path):
    """train.py wires --reward-weights and --demo-file: Countdown with a local puzzles file and a GOLD-shaped
    demonstrations file trains on 0.5 exact + 0.5 sim, logs each term, and the reward is their weighted sum."""
    rows = [{"nums": [a, b, c], "target": a * b + c} for a in range(2, 6) for b in range(2, 6) for c in (1, 2)]
    (tmp_path / "puzzles.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    gold = [
        {
            "nums": r["nums"][::-1],
            "target": r["target"],
            "messages": [  # numbers in another order: still joined
                {
                    "role": "assistant",
                    "content": f"<think>t</think>\n<answer>{r['nums'][0]} * {r['nums'][1]} + {r['nums'][2]}</answer>",
                }
            ],
        }
        for r in rows
    ]
    (tmp_path / "gold.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gold))
    args = tiny_args(
        tiny_model_dir,
        tmp_path / "run",
        task="countdown",
        data_file=str(tmp_path / "puzzles.jsonl"),
        demo_file=str(tmp_path / "gold.jsonl"),
        reward_weights="exact=0.5,sim=0.5",
        max_tokens=8,
    )
    assert train.config.check_args(args) is None
    final = train.main(args)
    assert final["reward/mean"] == pytest.approx(0.5 * final["reward/exact"] + 0.5 * final["reward/sim"], abs=1e-6)
    assert json.loads((tmp_path / "run" / "data.json").read_text()) == {  # the data it read: the file's sha256
        "train": hashlib.sha256((tmp_path / "puzzles.jsonl").read_bytes()).hexdigest()
    }
    assert final["reward/pass_rate"] == final["reward/exact"]  # 0/1 verifier
    assert "--demo-file is read only" in train.config.check_args(replace(args, reward_weights="exact=1"))


@pytest.fixture
def sgd(monkeypatch):
    """train.main with plain SGD in place of AdamW, for runs compared with each other. SGD's step is lr times the
    gradient, so gradients that differ by rounding give weights that differ by rounding, on any CPU. AdamW divides
    by sqrt(v): a weight whose gradient is rounding-sized moves by up to lr, either way, depending on how this CPU
    rounded it (seen: 1.18e-4 on an AVX-512 BF16 EPYC where an AVX2 one stayed under 1e-4)."""
    monkeypatch.setattr(train, "make_optimizer", lambda model, args: torch.optim.SGD(model.parameters(), lr=args.lr))


SGD_LR = 0.3  # with --max-grad-norm 1, a step moves the weights by up to 0.3 in norm: metrics at step 2 see it


def test_grad_checkpointing_run_equals_the_plain_run(tiny_model_dir, tmp_path, digits, sgd):
    """End to end through train.main (the layer-level equivalence is tests/test_grad_checkpointing.py)."""
    common = dict(steps=2, beta=1e-3, micro_batch=5, lr=SGD_LR)
    plain = train.main(tiny_args(tiny_model_dir, tmp_path / "plain", **common))
    ckpt = train.main(tiny_args(tiny_model_dir, tmp_path / "ckpt", grad_checkpointing=True, **common))
    assert_runs_agree(tiny_model_dir, tmp_path / "plain", tmp_path / "ckpt", metric_rel=1e-5)
    assert plain["loss/pg"] != 0 and plain["grad/norm"] > 0  # a real update ran
    assert ckpt["step"] == 2


def assert_runs_agree(model_dir, dir_a, dir_b, metric_rel, move_rel=1e-4):
    """Two 2-step runs of train.main (under the `sgd` fixture): every logged number but timings to `metric_rel`,
    and each weight's move from `model_dir` to `move_rel` of the largest move (rounding in the gradients, which
    SGD does not amplify; a wrong gradient or a missed step is of the order of the move itself)."""
    from safetensors.torch import load_file

    for a, b in zip(read_metrics(dir_a / "metrics.jsonl"), read_metrics(dir_b / "metrics.jsonl"), strict=True):
        assert a.keys() == b.keys()
        for key in a:
            if not key.startswith(("time/", "perf/")):
                assert a[key] == pytest.approx(b[key], rel=metric_rel, abs=1e-5), key
    initial = load_file(os.path.join(model_dir, "model.safetensors"))
    a = load_file(dir_a / "checkpoint-000002" / "model.safetensors")
    b = load_file(dir_b / "checkpoint-000002" / "model.safetensors")
    assert a.keys() == b.keys() == initial.keys()
    assert_same_moves(a, b, initial, move_rel)


def assert_same_moves(a, b, initial, move_rel):
    """Weights a and b, both moved from `initial` by an update that rounding cannot amplify (SGD, or one AdamW step
    on equal gradients): each within `move_rel` of the largest move, plus a few float32 ulps of the weight."""
    scale = max((a[k].float() - initial[k].float()).abs().max().item() for k in a)
    assert scale > 0  # the weights moved: there is an update to compare
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-6, atol=move_rel * scale), (
            k,
            (a[k] - b[k]).abs().max().item(),
            scale,
        )


@pytest.mark.slow
def test_compiled_run_matches_the_plain_run(tiny_model_dir, tmp_path, digits, sgd):
    """train.py --compile end to end (policy, reference and the sync probe's no-grad forward compiled), float32:
    the same samples, losses and weights as the eager run to float rounding (tests/test_grad_checkpointing.py
    holds the layers' gradients to it, one process and under FSDP2)."""
    common = dict(steps=2, beta=1e-3, micro_batch=5, lr=SGD_LR)
    plain = train.main(tiny_args(tiny_model_dir, tmp_path / "plain", **common))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled = train.main(tiny_args(tiny_model_dir, tmp_path / "compiled", compile=True, **common))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs  # this run compiled its layers
    assert plain["loss/pg"] != 0 and compiled["step"] == 2
    assert_runs_agree(tiny_model_dir, tmp_path / "plain", tmp_path / "compiled", metric_rel=1e-4)


def test_tiny_model_learns_the_bandit_task(tiny_model_dir, tmp_path, digits):
    train.main(tiny_args(tiny_model_dir, tmp_path, M=8, micro_batch=32, steps=12, max_tokens=2, eval_examples=8))
    rewards = [r["reward/mean"] for r in read_metrics(tmp_path / "metrics.jsonl")]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.25, rewards
    evals = json.loads((tmp_path / "eval.json").read_text())
    assert evals["after"] > evals["before"], evals  # greedy held-out prompts moved too


# ---- torchrun, FSDP2 over gloo


def torchrun(*job):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            os.path.join(ROOT, "tests", "dist_train.py"),
            *job,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
# a per-sequence denominator too; and ranks whose cutter cuts different counts (a fork's), agreed before the update
@pytest.mark.parametrize(
    "loss_agg, cut",
    [("token-mean", "plain"), ("seq-mean-token-mean", "plain"), ("token-mean", "uneven"), ("token-mean", "pack")],
)
def test_one_update_under_torchrun_2_equals_one_process(tiny_model_dir, tmp_path, loss_agg, cut):
    from transformers import AutoModelForCausalLM

    from tools.tiny_model import build_tiny_model

    ref_dir = build_tiny_model(tmp_path / "ref", seed=1)  # a different reference: the KL term has a gradient
    single = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "tests", "dist_train.py"),
            "parity",
            str(tmp_path / "one.pt"),
            tiny_model_dir,
            ref_dir,
            loss_agg,
        ],
        capture_output=True,
        text=True,
    )
    assert single.returncode == 0, single.stderr[-3000:]
    double = torchrun("parity", str(tmp_path / "two.pt"), tiny_model_dir, ref_dir, loss_agg, "float32", "no", cut)
    assert double.returncode == 0, double.stderr[-3000:]
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert one["state"].keys() == two["state"].keys()
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    assert_same_moves(two["state"], one["state"], initial, move_rel=1e-4)  # SGD: a summed reduction doubles moves
    # grad/norm is measured before clipping: a reduction that sums instead of averaging doubles it,
    # which Adam's scale invariance would hide from the weights.
    for key, value in one["metrics"].items():
        assert two["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert one["metrics"]["loss/clip_frac_high"] + one["metrics"]["loss/clip_frac_low"] > 0  # clipping was live


@pytest.mark.slow
def test_recast_and_recompute_under_fsdp2_are_bit_identical(tiny_model_dir, tmp_path):
    """Under FSDP2 (2 ranks, bf16 autocast) the weight a linear layer saves is the gathered float32 parameter,
    which FSDP2 frees after forward and gathers again for backward, and the norms and gates rerun inside
    FSDP2's layers: the update is still the plain one, bit for bit."""
    from tools.tiny_model import build_tiny_model

    ref_dir = build_tiny_model(tmp_path / "ref", seed=1)
    runs = {}
    for recast in ("no", "yes"):
        result = torchrun(
            "parity", str(tmp_path / f"{recast}.pt"), tiny_model_dir, ref_dir, "token-mean", "bfloat16", recast
        )
        assert result.returncode == 0, result.stderr[-3000:]
        runs[recast] = torch.load(tmp_path / f"{recast}.pt")
    for name, want in runs["no"]["state"].items():
        assert torch.equal(runs["yes"]["state"][name], want), name
    assert runs["yes"]["metrics"] == runs["no"]["metrics"]


def test_the_sync_gathers_in_the_engines_bf16_and_the_weight_check_stays_exact(tiny_model_dir):
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "dist_train.py"), "bf16-sync", tiny_model_dir],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"gathered": ["torch.bfloat16"], "sync/weight_diff": 0.0}


@pytest.mark.slow
def test_end_to_end_under_torchrun_2(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    result = torchrun("e2e", str(tmp_path), tiny_model_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(
        math.isfinite(r["loss/pg"]) and math.isfinite(r["loss/kl"]) and math.isfinite(r["grad/norm"]) for r in rows
    )
    assert all(r["sync/logprob_diff"] < 1e-4 for r in rows)  # every rank's sampler got the gathered weights
    assert all(r["sync/weight_diff"] == 0.0 for r in rows)  # all of them (--weight-check-every 1)
    assert set(json.loads((tmp_path / "eval.json").read_text())) == {"before", "after"}
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint-000003")
    assert model.config.architectures == ["LlamaForCausalLM"]  # not FSDP's wrapper class
    assert (tmp_path / "checkpoint-000002" / "trainer_state.pt").exists()  # --save-every 2
    samples = read_metrics(tmp_path / "completions.jsonl")  # all 16 samples of each step, rank 0's 8 first
    assert [r["step"] for r in samples] == [s for s in (1, 2, 3) for _ in range(16)]
    for step, row in zip((1, 2, 3), rows):  # each row's reward is its own completion's, wherever it was sampled
        mine = samples[16 * (step - 1) : 16 * step]
        assert all(r["reward"] == DigitTask().reward(r["completion"], None) for r in mine)
        assert sum(r["reward"] for r in mine) / 16 == pytest.approx(row["reward/mean"])
        assert len({r["uid"] for r in mine[:8]} & {r["uid"] for r in mine[8:]}) == 0  # two ranks' prompts
    assert len(read_metrics(tmp_path / "eval-000000.jsonl")) == 4  # both ranks' held-out generations


# ---- speed changes: each keeps the update equal to the plain version


def ppo_batch(n_prompts=4, M=4, seed=0):
    """Prompts (repeated M times), completions of mixed lengths, advantages: one rank's flat PPO batch."""
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(4, 90, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n_prompts)
    ]
    flat_prompts = [p for p in prompts for _ in range(M)]
    completions = [
        torch.randint(4, 90, (int(torch.randint(1, 14, (1,), generator=g)),), generator=g).tolist()
        for _ in flat_prompts
    ]
    return flat_prompts, completions, torch.randn(len(flat_prompts), generator=g)


def padded_tokens(prompts, completions, groups):
    return sum(len(g) * (max(len(prompts[i]) for i in g) + max(len(completions[i]) for i in g)) for g in groups)


def test_micro_batch_grouping_sorts_longest_first_and_cuts_padding():
    prompts, completions, _ = ppo_batch()
    groups = train.micro_batch_rows(prompts, completions, range(16), 4)
    assert sorted(i for g in groups for i in g) == list(range(16)) and all(len(g) == 4 for g in groups)
    lengths = [len(completions[i]) for g in groups for i in g]
    assert lengths == sorted(lengths, reverse=True) and lengths[0] > lengths[-1]
    in_order = [list(range(a, a + 4)) for a in range(0, 16, 4)]
    assert padded_tokens(prompts, completions, groups) < padded_tokens(prompts, completions, in_order)


def one_update(
    model_dir,
    ref_dir,
    micro_batch,
    fused=False,
    ref_bf16=False,
    dtype="float32",
    epochs=2,
    minibatches=2,
    loss_agg="token-mean",
    recast=False,
    recompute=False,
    compiled=False,
    optimizer="sgd",
    micro_batch_tokens=0,
    pack=False,
):
    """train.ppo_update on ppo_batch(): (weights after, metrics, weights before). Plain SGD unless `optimizer` is
    "adamw", so that two updates whose gradients differ by rounding differ by rounding (see the `sgd` fixture)."""
    from transformers import AutoModelForCausalLM

    args = train.Args(
        M=4,
        rollout_batch=4,
        micro_batch=micro_batch,
        minibatches=minibatches,
        ppo_epochs=epochs,
        beta=0.1,
        lr=1e-3 if optimizer == "adamw" else SGD_LR,
        warmup_steps=0,
        max_grad_norm=0.5,
        dtype=dtype,
        loss_agg=loss_agg,
        micro_batch_tokens=micro_batch_tokens,
        pack=pack,
    )
    prompts, completions, adv = ppo_batch()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    if recast:
        speed.backward.recast_linears_in_backward(model)
    if recompute:
        speed.backward.recompute_norms_and_gates_in_backward(model)
    ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval().requires_grad_(False)
    if ref_bf16:
        speed.backward.store_linears_bf16(ref)
    if compiled:
        speed.compile.compile_layers(model)
        speed.compile.compile_layers(ref)
    optimizer = (
        torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, fused=fused)
        if optimizer == "adamw"
        else torch.optim.SGD(model.parameters(), lr=args.lr)
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    metrics = train.ppo_update(
        model,
        ref,
        optimizer,
        scheduler,
        prompts,
        completions,
        [[0.0] * len(c) for c in completions],
        adv,
        args,
        pad_id=0,
    )
    return model.state_dict(), metrics, initial


@pytest.mark.parametrize("loss_agg", list(AGGREGATIONS))
def test_mask_truncated_trains_as_the_batch_without_the_cut_rows(tiny_model_dir, ref_dir, loss_agg):
    """--mask-truncated through ppo_update (micro-batches of 3, the denominator shared over them): the update equals
    that of the batch without the truncated rows, under every --loss-agg, and differs from the unmasked update."""
    from transformers import AutoModelForCausalLM

    prompts, completions, adv = ppo_batch()
    cut = [i % 5 == 1 for i in range(len(prompts))]
    keep = [i for i, c in enumerate(cut) if not c]

    def update(rows, mask_truncated, micro_batch):
        args = train.Args(
            M=4,
            rollout_batch=4,
            micro_batch=micro_batch,
            beta=0.1,
            lr=SGD_LR,
            warmup_steps=0,
            dtype="float32",
            loss_agg=loss_agg,
            mask_truncated=mask_truncated,
        )
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval().requires_grad_(False)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)  # rounding stays rounding (the `sgd` fixture)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        metrics = train.ppo_update(
            model,
            ref,
            optimizer,
            scheduler,
            [prompts[i] for i in rows],
            [completions[i] for i in rows],
            [[0.0] * len(completions[i]) for i in rows],
            adv[rows],
            args,
            pad_id=0,
            keep=torch.tensor([not cut[i] for i in rows]) if mask_truncated else None,
        )
        return model.state_dict(), metrics

    everything = list(range(len(prompts)))
    masked, without = update(everything, True, 3), update(keep, False, 8)
    assert masked[1]["loss/pg"] == pytest.approx(without[1]["loss/pg"], rel=1e-5, abs=1e-7)
    assert masked[1]["loss/kl"] == pytest.approx(without[1]["loss/kl"], rel=1e-5, abs=1e-9)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    assert_same_moves(masked[0], without[0], initial, move_rel=1e-4)
    unmasked = update(everything, False, 3)
    assert unmasked[1]["loss/pg"] != pytest.approx(masked[1]["loss/pg"], rel=1e-3)


@pytest.fixture(scope="module")
def ref_dir(tmp_path_factory):
    from tools.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("ref"), seed=1)  # another model: the KL term is not zero


# The relative error of an update computed in bf16 (unit roundoff 2^-8) against float32 (2^-24) is above this on any
# CPU, and a float32 computation's is far below it: whether a path ran in bf16 at all, not how this CPU rounds.
BF16_MOVES = 1e-4


def assert_same_update(a, b, tol, move_rel=1e-4):
    """Two one_update results: the losses, ratio and pre-clip gradient norm to `tol`, the weights' moves to
    `move_rel` of the largest (assert_same_moves); tol 0: the weights and metrics bit for bit."""
    (sa, ma, initial), (sb, mb, _) = a, b
    if tol == 0:
        assert all(torch.equal(sa[name], sb[name]) for name in sa)
    else:
        assert_same_moves(sa, sb, initial, move_rel)
    for key in ("loss/pg", "loss/kl", "grad/norm", "loss/ratio_mean"):
        assert ma[key] == pytest.approx(mb[key], rel=tol, abs=tol), key


def test_micro_batch_grouping_keeps_the_update(tiny_model_dir, ref_dir):
    """Micro-batches of 3 (sorted, padded per group) vs the whole minibatch in one pass: the same update."""
    assert_same_update(
        one_update(tiny_model_dir, ref_dir, micro_batch=3), one_update(tiny_model_dir, ref_dir, micro_batch=8), tol=1e-5
    )


def test_micro_batches_by_tokens_hold_the_budget_and_keep_the_update(tiny_model_dir, ref_dir):
    """--micro-batch-tokens (issue 63, item 1): each micro-batch holds at most the budget as padded, a longer
    sequence alone; no budget is the count cut as before; and the update equals the whole minibatch's."""
    prompts, completions, _ = ppo_batch()
    by_count = train.micro_batch_rows(prompts, completions, range(16), 4)
    rows = sorted(range(16), key=lambda i: (len(completions[i]), len(prompts[i])), reverse=True)
    assert by_count == [rows[a : a + 4] for a in range(0, 16, 4)]  # budget 0: the count cut, unchanged
    budget = 40
    cut = train.micro_batch_rows(prompts, completions, range(16), 16, budget)
    assert sorted(i for g in cut for i in g) == list(range(16)) and len(cut) > 1
    for g in cut:
        assert len(g) == 1 or padded_tokens(prompts, completions, [g]) <= budget, g
    assert any(len(g) > 1 for g in cut)
    whole = one_update(tiny_model_dir, ref_dir, micro_batch=8)
    assert_same_update(one_update(tiny_model_dir, ref_dir, micro_batch=8, micro_batch_tokens=budget), whole, tol=1e-5)


@pytest.mark.parametrize("loss_agg", list(AGGREGATIONS))
def test_a_packed_update_equals_the_padded_one(tiny_model_dir, ref_dir, loss_agg):
    """--pack through ppo_update (micro-batches of 3, a KL reference, 2 epochs x 2 minibatches, float32): the same
    loss and weights as the padded update. Plain SGD moves each weight by lr x its gradient, so float32 rounding of
    the two forward orders (~1e-7 relative) stays ~1e-7 in the weights; tol 1e-5 is the micro-batch tests' bound."""
    padded = one_update(tiny_model_dir, ref_dir, micro_batch=3, loss_agg=loss_agg)
    packed = one_update(tiny_model_dir, ref_dir, micro_batch=3, loss_agg=loss_agg, pack=True)
    assert_same_update(packed, padded, tol=1e-5)


@pytest.mark.parametrize("loss_agg", [agg for agg in AGGREGATIONS if agg != "token-mean"])
def test_every_loss_agg_is_invariant_to_micro_batches(tiny_model_dir, ref_dir, loss_agg):
    """--loss-agg reaches the loss (the update differs from token-mean's), and micro-batches of 3 (length-sorted,
    each padded on its own) give the same update as the whole minibatch in one pass."""
    whole = one_update(tiny_model_dir, ref_dir, micro_batch=8, loss_agg=loss_agg)
    assert_same_update(one_update(tiny_model_dir, ref_dir, micro_batch=3, loss_agg=loss_agg), whole, tol=1e-5)
    token_mean = one_update(tiny_model_dir, ref_dir, micro_batch=8)
    assert whole[1]["loss/pg"] != pytest.approx(token_mean[1]["loss/pg"], rel=1e-3)


def test_fused_adamw_matches_default(tiny_model_dir, ref_dir):
    """One AdamW step on the same gradients (one epoch, one minibatch: a second step would see gradients that
    differ by rounding, which AdamW amplifies up to lr): fused and foreach agree to a few ulps of the step."""
    one_step = dict(micro_batch=8, optimizer="adamw", epochs=1, minibatches=1)
    assert_same_update(
        one_update(tiny_model_dir, ref_dir, fused=True, **one_step),
        one_update(tiny_model_dir, ref_dir, fused=False, **one_step),
        tol=1e-6,
        move_rel=1e-5,
    )


def test_bf16_reference_is_exact(tiny_model_dir, ref_dir):
    """Linear weights stored in bf16 give the bf16-autocast reference forward bit for bit, at half the bytes."""
    from transformers import AutoModelForCausalLM

    from speed.logprobs import pad_batch, sequence_logprobs

    ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    small = speed.backward.store_linears_bf16(AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval())
    dtypes = {name: p.dtype for name, p in small.named_parameters()}
    assert (
        dtypes["model.layers.0.self_attn.q_proj.weight"]
        == dtypes["model.layers.1.mlp.down_proj.weight"]
        == torch.bfloat16
    )
    assert dtypes["model.embed_tokens.weight"] == dtypes["model.norm.weight"] == torch.float32  # tied lm_head too
    prompts, completions, _ = ppo_batch()
    ids, attn, mask = pad_batch(prompts, completions, 0)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = sequence_logprobs(ref, ids, attn, mask.shape[1])
        got = sequence_logprobs(small, ids, attn, mask.shape[1])
    assert torch.equal(got, want)
    # and the whole bf16 update with it matches the one with a float32 reference
    assert_same_update(
        one_update(tiny_model_dir, ref_dir, micro_batch=8, ref_bf16=True, dtype="bfloat16"),
        one_update(tiny_model_dir, ref_dir, micro_batch=8, dtype="bfloat16"),
        tol=0,
    )


@pytest.mark.slow
def test_compiled_bf16_update_is_as_close_to_float32_as_the_eager_one(tiny_model_dir, ref_dir):
    """train.py --compile under bf16 autocast is not bit-identical to the eager layers (their recast and recompute
    tricks included, as train.py runs them), but its update is no further from the float32 update than theirs,
    and no nearer than a fraction of it: autocast still rounds inside the compiled graph."""

    def moves(weights, _, initial):
        return {k: v - initial[k] for k, v in weights.items()}

    updates = {
        name: moves(*one_update(tiny_model_dir, ref_dir, micro_batch=3, **kw))
        for name, kw in [
            ("float32", {}),
            ("eager bf16", dict(dtype="bfloat16", ref_bf16=True, recast=True, recompute=True)),
            ("compiled bf16", dict(dtype="bfloat16", ref_bf16=True, compiled=True)),
        ]
    }
    exact = torch.cat([v.flatten() for v in updates["float32"].values()])
    error = {
        name: (torch.cat([v.flatten() for v in u.values()]) - exact).norm().item() / exact.norm().item()
        for name, u in updates.items()
        if name != "float32"
    }
    # bf16 rounds at 2^-8 where float32 rounds at 2^-24: an update computed in bf16 is off by far more than 1e-4
    # on any CPU, one computed in float32 by far less. Compiled bf16 must be in bf16 (above it) and no worse than
    # the eager layers (the bound is on the eager error, whatever this CPU's bf16 kernels round to).
    assert exact.norm() > 0 and error["eager bf16"] > BF16_MOVES, error
    assert BF16_MOVES < error["compiled bf16"] < 1.5 * error["eager bf16"], error


@pytest.fixture(scope="module")
def bias_model_dir(tmp_path_factory):
    from tools.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("bias"), attention_bias=True)  # q/k/v/o with biases, as Qwen2


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_recast_linears_in_backward_is_bit_identical(tiny_model_dir, bias_model_dir, ref_dir, dtype, bias):
    """Recasting each linear weight in backward: the same update bit for bit (2 epochs x 2 minibatches, tied
    lm_head and biases included), and under bf16 autocast no bf16 copy of a weight is kept from forward to
    backward."""
    model_dir = bias_model_dir if bias else tiny_model_dir
    assert_same_update(
        one_update(model_dir, ref_dir, micro_batch=3, dtype=dtype, recast=True),
        one_update(model_dir, ref_dir, micro_batch=3, dtype=dtype),
        tol=0,
    )
    if dtype != "bfloat16":
        return
    from transformers import AutoModelForCausalLM

    def saved_weight_casts(model):  # bytes of bf16 tensors shaped like a linear weight, saved for backward
        shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)}
        shapes |= {s[::-1] for s in shapes}
        return saved_bytes(model, torch.bfloat16, keep=lambda t: t.dtype == torch.bfloat16 and tuple(t.shape) in shapes)

    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    linear_bytes = sum(2 * m.weight.numel() for m in plain.modules() if isinstance(m, torch.nn.Linear))
    assert saved_weight_casts(plain) >= linear_bytes  # autocast keeps every layer's bf16 weight
    assert saved_weight_casts(speed.backward.recast_linears_in_backward(plain)) == 0


@pytest.mark.parametrize("bias", [False, True])
def test_backward_keeps_one_cast_per_input_and_reruns_down_projs_input(tiny_model_dir, bias_model_dir, ref_dir, bias):
    """train.py's bf16 backward (speed.backward.configure_backward) against the norm/gate rerun alone: no weight
    cast saved, one bf16 cast of each norm's output where q/k/v and gate/up each kept their own (3 x 2 B x
    hidden per token per layer less), and no down_proj input (2 B x intermediate); the same update."""
    from transformers import AutoModelForCausalLM

    model_dir = bias_model_dir if bias else tiny_model_dir

    def load():
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    rerun = saved_bytes(speed.backward.recompute_norms_and_gates_in_backward(load()), torch.bfloat16)
    lean = saved_bytes(speed.backward.configure_backward(load(), bf16=True, checkpointing=False), torch.bfloat16)
    model, (prompts, completions, _) = load(), ppo_batch()
    cfg, tokens = model.config, len(prompts) * (max(map(len, prompts)) + max(map(len, completions)))
    weight_casts = sum(2 * m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    per_layer = 3 * 2 * cfg.hidden_size + 2 * cfg.intermediate_size
    assert rerun - lean == weight_casts + cfg.num_hidden_layers * per_layer * tokens
    assert_same_update(
        one_update(model_dir, ref_dir, micro_batch=3, dtype="bfloat16", recompute=True, recast=True),
        one_update(model_dir, ref_dir, micro_batch=3, dtype="bfloat16"),
        tol=0,
    )


def saved_bytes(model, dtype, keep=lambda t: True) -> int:
    """Bytes autograd keeps for backward in one forward of ppo_batch() (parameters excluded, each storage once;
    only the tensors `keep` accepts)."""
    from speed.logprobs import pad_batch, sequence_logprobs

    params, saved = {p.untyped_storage().data_ptr() for p in model.parameters()}, {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params and keep(t):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    prompts, completions, _ = ppo_batch()
    ids, attn, mask = pad_batch(prompts, completions, 0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            sequence_logprobs(model, ids, attn, mask.shape[1])
    return sum(saved.values())


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_recompute_norms_and_gates_is_bit_identical(tiny_model_dir, ref_dir, dtype):
    """Rerunning the RMSNorms and act_fn(gate) * up in backward: the same update bit for bit, with and without
    the weight recast, and per token 4 B x (hidden + 1) per norm and 2 B x intermediate (bf16) per layer less saved."""
    from transformers import AutoModelForCausalLM

    plain = one_update(tiny_model_dir, ref_dir, micro_batch=3, dtype=dtype)
    assert_same_update(one_update(tiny_model_dir, ref_dir, micro_batch=3, dtype=dtype, recompute=True), plain, tol=0)
    assert_same_update(
        one_update(tiny_model_dir, ref_dir, micro_batch=3, dtype=dtype, recompute=True, recast=True), plain, tol=0
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    before = saved_bytes(model, getattr(torch, dtype))
    after = saved_bytes(speed.backward.recompute_norms_and_gates_in_backward(model), getattr(torch, dtype))
    cfg, (prompts, completions, _) = model.config, ppo_batch()
    tokens = len(prompts) * (max(map(len, prompts)) + max(map(len, completions)))  # padded (B, P + K)
    c = 2 if dtype == "bfloat16" else 4
    norm = 4 * cfg.hidden_size + 4  # a norm's float32 normalised output and its 1/rms; its input stays saved
    per_layer = 2 * norm + c * cfg.intermediate_size  # two norms, act_fn(gate)
    assert before - after == (cfg.num_hidden_layers * per_layer + norm) * tokens  # + the final norm


def test_bf16_reference_releases_the_weights_file(ref_dir):
    """from_pretrained leaves the float32 tensors in a mapping of model.safetensors; after the bf16 cast no
    tensor may stay in it, or the mapping, and every file page the cast read, stays resident."""
    probe = (
        "import gc, sys, torch, speed.backward\n"
        "from transformers import AutoModelForCausalLM\n"
        "def mapped():\n"
        "    return sum('model.safetensors' in line for line in open('/proc/self/maps'))\n"
        "model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)\n"
        "loaded = mapped()\n"
        "for module in model.modules():  # the cast alone, without the copy of what stays float32\n"
        "    if isinstance(module, torch.nn.Linear) and module.weight is not model.get_input_embeddings().weight:\n"
        "        module.to(torch.bfloat16)\n"
        "gc.collect()\n"
        "cast_only = mapped()\n"
        "speed.backward.store_linears_bf16(model)\n"
        "gc.collect()\n"
        "print(loaded, cast_only, mapped())\n"
    )
    out = subprocess.run([sys.executable, "-c", probe, ref_dir], capture_output=True, text=True, cwd=ROOT, check=True)
    loaded, cast_only, after = map(int, out.stdout.split())
    assert loaded > 0 and cast_only > 0, "from_pretrained no longer maps the file: this test checks nothing"
    assert after == 0


def test_keep_freed_memory_stops_refaulting_large_blocks():
    """After keep_freed_memory, a freed 64 MB tensor's pages are reused instead of faulted in again (glibc)."""
    probe = (
        "import resource, sys, torch, speed.allocator\n"
        "def faults():\n"
        "    for _ in range(3):\n"
        "        torch.empty(16 << 20).fill_(1.0)  # 64 MB, freed at once\n"
        "    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "    for _ in range(5):\n"
        "        torch.empty(16 << 20).fill_(1.0)\n"
        "    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before\n"
        "default = faults()\n"
        "ok = speed.allocator.keep_freed_memory()\n"
        "faults()  # the heap grows to hold the block once\n"
        "print(ok, default, faults())\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=True)
    ok, default, kept = out.stdout.split()
    if ok != "True":
        pytest.skip("not glibc: keep_freed_memory is a no-op here")
    pages = (64 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert int(default) >= 4 * pages  # the default faults every page of every allocation in again
    assert int(kept) < pages // 4  # kept: the pages are reused


def test_release_freed_memory_hands_kept_pages_back():
    """Under keep_freed_memory a freed 256 MB tensor stays resident; release_freed_memory gives its pages back."""
    probe = (
        "import sys, torch, speed.allocator\n"
        "def rss():\n"
        "    return int(open('/proc/self/statm').read().split()[1]) * 4096\n"
        "speed.allocator.keep_freed_memory()\n"
        "keep = torch.ones(1 << 20)  # a live block above the freed one: the heap's top cannot just shrink\n"
        "big = torch.ones(64 << 20)  # 256 MB, every page touched\n"
        "pin = torch.ones(1 << 20)\n"
        "del big\n"
        "kept = rss()\n"
        "ok = speed.allocator.release_freed_memory()\n"
        "print(ok, kept - rss())\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=True)
    ok, released = out.stdout.split()
    if ok != "True":
        pytest.skip("not glibc: release_freed_memory is a no-op here")
    assert int(released) > 200 << 20  # most of the 256 MB left the resident set


def test_on_policy_shortcut_equals_recomputing_old_logprobs(tiny_model_dir, ref_dir, monkeypatch):
    """One epoch, one minibatch: logp.detach() stands in for pi_old; recomputing it gives the same update."""
    shortcut = one_update(tiny_model_dir, ref_dir, micro_batch=3, epochs=1, minibatches=1)
    monkeypatch.setattr(train, "reuses_training_logprobs", lambda args: False)  # force the extra forward
    recomputed = one_update(tiny_model_dir, ref_dir, micro_batch=3, epochs=1, minibatches=1)
    assert_same_update(shortcut, recomputed, tol=1e-6)


# ---- the sync check: a sampler that misses an update stops the run


@pytest.mark.parametrize("lr", [3e-2, 1e-6])  # a step that moves the probe past the tolerance, and one far below it
def test_a_sampler_that_never_updates_stops_the_run_at_the_first_step(
    tiny_model_dir, tmp_path, digits, monkeypatch, lr
):
    from rollout import HFSampler

    # A stale sampler: it keeps its weights through training (no sleep, which would free them) and the sync
    # writes nothing. (A sync that leaves a sleeping sampler's weights empty is an error of its own: test_rollout.)
    monkeypatch.setattr(HFSampler, "sleep", lambda self: 0)
    monkeypatch.setattr(HFSampler, "update_weights", lambda self, named_tensors: None)
    with pytest.raises(train.SyncError, match="^step 1: ") as info:
        train.main(tiny_args(tiny_model_dir, tmp_path, steps=3, lr=lr, save_every=1))
    assert "\n" not in str(info.value) and "--sync-tolerance" in str(info.value)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1]  # the step is logged...
    assert not any(name.startswith("checkpoint-") for name in os.listdir(tmp_path))  # ...but never saved


def test_a_stale_sampler_is_one_line_and_exit_1_from_the_command_line(tiny_model_dir, tmp_path):
    script = (
        "import runpy, sys, rollout; rollout.HFSampler.update_weights = lambda self, named_tensors: None; "
        "rollout.HFSampler.sleep = lambda self: 0; "
        "sys.argv = ['train.py'] + sys.argv[1:]; runpy.run_path('train.py', run_name='__main__')"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            "--task",
            "arith",
            "--model",
            tiny_model_dir,
            "--steps",
            "2",
            "--eval-examples",
            "0",
            "--max-tokens",
            "4",
            "--dtype",
            "float32",
            "--out-dir",
            str(tmp_path / "run"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("train.py: error: step 1: ") and "sampler" in last
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_healthy_run_never_trips_the_sync_check(tiny_model_dir, tmp_path, digits, dtype):
    train.main(tiny_args(tiny_model_dir, tmp_path, steps=4, dtype=dtype, lr=3e-3, beta=1e-3, weight_check_every=2))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["sync/logprob_diff"] == r["sync/logprob_diff/rank0"] < config.SYNC_TOLERANCE[dtype] for r in rows)
    assert [r.get("sync/weight_diff") for r in rows] == [None, 0.0, None, 0.0]  # every 2nd step, equal


def test_a_sync_that_skips_the_norms_stops_the_run_naming_them(tiny_model_dir, tmp_path, digits, monkeypatch):
    """At lr 1e-6 the probe cannot see stale norms; the weight check (--weight-check-every) does, at its step."""
    from rollout import HFSampler

    full_sync = HFSampler.update_weights
    monkeypatch.setattr(HFSampler, "sleep", lambda self: 0)  # it keeps its weights: the skipped ones stay stale
    monkeypatch.setattr(
        HFSampler,
        "update_weights",
        lambda self, named_tensors: full_sync(self, ((name, t) for name, t in named_tensors if "norm" not in name)),
    )
    with pytest.raises(train.SyncError, match="^the engine's norms differ from the trainer's after the step-2 sync"):
        train.main(tiny_args(tiny_model_dir, tmp_path, steps=3, lr=1e-6, weight_check_every=2))
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]  # step 1 was not checked


def test_sync_tolerance_defaults_by_precision_and_an_explicit_one_wins():
    from config import resolve_auto

    assert resolve_auto(train.Args(dtype="float32")).sync_tolerance == config.SYNC_TOLERANCE["float32"]
    assert resolve_auto(train.Args(dtype="bfloat16")).sync_tolerance == config.SYNC_TOLERANCE["bfloat16"]
    assert resolve_auto(train.Args(dtype="bfloat16", sync_tolerance=0.05)).sync_tolerance == 0.05
    assert config.SYNC_TOLERANCE["float32"] < config.SYNC_TOLERANCE["bfloat16"]


def test_sampler_auto_on_a_gpu_without_vllm_stops_in_one_line(monkeypatch):
    """On a GPU, --sampler auto means vLLM; without it installed the run stops and says how, instead of sampling
    with the HF sampler, many times slower, without a word."""
    import importlib.util

    import config

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    error = config.check_args(train.Args())
    assert error is not None and "requirements-vllm.txt" in error and "--sampler hf" in error and "\n" not in error
    assert "vLLM" not in (config.check_args(train.Args(sampler="hf")) or "")
    explicit = config.check_args(train.Args(sampler="vllm"))  # asked for by name: the same line, before any load
    assert explicit.startswith("--sampler vllm samples with vLLM") and "requirements-vllm.txt" in explicit
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)  # vLLM installed: auto picks it
    assert config.resolve_auto(train.Args(dtype="float32")).sampler == "vllm"


@pytest.mark.slow
def test_fsdp2_bf16_mixed_precision_update_is_as_close_to_float32_as_autocast(tiny_model_dir, tmp_path):
    """Under FSDP2 with --dtype bfloat16 the layers are gathered and computed in bf16 and gradients reduced in
    float32 (plumbing/parallel.shard's MixedPrecisionPolicy, as the paper's verl runs): its update is about as far
    from the float32 update as one process's bf16 autocast over float32 weights is, and AdamW's master weights
    stay float32."""
    from transformers import AutoModelForCausalLM

    from tools.tiny_model import build_tiny_model

    ref_dir = build_tiny_model(tmp_path / "ref", seed=1)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    runs = {}
    for name, launch, dtype in [
        ("float32", "one", "float32"),
        ("autocast", "one", "bfloat16"),
        ("fsdp2 float32", "two", "float32"),
        ("fsdp2 bf16", "two", "bfloat16"),
    ]:
        job = (
            "parity",
            str(tmp_path / f"{name}.pt"),
            tiny_model_dir,
            ref_dir,
            "token-mean",
            dtype,
            "yes" if dtype == "bfloat16" else "no",
        )  # recast: as train.load_models under bf16
        result = (
            torchrun(*job)
            if launch == "two"
            else subprocess.run(
                [sys.executable, os.path.join(ROOT, "tests", "dist_train.py"), *job], capture_output=True, text=True
            )
        )
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = torch.load(tmp_path / f"{name}.pt")["state"]
    assert all(v.dtype == torch.float32 for v in runs["fsdp2 bf16"].values())  # the master weights

    def update(state):
        return torch.cat([(state[k] - initial[k]).flatten() for k in sorted(initial)])

    exact = update(runs["float32"])
    error = {name: (update(state) - exact).norm().item() / exact.norm().item() for name, state in runs.items()}
    assert error["fsdp2 float32"] < BF16_MOVES < error["autocast"], error  # float32 and bf16 on either side
    assert BF16_MOVES < error["fsdp2 bf16"] < 1.5 * error["autocast"], error  # in bf16, no worse than autocast


def test_a_resume_on_changed_data_says_so_once_and_records_the_new_hash(tiny_model_dir, tmp_path, capsys):
    """Issue 61, class 3: the same --data-file path with other rows rewrote data.json's hash with no note."""
    data = tmp_path / "gsm8k.jsonl"
    rows = [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1} #### {i + 1}"} for i in range(20)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = tiny_args(tiny_model_dir, tmp_path / "run", task="gsm8k", data_file=str(data), steps=1)
    train.main(args)
    capsys.readouterr()
    data.write_text(data.read_text() + json.dumps({"question": "What is 1 + 1?", "answer": "#### 2"}) + "\n")
    train.main(replace(args, steps=2, resume=str(tmp_path / "run")))
    notes = [line for line in capsys.readouterr().out.splitlines() if "data changed" in line]
    assert notes == [
        f"note: the train data changed since {tmp_path / 'run' / 'data.json'} recorded it; the run resumes on it"
    ]
    recorded = json.loads((tmp_path / "run" / "data.json").read_text())
    assert recorded == {"train": hashlib.sha256(data.read_bytes()).hexdigest()}  # the rows it trains on now


def test_agreed_micro_batches_halve_the_largest_until_every_rank_has_as_many():
    from speed.micro_batches import agreed, split_to

    rows = [[0, 1, 2], [3]]
    assert agreed(rows, torch.device("cpu")) == rows  # one process: its own count, the cut kept
    assert split_to(rows, 3) == [[0], [1, 2], [3]]  # the largest first, in place, order kept
    assert split_to(rows, 4) == [[0], [1], [2], [3]]
    assert split_to([[0, 1, 2, 3, 4]], 2) == [[0, 1], [2, 3, 4]]


@pytest.mark.parametrize("variant", ["plain", "lora", "checkpointing"])
@pytest.mark.parametrize("attention, tol", [("sdpa", 1e-10), ("eager", 1e-6)])
def test_packed_log_probs_entropies_and_gradients_equal_the_padded_ones(tiny_model_dir, attention, tol, variant):
    """--pack (issue 63, item 3): in float64 the packed row gives the padded batch's log-probs, entropies and
    gradients, under LoRA and under gradient checkpointing. The padded reference runs sdpa: HF's eager attention
    turns float64 left-padded rows into NaN. Packed sdpa agrees to 1e-10; packed eager to 1e-6, because HF's eager
    softmax runs in float32 whatever the dtype (about 5e-8 apart from sdpa on one unpadded sequence). A sequence
    that attended across its neighbours would move its log-probs by far more: the tiny model's moves are ~1e-2."""
    from transformers import AutoModelForCausalLM

    from speed.logprobs import PACKED_ATTENTION, pack_batch, packed_logprobs, pad_batch, sequence_logprobs

    assert attention in PACKED_ATTENTION
    prompts, completions, _ = ppo_batch()
    rows = [0, 3, 5, 6, 9, 12]  # lengths that differ, so the padded batch pads
    prompts, completions = [prompts[i] for i in rows], [completions[i] for i in rows]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64, attn_implementation="sdpa")
    if variant == "lora":
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    if variant == "checkpointing":
        model.gradient_checkpointing_enable()
        model.train()
    ids, attention_mask, mask = pad_batch(prompts, completions, pad_id=0)
    mask = mask.double()
    weights = torch.randn(mask.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def run(logprobs):
        model.zero_grad()
        logp, entropy = logprobs(entropy=True, entropy_grad=True)
        kept = mask > 0
        logp, entropy = torch.where(kept, logp, 0), torch.where(kept, entropy, 0)  # a pad position is no number
        (logp * weights + 0.1 * entropy).sum().backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        return logp.detach(), entropy.detach(), grads

    K = mask.shape[1]
    padded = run(lambda **kw: sequence_logprobs(model, ids, attention_mask, K, 0.7, **kw))
    model.set_attn_implementation(attention)
    packed = run(lambda **kw: packed_logprobs(model, pack_batch(prompts, completions), mask, 0.7, **kw))
    assert torch.allclose(packed[0], padded[0], rtol=0, atol=tol)
    assert torch.allclose(packed[1], padded[1], rtol=0, atol=tol)
    assert packed[2].keys() == padded[2].keys() and len(packed[2]) > 0
    for name, grad in padded[2].items():
        assert torch.allclose(packed[2][name], grad, rtol=0, atol=tol), name
    assert padded[0].abs().sum() > 1  # real log-probs, not zeros


def test_pack_refuses_an_attention_that_would_mix_packed_sequences_before_training(
    tiny_model_dir, tmp_path, digits, monkeypatch
):
    """Issue 63, item 2: --pack leans on transformers keeping restarting position ids apart, which only some
    kernels do; a run under another is refused in one line before any step, its folder empty of checkpoints."""
    from transformers import AutoModelForCausalLM

    import speed.logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager")
    assert speed.logprobs.packing_error(model) is None
    monkeypatch.setattr(speed.logprobs, "PACKED_ATTENTION", ("sdpa",))  # as if eager mixed them
    error = speed.logprobs.packing_error(model)
    assert error == "--pack: eager attention would let packed sequences attend to each other (sdpa do not)"
    with pytest.raises(train.ModelLoadError, match="^--pack: eager attention"):
        train.main(tiny_args(tiny_model_dir, tmp_path / "run", pack=True))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
