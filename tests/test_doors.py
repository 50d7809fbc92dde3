"""One door per class of bad input, tried with the other members of its class: the row gate (a column's declared
type, the file's layout, a line's length, conflicting golds), the one math normaliser for golds and predictions, and
the run's own logs read back at --resume. The loader goes through Task.load on a file; --resume through train.py's
parser, before anything loads.

    python -m pytest tests/test_doors.py -q
"""

import json
import tracemalloc

import pandas as pd
import pytest

import tasks
from plumbing import data
from plumbing.data import DataError
from tasks import TASKS, get_task
from tests.test_bad_input import write_jsonl

VALID = {  # a valid row of each task read from a file; a new such task needs one here
    "gsm8k": {"question": "What is 1 plus 1?", "answer": "#### 2"},
    "countdown": {"nums": [1, 2, 3], "target": 6},
    "deepmath": {
        "question": "What is 1 plus 1?",
        "final_answer": "2",
        "r1_solution_1": "<think>1+1</think> 2",
        "r1_solution_2": None,
        "r1_solution_3": "",
    },
    "poetry": {"instruction": "Write a poem about rain.", "poem": "Rain falls."},
    "meetingbank": {"prompt": "The council met.", "compressed_prompt": "Council met."},
    "openthoughts": {"conversations": [{"from": "human", "value": "Why?"}, {"from": "gpt", "value": "Because."}]},
    **{name: {"problem": "What is 1 plus 1?", "answer": "2"} for name in ("math500", "aime24", "aime25", "polaris")},
}
FILE_TASKS = [name for name in VALID if name in TASKS]  # a fork's new task is not required here


def rows_of(name: str, n: int = 6) -> list[dict]:
    """n valid rows of task `name`, each its own prompt."""
    rows = [json.loads(json.dumps(VALID[name])) for _ in range(n)]
    for i, row in enumerate(rows):
        key = TASKS[name].key[-1]
        if key == "conversations":
            row[key][0]["value"] += f" {i}"
        else:
            row[key] = row[key] + i if isinstance(row[key], int) else f"{row[key]} ({i})"
    return rows


def load_all(name: str, path) -> list:
    task = get_task(name)
    return [
        ex
        for split in (("test",) if task.held_out_only else ("train", "test"))
        for ex in task.load(split, data_file=str(path))
    ]


def test_the_tasks_read_from_a_file_load_their_valid_rows(tmp_path):
    assert set(VALID) <= {name for name, task in TASKS.items() if task.generate is None}
    for name in FILE_TASKS:
        assert load_all(name, write_jsonl(tmp_path / f"{name}.jsonl", rows_of(name)))


# ---- the row gate: each column's declared type, one line naming the file line and the column
WRONG = [["What is 1 plus 1?", {"hint": "add"}], {"text": "What?"}, True, 7, 2.5, None]


@pytest.mark.parametrize("name", FILE_TASKS)
def test_a_value_not_of_its_columns_declared_type_is_refused_naming_the_line_and_column(name, tmp_path):
    """A question that was a list, a dict or true trained on its Python repr; each task's every column is tried
    with each wrong kind of value its type does not admit."""
    task, tried = get_task(name), 0
    for column, kind in task.columns.items():
        for value in WRONG:
            if data.is_a(value, kind) or value is None:
                continue
            rows = rows_of(name)
            rows[2][column] = value
            with pytest.raises(DataError) as info:
                load_all(name, write_jsonl(tmp_path / "rows.jsonl", rows))
            assert f"line 3 has a {column!r} that is not " in str(info.value), str(info.value)
            assert "\n" not in str(info.value)
            tried += 1
    assert tried >= len(task.columns)


def test_a_reference_column_that_is_not_text_is_refused_for_every_task(tmp_path):
    """A Countdown-Sim reference that was a list became its repr; "reference" replaces any task's demonstration."""
    for name in FILE_TASKS:
        rows = [{**row, "reference": "a demonstration"} for row in rows_of(name)]
        rows[1]["reference"] = ["1 + 2 + 3", "6"]
        with pytest.raises(DataError, match=r"line 2 has a 'reference' that is not str \| None: \["):
            load_all(name, write_jsonl(tmp_path / f"{name}.jsonl", rows))


