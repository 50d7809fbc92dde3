"""Tasks: loaders on fixture files (through the hub code path and --data-file), prompts, splits, rewards."""

import json
from pathlib import Path

import datasets
import pytest

import tasks
from rewards import countdown_reward
from tasks import BOXED, POETRY_SYSTEM, DataError, get_task, solve_countdown

FIXTURES = Path(__file__).parent / "fixtures"
HUB_FIXTURES = {  # hub id -> invented rows with that dataset's column names
    "openai/gsm8k": "gsm8k.jsonl",
    "Jiayi-Pan/Countdown-Tasks-3to4": "countdown.jsonl",
    "zwhe99/DeepMath-103K": "deepmath.jsonl",
    "jnb666/poems": "poems.jsonl",  # columns the user must supply (the hub has poems only)
    "microsoft/MeetingBank-LLMCompressed": "meetingbank.jsonl",
}
HUB_TASKS = {"gsm8k": "gsm8k.jsonl", "countdown": "countdown.jsonl", "deepmath": "deepmath.jsonl",
             "poetry": "poems.jsonl", "meetingbank": "meetingbank.jsonl"}


def rows(name):
    return [json.loads(line) for line in (FIXTURES / name).read_text().splitlines()]


@pytest.fixture
def fake_hub(monkeypatch):
    """datasets.load_dataset(hub_id, ...) answers with the fixture file; returns the calls made."""
    real, calls = datasets.load_dataset, []

    def load_dataset(path, name=None, split=None, **kwargs):
        if path not in HUB_FIXTURES:
            return real(path, name, split=split, **kwargs)
        calls.append((path, name, split))
        return real("json", data_files=str(FIXTURES / HUB_FIXTURES[path]), split="train")

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(tasks, "_hub_reachable", lambda timeout=3.0: True)
    return calls


def test_registry():
    assert set(tasks.TASKS) == {"gsm8k", "countdown", "deepmath", "poetry", "meetingbank", "arith", "countdown24"}
    assert get_task("gsm8k").hub_id == "openai/gsm8k"
    with pytest.raises(ValueError, match="choose one of gsm8k, countdown"):
        get_task("mnist")


@pytest.mark.parametrize("name", HUB_TASKS)
def test_hub_and_data_file_give_the_same_examples(fake_hub, name):
    task = get_task(name)
    hub = task.load("train") + task.load("test")
    assert fake_hub and fake_hub[0][0] == task.hub_id
    path = str(FIXTURES / HUB_TASKS[name])
    local = task.load("train", data_file=path) + task.load("test", data_file=path)
    assert len(local) == len(rows(HUB_TASKS[name]))  # a single file: train + held-out test = every row
    if name != "gsm8k":  # gsm8k reads the hub's own test split, the file is split by hash
        assert sorted(e.uid for e in hub) == sorted(e.uid for e in local)
    for example in local:
        assert example.uid.startswith(f"{name}-")
        assert example.prompt[-1]["role"] == "user" and example.prompt[-1]["content"]
        assert "<think>" in example.prompt[0]["content"]  # think-then-answer format rule
        json.dumps(example.meta)  # JSON-serialisable


def test_gsm8k_uses_the_hub_test_split(fake_hub):
    get_task("gsm8k").load("test")
    assert fake_hub == [("openai/gsm8k", "main", "test")]


def test_gsm8k_examples(fake_hub):
    examples = {e.prompt[-1]["content"].split("\n")[0]: e for e in get_task("gsm8k").load("train", limit=None)}
    examples |= {e.prompt[-1]["content"].split("\n")[0]: e for e in get_task("gsm8k").load("test")}
    apples = examples["A shop sold 1,200 apples on Monday and twice as many on Tuesday. "
                      "How many apples did it sell on both days?"]
    assert apples.gold == "3600"  # "#### 3,600"
    assert apples.prompt[-1]["content"].endswith(BOXED)
    assert "<<" not in apples.reference and apples.reference.endswith("\\boxed{3600}.")
    task = get_task("gsm8k")
    assert task.reward("<think>2400 + 1200</think> \\boxed{3,600}", apples) == 1.0
    assert task.reward("<think>2400 + 1200</think> \\boxed{3500}", apples) == 0.0
    assert task.reward(apples.reference, apples, kind="sim") == 1.0
    assert task.extract("<think>t</think> so \\boxed{3600} apples") == "3600"


def test_deepmath_reference_is_the_shortest_solution_without_thinking(fake_hub):
    examples = get_task("deepmath").load("train") + get_task("deepmath").load("test")
    limit = next(e for e in examples if "sin 3x" in e.prompt[-1]["content"])
    row = next(r for r in rows("deepmath.jsonl") if "sin 3x" in r["question"])
    assert row["r1_solution_2"] == min((row[f"r1_solution_{i}"] for i in (1, 2, 3)), key=len)
    assert limit.reference == "By L'Hopital's rule the limit is $3\\cos 0 = 3$.\n\\boxed{3}"
    assert limit.gold == "3" and limit.prompt[-1]["content"].endswith(BOXED)
    half = next(e for e in examples if "fair die" in e.prompt[-1]["content"])
    assert get_task("deepmath").reward("<think>3 of 6</think> $\\boxed{0.5}$", half) == 1.0


