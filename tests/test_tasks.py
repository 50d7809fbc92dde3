"""Tasks: loaders on fixture files (through the hub code path and --data-file), prompts, splits, rewards."""

import hashlib
import json
import re
from pathlib import Path

import datasets
import pytest

import tasks
from plumbing import data
from rewards import countdown_reward
from tasks import BOXED, POETRY_SYSTEM, DataError, get_task, reward_weights, solve_countdown

FIXTURES = Path(__file__).parent / "fixtures"
HUB_FIXTURES = {  # hub id -> invented rows with that dataset's column names
    "openai/gsm8k": "gsm8k.jsonl",
    "Jiayi-Pan/Countdown-Tasks-3to4": "countdown.jsonl",
    "zwhe99/DeepMath-103K": "deepmath.jsonl",
    "jnb666/poems": "poems.jsonl",  # columns the user must supply (the hub has poems only)
    "microsoft/MeetingBank-LLMCompressed": "meetingbank.jsonl",
}
HUB_TASKS = {
    "gsm8k": "gsm8k.jsonl",
    "countdown": "countdown.jsonl",
    "deepmath": "deepmath.jsonl",
    "poetry": "poems.jsonl",
    "meetingbank": "meetingbank.jsonl",
}


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
    monkeypatch.setattr(data, "hub_reachable", lambda timeout=3.0: True)
    return calls