@pytest.mark.parametrize("orient", ["columns", "index", "split", "table", "values"])
@pytest.mark.parametrize("name", ["gsm8k", "poetry", "deepmath", "meetingbank", "countdown"])
def test_a_json_file_in_a_layout_other_than_records_or_lines_is_refused_as_such(name, orient, tmp_path):
    """pandas' default to_json() layout (columns) was refused for gsm8k but trained on one row holding a dict's repr
    for poetry, deepmath and meetingbank."""
    path = tmp_path / "rows.json"
    pd.DataFrame(rows_of(name)).to_json(path, orient=orient)
    with pytest.raises(DataError) as info:
        load_all(name, path)
    message = str(info.value)
    assert (
        "one JSON object of columns" in message
        if orient != "values"
        else "a .json file holds a list of row objects, or one object per line" in message
    ), message
    pd.DataFrame(rows_of(name)).to_json(path, orient="records")  # the layouts read: records, and lines
    assert load_all(name, path)
    pd.DataFrame(rows_of(name)).to_json(tmp_path / "rows.jsonl", orient="records", lines=True)
    assert load_all(name, tmp_path / "rows.jsonl")


def test_a_line_is_read_in_bounded_chunks_and_refused_at_the_limit(tmp_path):
    """A 3 GB one-line file was read whole before the 1M-character row check; a 64 MB line now costs the reader
    no more than the limit."""
    path = tmp_path / "huge.jsonl"
    with open(path, "w") as f:
        f.write(json.dumps(VALID["gsm8k"]) + "\n")
        f.write('{"question": "' + "1 + " * 16_000_000 + '1", "answer": "#### 2"}\n')  # 64 MB
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match="line 2 is over 16 MB, more than a row may hold"):
            get_task("gsm8k").load("train", data_file=str(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * data.MAX_LINE_BYTES, peak  # readline(limit) joins its buffer: up to 2x; whole: 64 MB+


def test_a_json_array_past_its_bound_is_refused_before_it_is_read(tmp_path, monkeypatch):
    """Issue 61, class 3: a 3 GB .json array was read whole (the .jsonl path reads a row at a time)."""
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([VALID["gsm8k"]] * 50))
    assert len(get_task("gsm8k").load("train", data_file=str(path))) >= 1  # under the bound: read
    path.write_text(json.dumps([VALID["gsm8k"]] * 40_000))  # about 2 MB
    monkeypatch.setattr(data, "MAX_ARRAY_BYTES", 2**20)
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match=r"a \.json array is read whole, and this one is .* write it as JSON Lines"):
            get_task("gsm8k").load("train", data_file=str(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < path.stat().st_size / 10, peak  # refused before its text is read


def test_conflicting_golds_for_one_prompt_are_reported_once_with_a_count(tmp_path, capsys):
    """One prompt with two different golds (22 copies) trained on both with no note."""
    rows = rows_of("gsm8k", 20) + [{"question": "What is 2 plus 2?", "answer": f"#### {4 + i % 2}"} for i in range(22)]
    rows += [{"question": "What is 3 plus 3?", "answer": f"#### {6 + i % 3}"} for i in range(3)]
    loaded = load_all("gsm8k", write_jsonl(tmp_path / "g.jsonl", rows))
    notes = [line for line in capsys.readouterr().out.splitlines() if "different golds" in line]
    conflicted = {tasks.digest(q) for q in ("What is 2 plus 2?", "What is 3 plus 3?")}
    splits = {"test" if tasks.in_test(d) else "train" for d in conflicted}
    assert len(notes) == len(splits), notes  # once per split that holds them
    assert sum(int(note.split()[1]) for note in notes) == 2, notes  # two prompts, each counted once
    assert len(loaded) == len(rows)  # reported, not dropped: each copy trains as written


# ---- one normaliser for every math gold and boxed prediction
MATH_TASKS = [name for name, task in TASKS.items() if task.verifier is tasks._math_verifier]


@pytest.mark.parametrize(
    "gold, right, wrong",
    [
        ("72 dollars", ["\\boxed{72}", "\\boxed{72 dollars}", "\\boxed{72 \\text{dollars}}"], ["\\boxed{73}"]),
        ("1,500 meters", ["\\boxed{1500}", "\\boxed{1,500}", "\\boxed{1500 meters}"], ["\\boxed{15}", "\\boxed{1.5}"]),
        ("\u221215", ["\\boxed{-15}", "\\boxed{\u221215}"], ["\\boxed{15}"]),
        ("5\\text{ cm}", ["\\boxed{5}", "\\boxed{5 cm}"], ["\\boxed{6}"]),
    ],
)
def test_every_math_task_reads_a_gold_and_a_prediction_through_one_normaliser(gold, right, wrong, tmp_path):
    """A DeepMath, MATH500 or AIME gold "72 dollars" loaded and then never scored, while gsm8k refused it."""
    assert {"gsm8k", "deepmath", "math500", "aime24", "aime25"} <= set(MATH_TASKS)
    for name in MATH_TASKS:
        rows = rows_of(name, 30)
        column = "answer" if name != "deepmath" else "final_answer"
        for row in rows:
            row[column] = f"#### {gold}" if name == "gsm8k" else gold
        task, [example, *_] = get_task(name), load_all(name, write_jsonl(tmp_path / f"{name}.jsonl", rows))
        for completion in right:
            assert task.reward(completion, example) == 1.0, (name, completion)
        for completion in wrong:
            assert task.reward(completion, example) == 0.0, (name, completion)


# ---- the run's own logs, read back with one reader at --resume, before any model loads
@pytest.mark.parametrize("log", ["metrics.jsonl", "completions.jsonl"])
@pytest.mark.parametrize(
    "line, why",
    [
        (b'{"step": null}', "a null step"),
        (b'{"step": "2"}', "a text step"),
        (b'{"step": true}', "a bool step"),
        (b'{"step": 2.0}', "a float step"),
        (b"\xff\xfe not UTF-8", "bytes that are not UTF-8"),
        (b"not json", "a line that is not JSON"),
        (b"[1, 2]", "a list"),
        (b'{"reward/mean": 0.5}', "no step"),
        (b"", "a blank line (the log's writer never writes one)"),
    ],
)
def test_a_damaged_line_of_the_runs_own_log_is_one_line_at_resume_before_any_model_loads(
    log, line, why, tiny_model_dir, tmp_path, capsys, monkeypatch
):
    """An 18-line traceback after the models loaded, and a non-JSON middle line was dropped without a note."""
    import train
    from tests.test_bad_input import run_with_checkpoints, snapshot

    run_dir = run_with_checkpoints(tmp_path / "run", tiny_model_dir, steps=(2,))
    (run_dir / log).write_bytes(b'{"step": 1}\n' + line + b'\n{"step": 2}\n')
    monkeypatch.setattr("plumbing.models.load_model", lambda *a, **k: pytest.fail("a model loaded"))
    before = snapshot(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        train.parse_args(["--model", tiny_model_dir, "--resume", str(run_dir), "--steps", "3"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, (why, err)
    assert f"line 2 of {run_dir / log} is damaged" in err, (why, err)
    assert snapshot(tmp_path) == before  # nothing dropped or rewritten


def test_a_cut_short_last_line_is_left_out_with_a_note(tmp_path, capsys):
    from plumbing.run_log import keep_steps, read_log

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "x": NaN}\n{"step": 2}\n{"step": 3}\n{"step": 4, "rew')
    assert [row["step"] for row in read_log(str(path))] == [1, 2, 3]
    assert f"line 4 of {path} was cut short" in capsys.readouterr().out
    keep_steps(str(path), 2)
    assert path.read_text() == '{"step": 1, "x": NaN}\n{"step": 2}\n'