def test_countdown_examples_and_rewards(fake_hub, tmp_path):
    task = get_task("countdown")
    examples = task.load("train") + task.load("test")
    puzzle = next(e for e in examples if e.meta["numbers"] == [8, 3, 3, 8])
    assert puzzle.meta["target"] == 24 and puzzle.gold == "24"
    assert "step by step" not in puzzle.prompt[-1]["content"]  # Countdown adds no instruction
    assert task.reward("<think>hm</think> 8 / (3 - 8 / 3)", puzzle) == 1.0
    assert task.reward("<think>hm</think> 8 * 3", puzzle) == 0.0
    assert task.extract("<think>hm</think> \\boxed{8 × 3}") == "8 * 3"
    with pytest.raises(DataError, match="reference"):  # no demonstrations in Countdown-Tasks-3to4
        task.reward("8 * 3", puzzle, kind="sim")
    # a `reference` column in a data file supplies them (e.g. built from Countdown-Task-GOLD)
    path = tmp_path / "countdown-{split}.jsonl"
    for split in ("train", "test"):
        Path(str(path).replace("{split}", split)).write_text(
            json.dumps({"nums": [8, 3, 3, 8], "target": 24, "reference": "8 / (3 - 8 / 3)"}) + "\n")
    [example] = task.load("test", data_file=str(path))  # "{split}": the whole file is the split
    assert example.reference == "8 / (3 - 8 / 3)"
    assert task.reward("8 / (3 - 8 / 3)", example, kind="sim") == 1.0


