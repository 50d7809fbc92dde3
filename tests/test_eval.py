"""eval.py: the pass@k estimator by hand, and evaluate()/the CLI end to end on the tiny model."""

import itertools
import json
import math
import os
from dataclasses import dataclass, field

import pytest
import torch

from eval import encode_prompts, evaluate, main, pass_at_k


def test_pass_at_k_hand_values():
    # n=4, c=1: P(the single pass is among k draws) = k / 4.
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    # n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10.
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    # n=10, c=3, k=4: 1 - C(7,4)/C(10,4) = 1 - 35/210.
    assert pass_at_k(10, 3, 4) == pytest.approx(1 - 35 / 210)
    assert pass_at_k(8, 0, 8) == 0.0
    assert pass_at_k(8, 5, 4) == 1.0  # only 3 failures: every 4-subset holds a pass
    assert pass_at_k(8, 8, 1) == 1.0


def test_pass_at_k_matches_enumeration_and_is_stable():
    # Brute force over all k-subsets of n samples with c passes.
    for n, c, k in [(6, 2, 3), (7, 1, 2), (7, 4, 5), (5, 0, 1)]:
        subsets = list(itertools.combinations(range(n), k))
        brute = sum(any(i < c for i in s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(brute)
    # Large n where the binomials are ~1e29: still a plain float in [0, 1].
    value = pass_at_k(1000, 1, 10)
    assert math.isfinite(value) and value == pytest.approx(0.01)


@dataclass
class Example:  # the fields evaluate() reads; same shape as tasks.Example
    prompt: list
    gold: str | None
    reference: str = ""
    meta: dict = field(default_factory=dict)
    uid: str = ""


class FixtureTask:
    """A verifier that passes any completion containing the gold character; `sim` scores its length."""

    def __init__(self, has_verifier=True):
        self.name, self.has_verifier = "fixture", has_verifier

    def extract(self, completion):
        return completion[-1:]

    def reward(self, completion, example, kind="exact"):
        if kind == "exact":
            assert self.has_verifier, "evaluate must not ask a task without a verifier for exact rewards"
            return float(example.gold in completion)
        return min(1.0, len(completion) / 100)


def _examples(n):
    return [Example([{"role": "user", "content": f"Say {i}"}], gold=str(i % 10), uid=f"ex{i}") for i in range(n)]


@pytest.fixture(scope="module")
def sampler(tiny_model_dir):
    from rollout import make_sampler

    s = make_sampler("hf", tiny_model_dir, dtype="float32", seed=0)
    yield s
    s.close()


def test_encode_prompts_uses_chat_template(sampler):
    ids = encode_prompts(sampler.tokenizer, _examples(2))
    text = sampler.tokenizer.decode(ids[0])
    assert text == "<|im_start|>user\nSay 0<|im_end|>\n<|im_start|>assistant\n"
    assert len(ids) == 2 and all(isinstance(t, int) for t in ids[1])


def test_evaluate_summary_and_records(sampler):
    examples = _examples(5)
    result = evaluate(sampler, FixtureTask(), examples, samples=4, max_tokens=6, batch_size=2, progress=False)
    summary, records = result["summary"], result["examples"]
    assert summary["n"] == 5 and len(records) == 5
    assert [r["uid"] for r in records] == [f"ex{i}" for i in range(5)]
    for r in records:
        assert set(r) >= {"uid", "prompt", "completion", "answer", "reward", "sampled_rewards"}
        assert r["reward"] == float(r["gold"] in r["completion"]) and len(r["sampled_rewards"]) == 4
        assert r["answer"] == r["completion"][-1:]
    assert summary["pass@1"] == pytest.approx(sum(r["reward"] for r in records) / 5)
    assert list(summary["pass@k"]) == ["1", "2", "4"]
    # pass@1 from samples is the mean sampled reward for 0/1 rewards; pass@k grows with k
    assert summary["pass@k"]["1"] == pytest.approx(summary["sampled_reward_mean"])
    assert summary["pass@k"]["1"] <= summary["pass@k"]["2"] <= summary["pass@k"]["4"]
    assert summary["trunc_frac"] == pytest.approx(sum(r["finish_reason"] == "length" for r in records) / 5)
    # greedy is deterministic: a second run gives the same completions
    again = evaluate(sampler, FixtureTask(), examples[:2], max_tokens=6, progress=False)
    assert [r["completion"] for r in again["examples"]] == [r["completion"] for r in records[:2]]


def test_evaluate_without_verifier_reports_similarity(sampler, capsys):
    result = evaluate(sampler, FixtureTask(has_verifier=False), _examples(2), max_tokens=4, progress=False)
    assert "no verifier" in capsys.readouterr().out
    summary = result["summary"]
    assert summary["reward_kind"] == "sim" and "pass@1" not in summary
    assert summary["sim_reward"] == pytest.approx(sum(r["reward"] for r in result["examples"]) / 2)


def test_cli_writes_json(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "eval.json"
    result = main(
        [
            "--model",
            tiny_model_dir,
            "--task",
            "arith",
            "--limit",
            "3",
            "--samples",
            "2",
            "--max-tokens",
            "4",
            "--sampler",
            "hf",
            "--out",
            str(out),
        ]
    )
    data = json.loads(out.read_text())
    assert data["summary"]["n"] == 3 and data["summary"]["task"] == "arith"
    assert data["summary"]["model"] == tiny_model_dir and set(data["summary"]["pass@k"]) == {"1", "2"}
    assert len(data["examples"]) == 3 and data == json.loads(json.dumps(result))
    for record in data["examples"]:
        assert isinstance(record["completion"], str) and record["reward"] in (0.0, 1.0)
        assert isinstance(record["prompt"], list) and record["prompt"][-1]["content"]
    assert "pass@1 (greedy)" in capsys.readouterr().out


def test_cli_countdown_sim_joins_the_demo_file(tiny_model_dir, tmp_path, capsys):
    """--reward sim on countdown: the puzzles of --data-file with a demonstration in --demo-file (tasks.py)."""
    puzzles = [{"nums": [8, 3, 3, 8], "target": 24}, {"nums": [1, 2, 3], "target": 6}]
    for split in ("train", "test"):
        (tmp_path / f"puzzles-{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in puzzles))
    demos = tmp_path / "gold.jsonl"
    demos.write_text(
        json.dumps(
            {
                "nums": [3, 8, 3, 8],
                "target": 24,
                "messages": [
                    {"role": "user", "content": "Make 24."},
                    {
                        "role": "assistant",
                        "content": "<think>8 / (1/3) is 24</think>\n<answer>8 / (3 - 8 / 3)</answer>",
                    },
                ],
            }
        )
        + "\n"
    )
    out = tmp_path / "eval.json"
    main(
        [
            "--model",
            tiny_model_dir,
            "--task",
            "countdown",
            "--reward",
            "sim",
            "--data-file",
            str(tmp_path / "puzzles-{split}.jsonl"),
            "--demo-file",
            str(demos),
            "--max-tokens",
            "4",
            "--sampler",
            "hf",
            "--out",
            str(out),
        ]
    )
    data = json.loads(out.read_text())
    assert data["summary"]["n"] == 1 and data["summary"]["reward_kind"] == "sim"
    assert [r["reference"] for r in data["examples"]] == ["8 / (3 - 8 / 3)"]
    assert "note: 1 of 2 countdown test puzzles have no demonstration" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--task", "arith"], "--model"),
        (["--model", "x", "--task", "countdown", "--demo-file", "gold.jsonl"], "read only when the reward uses sim"),
        (["--model", "x", "--task", "arith", "--samples", "-1"], "--samples"),
        (["--model", "x", "--task", "arith", "--limit", "0"], "--limit"),
        (["--model", "x", "--task", "no-such-task"], "no-such-task"),
    ],
)
def test_cli_bad_flags_one_line_exit_2(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(flags)
    stderr = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert message in stderr and len(stderr.strip().splitlines()) == 1


def test_cli_nan_model_one_line_exit_2(tiny_model_dir, tmp_path, capsys):
    """Greedy decoding of a model with NaN weights stops with one line instead of scoring argmax-of-NaN text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        model.model.norm.weight.fill_(float("nan"))
    model.save_pretrained(tmp_path / "nan")
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(tmp_path / "nan")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "--model",
                str(tmp_path / "nan"),
                "--task",
                "arith",
                "--limit",
                "2",
                "--max-tokens",
                "3",
                "--sampler",
                "hf",
                "--out",
                str(tmp_path / "eval.json"),
            ]
        )
    stderr = capsys.readouterr().err
    last = stderr.strip().splitlines()[-1]  # after transformers' loading bar
    assert exit_info.value.code == 2 and last.startswith("eval.py: error: ") and "not finite" in last
    assert "Traceback" not in stderr
    assert not (tmp_path / "eval.json").exists()


@pytest.mark.parametrize("kind", ["missing", "empty"])
def test_cli_unloadable_model_one_line_exit_2(kind, tmp_path, capsys, monkeypatch):
    """No such path, or a folder without a model: one line naming the model, --model and HF_HUB_OFFLINE."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a wrong path must not wait on the network
    model = tmp_path / "no-such-model" if kind == "missing" else tmp_path
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "--model",
                str(model),
                "--task",
                "arith",
                "--limit",
                "2",
                "--sampler",
                "hf",
                "--out",
                str(tmp_path / "eval.json"),
            ]
        )
    stderr = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(stderr.strip().splitlines()) == 1
    assert stderr.startswith(f"eval.py: error: cannot load model {str(model)!r}")
    assert "--model" in stderr and "HF_HUB_OFFLINE" in stderr and "Traceback" not in stderr


# ---- the result file: checked writable before anything loads, printed first, written atomically


def test_an_unwritable_output_is_refused_before_anything_loads(tiny_model_dir, tmp_path, capsys, monkeypatch):
    import tempfile

    import eval as eval_module

    (tmp_path / "a_file").write_text("x")
    cases = [
        (tmp_path, "is a folder"),
        (tmp_path / "a_file" / "out.json", "does not exist (or is a file)"),
        (tmp_path / "no" / "out.json", "does not exist"),
    ]
    for out, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            main(["--model", tiny_model_dir, "--task", "arith", "--out", str(out)])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.count("\n") == 1 and message in err, err

    def read_only(*args, **kwargs):  # a read-only model folder (the default --out); chmod does not stop root
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    monkeypatch.setattr(eval_module, "get_task", lambda name: pytest.fail("loaded the task before the check"))
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", tiny_model_dir, "--task", "arith"])  # writes beside the model by default
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1
    assert f"cannot write {tiny_model_dir}/eval_arith_test.json: {tiny_model_dir} is not writable" in err


def test_a_full_disk_keeps_the_earlier_result_and_prints_the_summary(tiny_model_dir, tmp_path, capsys, monkeypatch):
    import errno

    out = tmp_path / "eval.json"
    flags = [
        "--model",
        tiny_model_dir,
        "--task",
        "arith",
        "--limit",
        "2",
        "--max-tokens",
        "2",
        "--sampler",
        "hf",
        "--out",
        str(out),
    ]
    main(flags)
    earlier = out.read_bytes()
    capsys.readouterr()
    real_dump = json.dump

    def fills_the_disk(obj, f, **kwargs):
        f.write(json.dumps(obj)[:4096])  # what a full disk left: the first 4 KiB
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(json, "dump", fills_the_disk)
    with pytest.raises(SystemExit) as exit_info:
        main(flags)
    monkeypatch.setattr(json, "dump", real_dump)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert exit_info.value.code == 1 and lines[-1].startswith("eval.py: error: cannot write ")
    assert "No space left on device" in lines[-1] and "as it was" in lines[-1] and "Traceback" not in captured.err
    assert "pass@1 (greedy)" in captured.out  # the result reached the screen before the disk failed
    assert out.read_bytes() == earlier and sorted(os.listdir(tmp_path)) == ["eval.json"]  # no partial file left


# ---- --reward-weights, as train.py takes it: any term of rewards.REWARD_TERMS, a fork's own too


def test_a_registered_reward_term_reaches_the_result(tiny_model_dir, tmp_path, monkeypatch, capsys):
    import rewards

    def brevity(completion, example):  # a fork's term, registered as docs/fork.md's recipe does
        return 1.0 / (1 + len(completion))

    monkeypatch.setitem(rewards.REWARD_TERMS, "brevity", brevity)
    out = tmp_path / "eval.json"
    result = main(
        [
            "--model",
            tiny_model_dir,
            "--task",
            "arith",
            "--limit",
            "3",
            "--samples",
            "2",
            "--max-tokens",
            "4",
            "--sampler",
            "hf",
            "--reward-weights",
            "exact=1,brevity=0.5",
            "--out",
            str(out),
        ]
    )
    summary, records = result["summary"], result["examples"]
    assert json.loads(out.read_text())["summary"] == summary and summary["reward_kind"] == "weighted"
    for r in records:
        assert r["terms"]["brevity"] == brevity(r["completion"], None) and r["terms"]["exact"] in (0.0, 1.0)
        assert r["reward"] == r["terms"]["exact"] + 0.5 * r["terms"]["brevity"]  # r = sum_k w_k r_k
        assert len(r["sampled_rewards"]) == 2
    assert summary["reward/brevity"] == pytest.approx(sum(brevity(r["completion"], None) for r in records) / 3)
    assert summary["reward/mean"] == pytest.approx(sum(r["reward"] for r in records) / 3)
    assert summary["pass@1"] == pytest.approx(sum(r["terms"]["exact"] for r in records) / 3)  # the verifier's term
    assert set(summary["pass@k"]) == {"1", "2"}
    assert "reward/brevity" in capsys.readouterr().out


def test_without_reward_weights_the_result_is_the_single_reward(tiny_model_dir, tmp_path):
    """No --reward-weights: the records and summary keep their keys; exact=1 gives the same numbers."""
    flags = [
        "--model",
        tiny_model_dir,
        "--task",
        "arith",
        "--limit",
        "3",
        "--samples",
        "2",
        "--max-tokens",
        "4",
        "--sampler",
        "hf",
        "--out",
        str(tmp_path / "eval.json"),
    ]
    plain, weighted = main(flags), main(flags + ["--reward-weights", "exact=1"])
    assert "terms" not in plain["examples"][0] and "reward/mean" not in plain["summary"]
    assert [r["reward"] for r in plain["examples"]] == [r["reward"] for r in weighted["examples"]]
    assert plain["summary"]["pass@1"] == weighted["summary"]["pass@1"]
    assert plain["summary"]["pass@k"] == weighted["summary"]["pass@k"]


@pytest.mark.parametrize(
    "weights, message",
    [
        ("nope=1", "--reward-weights: unknown term 'nope'"),
        ("exact=x", "the weight of exact must be a finite number"),
        ("exact", "is not TERM=WEIGHT"),
    ],
)
def test_a_bad_reward_weights_is_one_line_exit_2_before_the_model_loads(weights, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "--model",
                str(tmp_path / "no-model"),
                "--task",
                "arith",
                "--reward-weights",
                weights,
                "--out",
                str(tmp_path / "eval.json"),
            ]
        )
    stderr = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(stderr.strip().splitlines()) == 1
    assert stderr.startswith("eval.py: error: ") and message in stderr and not (tmp_path / "eval.json").exists()
