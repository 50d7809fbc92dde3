"""The README's "Fork it" edits, performed exactly as written: a new estimator, a new task, a new aggregation, a
new reward term.

Each code block below is the README's, character for character (test_readme_shows_exactly_this_code
checks it), and is executed in its stage module's namespace, which is what pasting it into that file
does. The stage functions must then pick the new entry up, and train.py must train two steps with all four.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from test_loss import assert_invariant_to_micro_batches_and_ranks

import advantage
import loss
import rewards
import tasks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ESTIMATOR = '''\
def floorgrpo_advantages(rewards: torch.Tensor, std_floor: float = 0.1) -> torch.Tensor:
    """GRPO with the group std floored at std_floor, so near-constant groups are not blown up."""
    rewards = _as_groups(rewards, "floorgrpo_advantages")
    mean = rewards.mean(-1, keepdim=True)
    std = rewards.std(-1, keepdim=True, correction=0)
    return (rewards - mean) / std.clamp(min=std_floor)  # (G, M)


ESTIMATORS["floorgrpo"] = floorgrpo_advantages
'''

TASK = '''\
def _qa(row: dict) -> Example:
    return Example(prompt=_chat(f"{row['problem']}\\n{BOXED}"), gold=str(row["answer"]), reference="")


TASKS["qa"] = Task(name="qa", columns=("problem", "answer"), key=("problem",), make_example=_qa,
                   verifier=lambda completion, ex: math_reward(completion, ex.gold), answer=_boxed_or_answer)
'''

AGGREGATION = '''\
def seq_mean_token_sum(mask, norm_len):
    """Each sequence's token sum, averaged over the minibatch's sequences: long answers weigh more."""
    return mask, sequences(mask)  # the rows with a token: --mask-truncated empties the cut ones


AGGREGATIONS["seq-mean-token-sum"] = seq_mean_token_sum
'''

REWARD_TERM = '''\
@_reward
def brevity_reward(completion, example) -> float:
    """1 for an answer of at most 50 words, falling to 0 at 250: a length term to weigh against the others."""
    return min(1.0, max(0.0, (250 - len(final_answer(completion).split())) / 200))


REWARD_TERMS["brevity"] = brevity_reward
'''

EDITS = [(advantage, ESTIMATOR, "ESTIMATORS", "floorgrpo"), (tasks, TASK, "TASKS", "qa"),
         (loss, AGGREGATION, "AGGREGATIONS", "seq-mean-token-sum"), (rewards, REWARD_TERM, "REWARD_TERMS", "brevity")]


@pytest.fixture
def forked():
    """Paste each block into its module (exec in the module's namespace); undo it afterwards."""
    before = [(module, set(vars(module))) for module, *_ in EDITS]
    for module, code, _, _ in EDITS:
        exec(compile(code, f"<{module.__name__}.py, Fork it>", "exec"), vars(module))
    yield
    for (module, names), (_, _, registry, key) in zip(before, EDITS):
        getattr(module, registry).pop(key)
        for name in set(vars(module)) - names:
            delattr(module, name)


def test_the_new_estimator_and_its_hyperparameter_are_picked_up(forked):
    from advantage import compute_advantages, estimator_params, population_weight
    from grad_alloc import allocation_by_estimator

    assert estimator_params()["std_floor"] == (0.1, float)  # train.py and grad_alloc.py build --std-floor from this
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.5]])  # std 0.433; a constant group
    adv = compute_advantages("floorgrpo", rewards, tau=0.3, std_floor=0.5)  # every estimator's flags passed along
    assert torch.allclose(adv[0], torch.tensor([0.75, -0.25, -0.25, -0.25]) / 0.5)  # the floor is the divisor
    assert torch.equal(adv[1], torch.zeros(4))
    assert torch.allclose(compute_advantages("floorgrpo", rewards)[0],
                          compute_advantages("grpo", rewards)[0], atol=1e-5)  # std > default floor: GRPO
    assert torch.isfinite(population_weight("floorgrpo", 8, torch.tensor([0.1, 0.5]), std_floor=0.2)).all()
    assert sum(allocation_by_estimator(rewards, torch.ones(2, 4), ["floorgrpo"], std_floor=0.2)["floorgrpo"]) == \
        pytest.approx(100.0)