def test_non_verifiable_tasks(fake_hub):
    poem = (get_task("poetry").load("train") + get_task("poetry").load("test"))[0]
    assert poem.prompt[0] == {"role": "system", "content": POETRY_SYSTEM}
    assert POETRY_SYSTEM.startswith("You are a helpful assistant that writes poetry.")
    assert poem.gold is None and poem.reference
    meeting = (get_task("meetingbank").load("train") + get_task("meetingbank").load("test"))[0]
    assert "Speaker 1" in meeting.prompt[-1]["content"] and meeting.reference
    for task, example in [(get_task("poetry"), poem), (get_task("meetingbank"), meeting)]:
        assert not task.has_verifier
        with pytest.raises(ValueError, match=f"{task.name} has no verifier: use --reward sim"):
            task.reward("anything", example, kind="exact")
        assert task.reward(f"<think>x</think>{example.reference}", example, kind="sim") == 1.0
        words = example.reference.split()
        partial = " ".join(words[: len(words) // 2])
        assert 0.0 < task.reward(f"<think>x</think>{partial}", example, kind="sim") < 1.0
    with pytest.raises(ValueError, match="unknown reward kind"):
        get_task("poetry").reward("x", poem, kind="judge")


def test_held_out_split_is_deterministic_disjoint_and_complete(fake_hub):
    task = get_task("deepmath")  # 6 rows: 4 train, 2 held out
    train, test = task.load("train"), task.load("test")
    assert train and test and {e.uid for e in train}.isdisjoint(e.uid for e in test)
    assert len(train) + len(test) == len(rows("deepmath.jsonl"))
    assert [e.uid for e in task.load("test")] == [e.uid for e in test]
    assert sorted(e.uid for e in task.load("train", seed=1)) == sorted(e.uid for e in train)  # seed: order only
    assert len(task.load("train", limit=2)) == 2


def test_parquet_data_file(tmp_path):
    path = tmp_path / "gsm8k.parquet"
    datasets.load_dataset("json", data_files=str(FIXTURES / "gsm8k.jsonl"), split="train").to_parquet(str(path))
    task = get_task("gsm8k")
    from_parquet = task.load("train", data_file=str(path)) + task.load("test", data_file=str(path))
    from_jsonl = task.load("train", data_file=str(FIXTURES / "gsm8k.jsonl"))
    from_jsonl += task.load("test", data_file=str(FIXTURES / "gsm8k.jsonl"))
    assert [(e.uid, e.gold, e.reference) for e in from_parquet] == [(e.uid, e.gold, e.reference) for e in from_jsonl]


def one_line_error(call) -> str:
    with pytest.raises(DataError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    return message


def test_data_errors_are_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(tasks, "_hub_reachable", lambda timeout=3.0: False)
    message = one_line_error(lambda: get_task("deepmath").load("train"))
    assert "zwhe99/DeepMath-103K" in message and "--data-file" in message

    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub\nTraceback (most recent call last): ...")

    monkeypatch.setattr(tasks, "_hub_reachable", lambda timeout=3.0: True)
    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    message = one_line_error(lambda: get_task("gsm8k").load("test"))
    assert "openai/gsm8k" in message and "--data-file" in message
    monkeypatch.undo()

    assert "no such file" in one_line_error(lambda: get_task("gsm8k").load(data_file=str(tmp_path / "x.jsonl")))
    assert ".parquet" in one_line_error(lambda: get_task("gsm8k").load(data_file=str(tmp_path / "x.csv")))
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    assert "line 1 is not valid JSON" in one_line_error(lambda: get_task("gsm8k").load(data_file=str(broken)))
    poems_only = tmp_path / "poems.jsonl"
    poems_only.write_text(json.dumps({"poem": "Roses", "author": "anon"}) + "\n")
    message = one_line_error(lambda: get_task("poetry").load(data_file=str(poems_only)))
    assert "instruction" in message and "--data-file" in message
    assert "split" in one_line_error(lambda: get_task("arith").load("validation"))
    assert "no --data-file" in one_line_error(lambda: get_task("arith").load(data_file=str(broken)))


# ---------------------------------------------------------------- procedural tasks
def test_arith_streams_are_disjoint_and_seeded():
    task = get_task("arith")
    train, test = task.load("train"), task.load("test")
    assert len(train) == 5000 and len(test) == 64  # test: every held-out problem once
    problems = lambda examples: {e.prompt[-1]["content"] for e in examples}  # noqa: E731
    assert len(problems(train)) == 192 and problems(train).isdisjoint(problems(test))
    uids = lambda seed: [e.uid for e in task.load("train", limit=50, seed=seed)]  # noqa: E731
    assert uids(3) == uids(3) and uids(3) != uids(4)
    example = test[0]
    a, b = example.meta["a"], example.meta["b"]
    assert example.prompt == [{"role": "user", "content": f"What is {a} + {b}?"}]
    assert task.reward(f"{a} + {b} = {a + b}.", example) == 1.0
    assert task.reward(f"It is {a + b + 1}", example) == 0.0
    assert task.extract(f"so {a + b} apples") == str(a + b)


def test_countdown24_puzzles_are_solvable_and_splits_disjoint():
    task = get_task("countdown24")
    train, test = task.load("train", limit=1500), task.load("test")
    for example in train + test:
        numbers = example.meta["numbers"]
        assert len(numbers) == 4 and all(1 <= n <= 13 for n in numbers) and example.meta["target"] == 24
        # the stored solution is a witness: the exact verifier accepts it with these numbers
        assert countdown_reward(example.reference, numbers, 24) == 1.0
    quads = lambda examples: {tuple(sorted(e.meta["numbers"])) for e in examples}  # noqa: E731
    assert quads(train).isdisjoint(quads(test))
    assert len(quads(test)) == len(test) > 50  # each held-out puzzle once
    assert solve_countdown((1, 1, 1, 1)) is None and solve_countdown((3, 3, 8, 8)) is not None
    assert task.reward("<think>x</think> " + test[0].reference, test[0]) == 1.0


def test_bad_rows_and_repeated_prompts(tmp_path):
    path = tmp_path / "countdown.jsonl"
    path.write_text("".join(json.dumps({"nums": [1, 2], "target": 3}) + "\n" for _ in range(3)))
    uids = [e.uid for e in get_task("countdown").load("train", data_file=str(tmp_path / "countdown.jsonl"))]
    uids += [e.uid for e in get_task("countdown").load("test", data_file=str(path))]
    assert len(uids) == 3 and len(set(uids)) == 3  # same prompt, same split, distinct ids
    path.write_text(json.dumps({"nums": ["x"], "target": 3}) + "\n")
    message = one_line_error(lambda: get_task("countdown").load("train", data_file=str(path))
                             + get_task("countdown").load("test", data_file=str(path)))
    assert "line 1 is not a valid countdown example" in message


def test_task_is_built_with_keywords_and_one_entry_adds_one():
    from tasks import TASKS, Example, Task, get_task
    with pytest.raises(TypeError):
        Task("x", "hub/id")  # positional arguments are refused: every field is named where it is set
    task = Task(name="parity", generate=lambda split, limit, seed: [
                    Example(prompt=[{"role": "user", "content": f"Is {n} even? yes/no"}], gold="yes" if n % 2 == 0
                            else "no", reference="", uid=f"parity-{n}") for n in range(limit)],
                verifier=lambda completion, ex: float(completion.strip().lower() == ex.gold))
    assert task.has_verifier and not Task(name="free", hub_id="a/b").has_verifier
    TASKS["parity"] = task
    try:
        examples = get_task("parity").load("train", limit=3)
        assert [get_task("parity").reward(text, ex) for text, ex in zip(["yes", "No", "no"], examples)] == [1, 1, 0]
        assert get_task("parity").extract("<think>hm</think> yes") == "yes"  # the default answer extractor
    finally:
        del TASKS["parity"]