def test_registry():
    assert {"gsm8k", "countdown", "deepmath", "poetry", "meetingbank", "openthoughts", "arith", "countdown24"} <= set(
        tasks.TASKS
    )  # the paper's tasks and the demos; a fork may add its own
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
    apples = examples[
        "A shop sold 1,200 apples on Monday and twice as many on Tuesday. How many apples did it sell on both days?"
    ]
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
    # a `reference` column in a data file supplies them (e.g. built from Countdown-Task-GOLD)
    path = tmp_path / "countdown-{split}.jsonl"
    for split in ("train", "test"):
        Path(str(path).replace("{split}", split)).write_text(
            json.dumps({"nums": [8, 3, 3, 8], "target": 24, "reference": "8 / (3 - 8 / 3)"}) + "\n"
        )
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
        with pytest.raises(ValueError, match=f"{task.name} has no verifier, so no exact term: use --reward sim"):
            reward_weights(task, "exact", "")  # the door: Task.reward is never asked for "exact" on it
        assert task.reward(f"<think>x</think>{example.reference}", example, kind="sim") == 1.0
        words = example.reference.split()
        partial = " ".join(words[: len(words) // 2])
        assert 0.0 < task.reward(f"<think>x</think>{partial}", example, kind="sim") < 1.0


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
    monkeypatch.setattr(data, "hub_reachable", lambda timeout=3.0: False)
    message = one_line_error(lambda: get_task("deepmath").load("train"))
    assert "zwhe99/DeepMath-103K" in message and "--data-file" in message

    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub\nTraceback (most recent call last): ...")

    monkeypatch.setattr(data, "hub_reachable", lambda timeout=3.0: True)
    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    message = one_line_error(lambda: get_task("gsm8k").load("test"))
    assert "openai/gsm8k" in message and "--data-file" in message
    monkeypatch.undo()

    missing = str(tmp_path / "x.jsonl")
    assert "x.jsonl does not exist" in one_line_error(lambda: get_task("gsm8k").load(data_file=missing))
    assert ".parquet" in one_line_error(lambda: get_task("gsm8k").load(data_file=str(tmp_path / "x.csv")))
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    assert "line 1 is not valid JSON" in one_line_error(lambda: get_task("gsm8k").load(data_file=str(broken)))
    poems_only = tmp_path / "poems.jsonl"
    poems_only.write_text(json.dumps({"poem": "Roses", "author": "anon"}) + "\n")
    message = one_line_error(lambda: get_task("poetry").load(data_file=str(poems_only)))
    assert "instruction" in message and "--data-file" in message
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
    message = one_line_error(
        lambda: (
            get_task("countdown").load("train", data_file=str(path))
            + get_task("countdown").load("test", data_file=str(path))
        )
    )
    assert "line 1 has a 'nums' that is not list[int]: [\"x\"]" in message


@pytest.mark.parametrize(
    "row, message",
    [
        ({"nums": [8, 3, 3, 8], "target": 24.5}, "has a 'target' that is not int: 24.5"),
        ({"nums": [8, 3, 1.7, 8], "target": 24}, "has a 'nums' that is not list[int]: [8, 3, 1.7, 8]"),
        ({"nums": [8, 3, 3, 8], "target": True}, "has a 'target' that is not int: true"),
        ({"nums": [8, 3, False, 8], "target": 24}, "has a 'nums' that is not list[int]: [8, 3, false, 8]"),
        ({"nums": [8, 3, 3, 8], "target": "24"}, "has a 'target' that is not int: \"24\""),
        ({"nums": "8338", "target": 24}, "has a 'nums' that is not list[int]: \"8338\""),
    ],
)  # NaN is not JSON: refused as its line is read (test_json_values_are_read_as_the_file_holds_them)
def test_countdown_values_that_are_not_integers_are_one_line_naming_the_row_and_column(tmp_path, row, message):
    """A target of 24.5 would be cut to 24 in the prompt and the gold answer, 1.7 to 1, true to 1."""
    path = write_jsonl(tmp_path / "countdown.jsonl", [row])
    text = one_line_error(lambda: load_both(get_task("countdown"), data_file=path))
    assert (
        text == f"--data-file {path}: line 1 {message}; 1 of 1 rows are bad (countdown needs nums, target in every row)"
    )
    # among integer rows, whose column datasets then reads as floats (6.0): only the bad row is refused
    if isinstance(row["target"], float) or any(isinstance(n, float) for n in row["nums"]):
        path = write_jsonl(tmp_path / "mixed.jsonl", [{"nums": [1, 2, 3], "target": 6}] * 2 + [row])
        text = one_line_error(lambda: load_both(get_task("countdown"), data_file=path))
        assert text.startswith(f"--data-file {path}: line 3 {message}; 1 of 3 rows are bad")


def test_countdown_whole_floats_are_read_as_integers(tmp_path):
    """JSON writers that write 3 as 3.0 give the same puzzle: prompt, gold and numbers as ints."""
    path = write_jsonl(tmp_path / "countdown.jsonl", [{"nums": [8.0, 3, 3, 8], "target": 24.0}])
    [example] = load_both(get_task("countdown"), data_file=path)
    assert example.meta == {"numbers": [8, 3, 3, 8], "target": 24} and example.gold == "24"
    assert (
        "Using the numbers [8, 3, 3, 8], write an arithmetic expression that equals 24."
        in example.prompt[-1]["content"]
    )


def test_task_is_built_with_keywords_and_one_entry_adds_one():
    from tasks import TASKS, Example, Task, get_task

    with pytest.raises(TypeError):
        Task("x", "hub/id")  # positional arguments are refused: every field is named where it is set
    task = Task(
        name="parity",
        generate=lambda split, limit, seed: [
            Example(
                prompt=[{"role": "user", "content": f"Is {n} even? yes/no"}],
                gold="yes" if n % 2 == 0 else "no",
                reference="",
                uid=f"parity-{n}",
            )
            for n in range(limit)
        ],
        verifier=lambda completion, ex: float(completion.strip().lower() == ex.gold),
    )
    assert task.has_verifier and not Task(name="free", hub_id="a/b").has_verifier
    TASKS["parity"] = task
    try:
        examples = get_task("parity").load("train", limit=3)
        assert [get_task("parity").reward(text, ex) for text, ex in zip(["yes", "No", "no"], examples)] == [1, 1, 0]
        assert get_task("parity").extract("<think>hm</think> yes") == "yes"  # the default answer extractor
    finally:
        del TASKS["parity"]


# ---------------------------------------------------------------- OpenThoughts3 (the paper's transfer run)
def turn(speaker, text):
    return {"from": speaker, "value": text}


def openthoughts_row(question, answer, thinking="Let me think."):
    return {
        "difficulty": 3,
        "source": "invented",
        "domain": "science",
        "conversations": [turn("human", question), turn("gpt", f"<think>\n{thinking}\n</think>\n\n{answer}")],
    }


def openthoughts_rows():
    rows = [
        openthoughts_row(f"Name the chemical symbol of element {n}.", f"Element {n} has symbol E{n}.")
        for n in range(1, 25)
    ]
    rows.append(openthoughts_row("Name the chemical symbol of element 1.", "It is H.", thinking="Hydrogen."))
    return rows  # the last asks the first question again, with another answer


def write_jsonl(path, rows):
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return str(path)


def test_openthoughts_examples_from_a_local_file_and_the_hub(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "openthoughts.jsonl", openthoughts_rows())
    task = get_task("openthoughts")
    examples = task.load("train", data_file=path) + task.load("test", data_file=path)
    assert len(examples) == 25 and not task.has_verifier
    first = [e for e in examples if e.prompt[-1]["content"] == "Name the chemical symbol of element 1."]
    assert sorted(e.reference for e in first) == ["Element 1 has symbol E1.", "It is H."]  # thinking removed
    assert first[0].uid.split("#")[0] == first[1].uid.split("#")[0]  # one question: one split, "#1" apart
    assert len({e.uid for e in examples}) == 25
    example = first[0]
    assert example.gold is None and "<think>" in example.prompt[0]["content"]  # the think-then-answer system message
    assert task.reward(f"<think>x</think>{example.reference}", example, kind="sim") == 1.0
    assert task.reward("<think>x</think>Fluorine.", example, kind="format") == 1.0  # a REWARD_TERMS term
    with pytest.raises(ValueError, match="openthoughts has no verifier"):
        reward_weights(task, "exact", "")

    # the hub's rows (parquet: conversations as a list of {from, value} structs) give the same examples
    parquet = tmp_path / "openthoughts.parquet"
    datasets.Dataset.from_list(openthoughts_rows()).to_parquet(str(parquet))
    real, calls = datasets.load_dataset, []

    def load_dataset(path, name=None, split=None, **kwargs):
        if path != "open-thoughts/OpenThoughts3-1.2M":
            return real(path, name, split=split, **kwargs)
        calls.append((path, name, split))
        return real("parquet", data_files=str(parquet), split="train")

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(data, "hub_reachable", lambda timeout=3.0: True)
    hub = task.load("train") + task.load("test")
    assert calls == [("open-thoughts/OpenThoughts3-1.2M", None, "train")] * 2
    assert sorted((e.uid, e.reference) for e in hub) == sorted((e.uid, e.reference) for e in examples)


@pytest.mark.parametrize(
    "bad, message",
    [
        (
            {"conversations": [turn("gpt", "<think>a</think> b")]},
            "line 2 is not a valid openthoughts example (ValueError: its conversations has no human turn)",
        ),
        ({"conversations": [turn("human", "Why?"), turn("human", "Well?")]}, "has no gpt turn after the human one"),
        ({"conversations": []}, "line 2 lacks a value for 'conversations'"),
        ({"difficulty": 1}, "line 2 lacks a value for 'conversations'"),
        (
            {"conversations": [turn("human", "Why?"), turn("gpt", "<think>cut off by the token limit")]},
            "line 2 is not a valid openthoughts example (ValueError: its gpt turn has no answer",
        ),
        ("[1, 2]", "line 2 is not a JSON object"),
    ],
)
def test_openthoughts_bad_rows_are_one_line_naming_their_line(tmp_path, bad, message):
    path = write_jsonl(tmp_path / "o.jsonl", [openthoughts_row("Why is the sky blue?", "Rayleigh scattering."), bad])
    task = get_task("openthoughts")
    assert message in one_line_error(lambda: task.load("train", data_file=path) + task.load("test", data_file=path))


def test_openthoughts_conversations_that_are_not_turns_are_refused(tmp_path):
    path = write_jsonl(tmp_path / "o.jsonl", [{"conversations": "Why is the sky blue?"}] * 2)
    assert (
        """line 1 has a 'conversations' that is not list[dict]: "Why is the sky blue?"; 2 of 2 rows"""
        in one_line_error(lambda: get_task("openthoughts").load("train", data_file=path))
    )


# ---------------------------------------------------------------- Countdown-Sim: demonstrations joined from GOLD
PUZZLES = [([8, 3, 3, 8], 24), ([1, 2, 3], 6), ([4, 7, 9], 19), ([2, 5, 10, 1], 11), ([6, 6, 6], 42)]


def gold_row(nums, target, answer, thinking="Try products first."):
    return {
        "nums": nums,
        "target": target,
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": f"Using the numbers {nums}, create an equation that equals {target}."},
            {"role": "assistant", "content": f"<think>{thinking}</think>\n<answer>{answer}</answer>"},
        ],
    }


@pytest.fixture
def countdown_files(tmp_path):
    """A puzzles --data-file, and a GOLD-shaped --demo-file solving three of its five puzzles, two of them with
    their numbers in another order, one twice."""
    puzzles = write_jsonl(tmp_path / "puzzles.jsonl", [{"nums": n, "target": t} for n, t in PUZZLES])
    demos = write_jsonl(
        tmp_path / "gold.jsonl",
        [
            gold_row([3, 8, 8, 3], 24, "8 / (3 - 8 / 3)"),
            gold_row([1, 2, 3], 6, "(1 + 2) * 3 - 3 + 3 - 1 * 1 + 1"),  # a longer second one for the same puzzle
            gold_row([3, 2, 1], 6, "1 + 2 + 3"),
            gold_row([9, 7, 4], 19, "9 + 7 + 4 - 1 + 0"),
            gold_row([9, 9, 9], 999, "not a puzzle of the data file"),
        ],
    )
    return puzzles, demos


def load_both(task, **kwargs):
    return task.load("train", **kwargs) + task.load("test", **kwargs)


def test_countdown_sim_joins_demonstrations_by_target_and_sorted_numbers(countdown_files, capsys):
    puzzles, demos = countdown_files
    task = get_task("countdown")
    joined = load_both(task, data_file=puzzles, demos=True, demo_file=demos)
    by_puzzle = {(tuple(e.meta["numbers"]), e.meta["target"]): e for e in joined}
    assert set(by_puzzle) == {((8, 3, 3, 8), 24), ((1, 2, 3), 6), ((4, 7, 9), 19)}  # the numbers as the puzzle has them
    assert by_puzzle[(8, 3, 3, 8), 24].reference == "8 / (3 - 8 / 3)"  # the answer only: no thinking, no tags
    assert by_puzzle[(1, 2, 3), 6].reference == "1 + 2 + 3"  # several for one puzzle: the shortest
    notes = re.findall(
        r"note: (\d+) of \d+ countdown (?:train|test) puzzles have no demonstration in --demo-file "
        r".*gold.jsonl: left out",
        capsys.readouterr().out,
    )
    assert sum(map(int, notes)) == 2  # one line per split that leaves puzzles out
    example = by_puzzle[(8, 3, 3, 8), 24]
    assert task.reward("<think>hm</think> 8 / (3 - 8 / 3)", example, kind="sim") == 1.0
    assert task.reward("<think>hm</think> 8 / (3 - 8 / 3)", example, kind="exact") == 1.0  # the verifier is kept
    assert [e.uid for e in joined] == [
        e.uid for e in load_both(task, data_file=puzzles) if e.uid in {j.uid for j in joined}
    ]  # same puzzles, same ids and order as without
    assert len(task.load("train", data_file=puzzles, demos=True, demo_file=demos, limit=1)) == 1


def test_countdown_sim_reads_gold_from_the_hub_with_its_configuration(countdown_files, monkeypatch):
    puzzles, demos = countdown_files
    real, calls = datasets.load_dataset, []

    def load_dataset(path, name=None, split=None, **kwargs):
        if path != "HuggingFaceTB/Countdown-Task-GOLD":
            return real(path, name, split=split, **kwargs)
        calls.append((path, name, split))
        return real("json", data_files=demos, split="train")

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(data, "hub_reachable", lambda timeout=3.0: True)
    task = get_task("countdown")
    assert len(load_both(task, data_file=puzzles, demos=True)) == 3
    assert calls[0] == ("HuggingFaceTB/Countdown-Task-GOLD", "verified_Qwen2.5-7B-Instruct", "train")
    assert len(task.load("train", data_file=puzzles)) + len(task.load("test", data_file=puzzles)) == 5  # exact: all
    assert len(calls) == 2  # ... and GOLD is not read without demos
    monkeypatch.setattr(data, "hub_reachable", lambda timeout=3.0: False)
    message = one_line_error(lambda: task.load("train", data_file=puzzles, demos=True))
    assert "HuggingFaceTB/Countdown-Task-GOLD" in message and "--demo-file FILE" in message


def test_countdown_sim_parquet_demo_file(countdown_files, tmp_path):
    puzzles, demos = countdown_files
    parquet = tmp_path / "gold.parquet"
    datasets.load_dataset("json", data_files=demos, split="train").to_parquet(str(parquet))
    task = get_task("countdown")
    from_parquet = load_both(task, data_file=puzzles, demos=True, demo_file=str(parquet))
    assert sorted(e.reference for e in from_parquet) == sorted(
        e.reference for e in load_both(task, data_file=puzzles, demos=True, demo_file=demos)
    )


def test_countdown_sim_without_any_match_or_with_bad_demonstrations_is_one_line(countdown_files, tmp_path):
    puzzles, _ = countdown_files
    task = get_task("countdown")

    def load(rows):
        demos = write_jsonl(tmp_path / "demos.jsonl", rows)
        return one_line_error(lambda: load_both(task, data_file=puzzles, demos=True, demo_file=demos))

    message = load([gold_row([9, 9, 9], 999, "9 * 111")])
    assert "none of the" in message and "has a demonstration in --demo-file" in message
    no_answer = gold_row([1, 2, 3], 6, "x")
    no_answer["messages"] = no_answer["messages"][:2]
    assert (
        "--demo-file " + str(tmp_path / "demos.jsonl") + ": line 2 is not a valid countdown demonstration "
        "(ValueError: its messages have no assistant turn)"
    ) in load([gold_row([1, 2, 3], 6, "1+2+3"), no_answer])
    cut = gold_row([1, 2, 3], 6, "x")
    cut["messages"][-1]["content"] = "<think>cut off by the token limit"
    assert "line 1 is not a valid countdown demonstration (ValueError: its assistant turn has no answer" in load([cut])
    assert "line 2 lacks a value for 'messages'" in load([gold_row([1, 2, 3], 6, "1+2+3"), {"nums": [1], "target": 1}])
    assert """line 1 has a 'nums' that is not list[int]: ["x", 2, 3]""" in load([gold_row(["x", 2, 3], 6, "1+2+3")])
    assert "line 1 has a 'target' that is not int: 6.5" in load([gold_row([1, 2, 3], 6.5, "1+2+3")])
    assert "line 1 is not valid JSON" in load(["{not json"])
    parquet = tmp_path / "no_messages.parquet"
    datasets.Dataset.from_list([{"nums": [1, 2, 3], "target": 6}]).to_parquet(str(parquet))
    message = one_line_error(lambda: task.load("train", data_file=puzzles, demos=True, demo_file=str(parquet)))
    assert "lacks column(s) messages needed by a countdown demonstration" in message


def test_demo_file_is_refused_where_it_would_not_be_read(countdown_files, tmp_path, capsys):
    """At the door (eval.py: main; train.py's is config.py: check_args), in one line, before any row is read."""
    import eval as evaluation

    puzzles, demos = countdown_files

    def refused(*flags) -> str:
        with pytest.raises(SystemExit) as exit_info:
            evaluation.main(["--model", "x", "--demo-file", demos, *flags])
        stderr = capsys.readouterr().err
        assert exit_info.value.code == 2 and len(stderr.strip().splitlines()) == 1
        return stderr

    assert "read only when the reward uses sim" in refused("--task", "countdown", "--data-file", puzzles)
    assert "takes no --demo-file" in refused("--task", "gsm8k", "--reward", "sim", "--data-file", puzzles)
    assert "takes no --demo-file" in refused("--task", "countdown24", "--reward", "sim")
    # a --data-file with its own `reference` column is not joined (and needs no GOLD)
    own = write_jsonl(tmp_path / "own.jsonl", [{"nums": [1, 2, 3], "target": 6, "reference": "3 * 2 * 1"}] * 3)
    examples = load_both(get_task("countdown"), data_file=own, demos=True, demo_file=str(tmp_path / "absent.jsonl"))
    assert [e.reference for e in examples] == ["3 * 2 * 1"] * 3


# ---------------------------------------------------------------- --reward-weights
def test_reward_weights_parse_and_default():
    from tasks import reward_weights

    gsm8k, poetry = get_task("gsm8k"), get_task("poetry")
    assert reward_weights(gsm8k, "exact", "") == {"exact": 1.0}
    assert reward_weights(poetry, "sim", "  ") == {"sim": 1.0}
    assert reward_weights(poetry, "sim", " format = 0.35 , sim=0.65,") == {"format": 0.35, "sim": 0.65}
    assert reward_weights(gsm8k, "sim", "exact=1,format=-0.5") == {"exact": 1.0, "format": -0.5}  # a penalty
    assert reward_weights(gsm8k, "exact", "exact=1,sim=0") == {"exact": 1.0, "sim": 0.0}  # sim logged, not trained


@pytest.mark.parametrize(
    "task, text, message",
    [
        ("gsm8k", "exact", "--reward-weights: 'exact' is not TERM=WEIGHT"),
        ("gsm8k", "=1", "--reward-weights: '=1' is not TERM=WEIGHT"),
        ("gsm8k", "exact=one", "--reward-weights: the weight of exact must be a finite number, not 'one'"),
        ("gsm8k", "exact=nan", "must be a finite number, not 'nan'"),
        ("gsm8k", "exact=1e999", "must be a finite number, not '1e999'"),
        ("gsm8k", "exact=", "must be a finite number, not ''"),
        ("gsm8k", "sim=1,sim=2", "--reward-weights: sim is given twice"),
        ("gsm8k", "judge=1", "--reward-weights: unknown term 'judge': choose from exact, sim, format"),
        ("poetry", "exact=1,sim=1", "--reward-weights: task poetry has no verifier, so no exact term"),
        ("gsm8k", ",", "--reward-weights ',': no term has a nonzero weight"),
        ("gsm8k", "exact=0,sim=0", "--reward-weights 'exact=0,sim=0': no term has a nonzero weight"),
    ],
)
def test_reward_weights_errors_are_one_line(task, text, message):
    from tasks import reward_weights

    with pytest.raises(ValueError) as info:
        reward_weights(get_task(task), "exact", text)
    text = str(info.value)
    assert text.startswith("--reward-weights") and message in text and "\n" not in text, text


def test_reward_weights_default_refuses_exact_without_a_verifier():
    from tasks import reward_weights

    with pytest.raises(
        ValueError, match="--reward exact: task poetry has no verifier, so no exact term: use --reward sim"
    ):
        reward_weights(get_task("poetry"), "exact", "")


def test_task_reward_scores_any_term_by_name(monkeypatch):
    import rewards

    task = get_task("arith")
    example = task.load("test", limit=1)[0]
    a, b = example.meta["a"], example.meta["b"]
    right = f"<think>add</think>{a} + {b} = {a + b}"
    assert task.reward(right, example, kind="exact") == 1.0
    assert task.reward(right, example, kind="sim") == 1.0  # arith's reference is "a + b = c"
    assert task.reward(right, example, kind="format") == 1.0 and task.reward("no think", example, kind="format") == 0.0
    monkeypatch.setitem(rewards.REWARD_TERMS, "gold_length", lambda completion, ex: len(ex.gold) / 10)
    assert task.reward("x", example, kind="gold_length") == len(str(a + b)) / 10  # a fork's term, by name
    monkeypatch.setitem(rewards.REWARD_TERMS, "big", lambda completion, ex: 7)
    assert task.reward("x", example, kind="big") == 1.0  # every term is clipped to [0, 1] (rewards.safe_reward)


# ---- polaris: the official code's Qwen3 run (softmaxgrpo/prepare_data.py)
def polaris_args(tmp_path, **overrides):
    from config import Args

    aime25 = tmp_path / "aime25.jsonl"  # the AIME fixture's problems, as an AIME 2025 file
    aime25.write_text((FIXTURES / "aime24.jsonl").read_text())
    return Args(
        **{
            "task": "polaris",
            "data_file": str(FIXTURES / "polaris.jsonl"),
            "eval_examples": 8,
            "eval_tasks": f"aime25={aime25},math500={FIXTURES / 'math500.jsonl'}",
            **overrides,
        }
    )


def test_polaris_rows_are_the_official_user_only_boxed_prompts_scored_by_the_math_verifier():
    task, path = get_task("polaris"), str(FIXTURES / "polaris.jsonl")
    data._sha256.cache_clear()
    examples = task.load("train", data_file=path) + task.load("test", data_file=path)
    assert data._sha256.cache_info().misses == 1  # one file, two splits: hashed once
    by_problem = {row["problem"].strip(): row for row in rows("polaris.jsonl")}
    assert len(examples) == len(by_problem) == 10
    for example in examples:
        [turn] = example.prompt  # no system message
        problem, _, instruction = turn["content"].rpartition("\n")
        assert turn["role"] == "user" and instruction == BOXED and example.gold == by_problem[problem]["answer"]
        assert (
            example.uid.startswith("polaris-")
            and example.revision == hashlib.sha256((FIXTURES / "polaris.jsonl").read_bytes()).hexdigest()
        )  # the file's sha256, for RUN/data.json
        assert task.reward(f"<think>x</think> \\boxed{{{example.gold}}}", example) == 1.0
        assert task.reward("\\boxed{-1}", example) == 0.0


def test_polaris_training_drops_the_prompts_aime25_and_math500_hold_and_says_so_once(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(data, "hub_reachable", lambda timeout=3.0: False)
    args = polaris_args(tmp_path)
    train_set, test_set, eval_sets = tasks.load_data(args, get_task("polaris"), {"exact": 1.0})
    out = capsys.readouterr().out
    assert out == "note: dropped 2 training prompt(s) in aime25/math500\n"
    users = {ex.prompt[-1]["content"].split("\n")[0] for ex in train_set}
    assert "Compute $7 \\times 6$." not in users  # MATH-500's, word for word
    assert "Find the remainder when $2^{10}$ is divided by $1000$." not in users  # AIME's, spacing aside
    assert len(train_set) == 7 and len(test_set) == 1  # 10 rows: 1 held out by hash, 2 dropped
    assert list(eval_sets) == ["polaris", "aime25", "math500"] and eval_sets["polaris"][1] == test_set
    whole = get_task("math500").load("test", data_file=str(FIXTURES / "math500.jsonl"), seed=args.seed)
    assert [ex.uid for ex in eval_sets["math500"][1]] == [ex.uid for ex in whole[: args.eval_examples]]
    limited = get_task("math500").load("test", data_file=str(FIXTURES / "math500.jsonl"), limit=2, seed=args.seed)
    assert [ex.uid for ex in limited] == [ex.uid for ex in whole[:2]]  # read whole once, cut: the rows scored
    tasks.load_data(args, get_task("polaris"), {"exact": 1.0}, master=False)
    assert capsys.readouterr().out == ""  # rank 0 says it
    with pytest.raises(DataError, match="cannot reach the Hugging Face Hub to load MathArena/aime_2025"):
        tasks.load_data(
            polaris_args(tmp_path, eval_tasks=f"math500={FIXTURES / 'math500.jsonl'}"),
            get_task("polaris"),
            {"exact": 1.0},
        )  # an evaluation set it cannot read is not skipped
    capsys.readouterr()
    gsm8k = str(FIXTURES / "gsm8k.jsonl")
    plain = tasks.load_data(polaris_args(tmp_path, task="gsm8k", data_file=gsm8k), get_task("gsm8k"), {"exact": 1.0})
    assert capsys.readouterr().out == "" and [ex.uid for ex in plain[0]] == [  # other tasks: no decontamination
        ex.uid for ex in get_task("gsm8k").load("train", data_file=gsm8k)
    ]


def test_polaris_from_the_hub_reads_its_train_split_and_records_the_commit(tmp_path, monkeypatch):
    """datasets caches a hub dataset under a folder named by the commit it resolved (online, or offline from the
    cache); that folder's name is the revision."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    folder = tmp_path / "POLARIS-Project___polaris-dataset-53k" / "default" / "0.0.0" / commit
    datasets.Dataset.from_list(rows("polaris.jsonl")).save_to_disk(str(folder))
    calls = []

    def load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split))
        return datasets.load_from_disk(str(folder))

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(data, "hub_reachable", lambda timeout=3.0: True)
    task = get_task("polaris")
    hub = task.load("train") + task.load("test")
    assert calls == [("POLARIS-Project/Polaris-Dataset-53K", None, "train")] * 2  # no test split: 10% held out
    assert {ex.revision for ex in hub} == {commit}
    path = str(FIXTURES / "polaris.jsonl")
    local = task.load("train", data_file=path) + task.load("test", data_file=path)
    assert sorted((ex.uid, ex.prompt[-1]["content"]) for ex in hub) == sorted(
        (ex.uid, ex.prompt[-1]["content"]) for ex in local
    )


def test_a_held_out_set_that_holds_training_prompts_is_refused(tmp_path, monkeypatch):
    """Issue 61, class 5: --eval-tasks aime24=TRAINFILE scored training prompts as held-out, with no note."""
    monkeypatch.setattr(data, "hub_reachable", lambda timeout=3.0: False)
    args = polaris_args(tmp_path)
    args.eval_tasks += f",aime24={FIXTURES / 'polaris.jsonl'}"  # the training file itself, as AIME 2024
    with pytest.raises(DataError, match=r"--eval-tasks: \d+ of the 8 aime24 prompts are training prompts too"):
        tasks.load_data(args, get_task("polaris"), {"exact": 1.0}, master=False)
    train_set, _, eval_sets = tasks.load_data(polaris_args(tmp_path), get_task("polaris"), {"exact": 1.0}, False)
    assert len(train_set) == 7 and set(eval_sets) == {"polaris", "aime25", "math500"}  # disjoint sets still load


def test_a_training_file_that_decontamination_empties_is_one_line(tmp_path, monkeypatch):
    """Issue 61, class 5: a polaris file whose every row an eval set holds was a 22-line traceback after the note."""
    monkeypatch.setattr(data, "hub_reachable", lambda timeout=3.0: False)
    args = polaris_args(tmp_path)
    (tmp_path / "aime25.jsonl").write_text((FIXTURES / "polaris.jsonl").read_text())  # aime25 holds every row
    with pytest.raises(DataError, match="every training prompt is in aime25/math500, which training must not see"):
        tasks.load_data(args, get_task("polaris"), {"exact": 1.0}, master=False)


def test_a_one_row_jsonl_of_list_columns_is_a_row_not_pandas_columns(tmp_path):
    """Issue 61, class 9: a valid one-row openthoughts JSONL was refused as "pandas to_json() layout"."""
    row = {"conversations": openthoughts_row("Name the symbol of element 2.", "It is He.")["conversations"]}
    path = write_jsonl(tmp_path / "one.jsonl", [row])
    task = get_task("openthoughts")
    [example] = task.load("train", data_file=path) + task.load("test", data_file=path)
    assert example.prompt[-1]["content"] == "Name the symbol of element 2." and example.reference == "It is He."
    (tmp_path / "one.json").write_text(json.dumps({"conversations": {"0": row["conversations"]}}))
    with pytest.raises(DataError, match="one JSON object of columns"):  # a .json file of columns is still refused
        task.load("train", data_file=str(tmp_path / "one.json"))