@pytest.fixture
def qa_file(tmp_path):
    path = tmp_path / "qa.jsonl"
    rows = [{"problem": f"What is {a} times {b}?", "answer": str(a * b)} for a in range(2, 10) for b in range(2, 10)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_the_new_task_is_picked_up(forked, qa_file):
    from tasks import get_task

    task = get_task("qa")
    train_rows, test_rows = task.load("train", data_file=qa_file), task.load("test", data_file=qa_file)
    assert len(train_rows) + len(test_rows) == 64 and test_rows  # held-out by hash, disjoint
    assert not {ex.uid for ex in train_rows} & {ex.uid for ex in test_rows}
    ex = train_rows[0]
    right = ex.prompt[-1]["content"].split("?")[0].split()
    product = int(right[2]) * int(right[4])
    assert task.reward(f"<think>multiply</think> So \\boxed{{{product}}}.", ex) == 1.0
    assert task.reward(f"<think>multiply</think> So \\boxed{{{product + 1}}}.", ex) == 0.0
    assert task.extract(f"<think>x</think> \\boxed{{{product}}}") == str(product)
    with pytest.raises(tasks.DataError, match="--data-file"):
        task.load("train")  # no hub dataset: one line asking for the file


def test_the_new_aggregation_is_picked_up_and_invariant(forked):
    from loss import aggregate, loss_denominator

    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert aggregate(values, mask, "seq-mean-token-sum") == pytest.approx((6 + 4) / 2)
    assert loss_denominator(mask, "seq-mean-token-sum") == 2
    assert_invariant_to_micro_batches_and_ranks("seq-mean-token-sum")


def test_the_new_reward_term_is_picked_up(forked):
    from tasks import get_task, reward_weights

    task = get_task("arith")
    assert reward_weights(task, "exact", "exact=1,brevity=0.1") == {"exact": 1.0, "brevity": 0.1}  # --reward-weights
    example = task.load("test", limit=1)[0]
    assert task.reward("<think>add</think> 12", example, kind="brevity") == 1.0  # 1 word
    assert task.reward("<think>add</think> " + "word " * 150, example, kind="brevity") == pytest.approx(0.5)
    assert task.reward("word " * 400, example, kind="brevity") == 0.0


@pytest.mark.slow
def test_train_runs_two_steps_with_all_four_edits(qa_file, tiny_model_dir, tmp_path):
    """The four blocks pasted at the end of copies of their files (below each registry), then the README's
    flags on the command line: --advantage floorgrpo --std-floor, --task qa, --loss-agg seq-mean-token-sum,
    --reward-weights exact=1,brevity=0.1.

    A fresh process, as for a real fork: train.py builds its flags (config.Args) when it is imported, so an
    edit exec'd into a module this test process already imported would not reach them."""
    from plumbing.checkpoint import find_checkpoint, read_trainer_state

    fork = tmp_path / "fork"
    fork.mkdir()
    for name in os.listdir(ROOT):  # the stage files, and the folders below and above them
        if name.endswith(".py"):
            shutil.copy(os.path.join(ROOT, name), fork / name)
        elif name in ("plumbing", "speed", "tools"):
            shutil.copytree(os.path.join(ROOT, name), fork / name, ignore=shutil.ignore_patterns("__pycache__"))
    for module, code, _, _ in EDITS:
        with open(fork / f"{module.__name__}.py", "a") as f:
            f.write(f"\n\n{code}")
    run = tmp_path / "run"
    result = subprocess.run([sys.executable, "train.py", "--task", "qa", "--data-file", qa_file, "--advantage",
                             "floorgrpo", "--std-floor", "0.2", "--loss-agg", "seq-mean-token-sum", "--model",
                             tiny_model_dir, "--reward-weights", "exact=1,brevity=0.1", "--M", "4", "--rollout-batch",
                             "4", "--micro-batch", "8", "--steps", "2",
                             "--max-tokens", "4", "--warmup-steps", "0", "--eval-examples", "0", "--dtype", "float32",
                             "--out-dir", str(run)], cwd=fork, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(run / "metrics.jsonl") as f:
        metrics = [json.loads(line) for line in f]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(torch.isfinite(torch.tensor(m["loss/pg"])) for m in metrics)
    assert all("alloc/floorgrpo/0.9-1" in m for m in metrics)  # the new estimator reached grad_alloc too
    assert all(0.0 <= m["reward/brevity"] <= 1.0 and "reward/exact" in m for m in metrics)  # each term logged
    saved = read_trainer_state(find_checkpoint(str(run)))["args"]
    assert (saved["task"], saved["advantage"], saved["std_floor"], saved["loss_agg"]) == \
        ("qa", "floorgrpo", 0.2, "seq-mean-token-sum")


def test_readme_shows_exactly_this_code():
    readme = open(os.path.join(ROOT, "README.md")).read()
    section = readme.split("## Fork it", 1)[1].split("\n## ", 1)[0]
    for block in (ESTIMATOR, TASK, AGGREGATION, REWARD_TERM):
        assert f"```python\n{block}```" in section
