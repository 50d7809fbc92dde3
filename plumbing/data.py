"""A task's rows, read and checked: what tasks.Task.load does for a hub-backed task, below the task registry.

    rows, checked  <- a --data-file (.jsonl, .json, .parquet; "{split}" in its name: one file per split) or the
                      Hub (hub_id, hub_config, its test split or else train); every bad input one line (DataError)
    split          <- the hub's own test split, a "{split}" file whole, or a held-out TEST_PERCENT by a hash of
                      the task's `key` columns (docs/tasks.md, departure 4)
    uid            <- task name + that hash, "#1", "#2", ... for a prompt seen again
    demonstrations <- joined by puzzle from the task's `demos` dataset, or --demo-file (departure 3)
    examples       <- shuffled by the seed, cut to the limit, then task.make_example on each row

`task` is a tasks.Task, read by its fields (this module imports no stage file).

    python -m pytest tests/test_tasks.py tests/test_bad_input.py -q
"""

import hashlib
import json
import numbers
import os
import random
import socket
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from plumbing.cli import first_line

TEST_PERCENT = 10  # held-out share when a dataset has no test split
# A row (a JSON line, or one field of a hub or parquet row) longer than this is refused at load: about 250k
# tokens at ~4 characters per token, beyond the context of any model this trains (Qwen2.5: 32k, 131k with
# YaRN). A 50 MB line would otherwise be tokenised whole and sized into the sampler.
MAX_ROW_CHARS = 1_000_000


class DataError(ValueError):
    """A one-line, user-facing data problem: dataset unreachable, file missing, columns missing."""


def digest(*parts) -> str:
    return hashlib.sha1("\x1f".join(str(part) for part in parts).encode()).hexdigest()


def in_test(digest: str) -> bool:
    return int(digest[:8], 16) % 100 < TEST_PERCENT


@dataclass(kw_only=True)
class Demonstrations:
    """A task's demonstrations for the similarity reward, kept in another dataset and joined to its rows by puzzle
    (countdown: Countdown-Task-GOLD's; docs/tasks.md, departure 3); tasks.Task.demos."""

    hub_id: str
    hub_config: str | None = None
    columns: tuple[str, ...]  # every row of it needs a value in each (the hub's, and --demo-file's)
    read: Callable[[dict], tuple[tuple, str]]  # one of its rows -> (puzzle, reference)
    puzzle: Callable[[dict], tuple]  # a task row's `key` columns -> the same puzzle


def load_rows(task, split: str, data_file: str | None, *, limit: int | None, seed: int, demos: bool,
              demo_file: str | None) -> list:
    """The examples of a hub-backed `task` (tasks.Task.load, after check_load)."""
    rows, whole, lines = _rows(task, split, data_file)
    source = data_file.replace("{split}", split) if data_file else task.hub_id
    join = demos and task.demos is not None and "reference" not in rows.column_names  # a file's own win
    try:
        check_rows(rows, lines, task.columns, task.required, source, task.name, task.hint)
        found = _demonstrations(task, demo_file) if join else None
        return _examples(task, rows, whole, lines, split, limit, seed, source, found, needs_reference=demos)
    except UnicodeDecodeError as err:  # parquet or .json strings that are not UTF-8, met as they are read
        raise DataError(f"{source}: not UTF-8 text ({first_line(err, typed=True)})") from None


def check_load(task, split: str, data_file: str | None, demos: bool, demo_file: str | None) -> None:
    """DataError, one line, for a split other than train and test, a --demo-file that would not be read, or a
    --data-file for a procedural task."""
    if split not in ("train", "test"):
        raise DataError(f"{task.name}: split must be 'train' or 'test', not {split!r}")
    if demo_file and task.demos is None:
        raise DataError(f"--demo-file {demo_file}: {task.name} takes no --demo-file (its demonstrations are its "
                        "own; a 'reference' column in --data-file replaces them)")
    if demo_file and not demos:
        raise DataError(f"--demo-file {demo_file} is read only when the reward uses sim (--reward sim, or a sim "
                        "term in --reward-weights)")
    if task.generate is not None and data_file:
        raise DataError(f"{task.name} is generated procedurally and takes no --data-file")
    if split == "train" and getattr(task, "held_out_only", False):
        raise DataError(f"{task.name} is a held-out benchmark: score it with --eval-tasks {task.name} (train.py) "
                        "or eval.py, not train on it")


def integer(value, column: str, verb: str = "is") -> int:
    """`value` of a row's `column` as an int; ValueError naming the column for a boolean, a number with a
    fraction, or anything that is not a number, text included (a whole float, 3.0 as JSON may write 3, is 3)."""
    whole = isinstance(value, numbers.Real) and not isinstance(value, bool) and (
        isinstance(value, numbers.Integral) or float(value).is_integer())
    if not whole:
        raise ValueError(f"its {column} {verb} {json.dumps(value, default=repr)}, not an integer")
    return int(value)


def integers(values, column: str) -> list[int]:
    """A row's list-of-integers `column` (countdown's nums) as ints; ValueError naming the column otherwise."""
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"its {column} is {json.dumps(values, default=repr)}, not a list of integers")
    return [integer(value, column, "holds") for value in values]


# ---------------------------------------------------------------- the rows: a file or the hub, one split
def _rows(task, split: str, data_file: str | None):
    """(datasets.Dataset, whether it already is exactly `split`, each row's line number in a JSON Lines file
    or None) from a file or the hub."""
    if data_file:
        path = data_file.replace("{split}", split)
        rows, lines = read_file(path, "--data-file", task.required, task.name, task.hint)
        return rows, path != data_file or getattr(task, "held_out_only", False), lines  # a benchmark's file: whole
    advice = f"pass --data-file FILE (.jsonl or .parquet with columns {', '.join(task.columns)})"
    if task.hub_id is None:
        raise DataError(f"{task.name} has no hub dataset: {advice}")
    hub_split = task.hub_test_split if split == "test" and task.hub_test_split else "train"
    return read_hub(task.hub_id, task.hub_config, hub_split, advice), task.hub_test_split is not None, None


def _examples(task, rows, whole, lines, split, limit, seed, source, found=None, needs_reference=False) -> list:
    """`found`: ({puzzle: reference}, where from) to join, or None. `needs_reference`: the reward uses sim, so a row
    without a demonstration is refused here, at load, not at the step that samples it."""
    digests, puzzles = [], []
    for i, values in enumerate(zip(*(rows[column] for column in task.key))):
        named = dict(zip(task.key, values))
        try:
            digests.append(digest(*values) if task.key_text is None else digest(task.key_text(named)))
            puzzles += [task.demos.puzzle(named)] if found else []
        except Exception as err:
            raise DataError(f"{source}: {where(lines, i)} is not a valid {task.name} example "
                            f"({first_line(err, typed=True)})") from None
    seen, uids = {}, []
    for row_digest in digests:  # a repeated prompt keeps its split and gets "#1", "#2", ...
        seen[row_digest] = seen.get(row_digest, -1) + 1
        uids.append(f"{task.name}-{row_digest[:12]}" + (f"#{seen[row_digest]}" if seen[row_digest] else ""))
    keep = [i for i, d in enumerate(digests) if whole or in_test(d) == (split == "test")]
    if found:  # before the limit: --limit N gives N puzzles that have a demonstration
        references, demo_source = found
        joined = [i for i in keep if puzzles[i] in references]
        if keep and not joined:
            raise DataError(f"none of the {len(keep)} {task.name} {split} puzzles of {source} has a demonstration "
                            f"in {demo_source} (joined by target and sorted numbers): pass --demo-file FILE "
                            "with theirs")
        if len(joined) < len(keep) and os.environ.get("RANK", "0") == "0":  # once, not once per torchrun rank
            print(f"note: {len(keep) - len(joined)} of {len(keep)} {task.name} {split} puzzles have no "
                  f"demonstration in {demo_source}: left out", flush=True)
        keep = joined
    random.Random(seed).shuffle(keep)
    keep = keep[:limit] if limit is not None else keep
    examples = []
    for i, row in zip(keep, rows.select(keep)):
        try:
            example = task.make_example(row)
        except Exception as err:
            raise DataError(f"{source}: {where(lines, i)} is not a valid {task.name} example "
                            f"({first_line(err, typed=True)})") from None
        example.reference = str(row.get("reference") or (found[0][puzzles[i]] if found else example.reference))
        example.uid, example.source = uids[i], f"{source} {where(lines, i)}"  # the file's line, not the shuffled index
        if needs_reference and not example.reference.strip():
            raise DataError(f"{source}: {where(lines, i)} has no demonstration for the similarity reward "
                            f"({_no_reference(task, rows)}); every row needs one for --reward sim")
        examples.append(example)
    return examples


def _no_reference(task, rows) -> str:
    """Why a row has no demonstration, and what gives it one."""
    if "reference" in rows.column_names:
        joined = f", or leave the column out to join {task.demos.hub_id}'s" if task.demos else ""
        return f"its 'reference' is empty: give it a value{joined}"
    return f"the {task.name} row gives an empty one: add a 'reference' column with a demonstration"


def _demonstrations(task, demo_file: str | None) -> tuple[dict[tuple, str], str]:
    """({puzzle: reference}, where from) of `demo_file`, or else of the task's `demos` hub dataset."""
    demos, who = task.demos, f"a {task.name} demonstration"
    if demo_file:
        rows, lines = read_file(demo_file, "--demo-file", demos.columns, who)
        source = f"--demo-file {demo_file}"
    else:
        advice = f"pass --demo-file FILE (.jsonl or .parquet with columns {', '.join(demos.columns)})"
        rows, lines = read_hub(demos.hub_id, demos.hub_config, "train", advice), None
        source = f"{demos.hub_id} ({demos.hub_config})"
    references = {}
    try:
        check_rows(rows, lines, demos.columns, demos.columns, source, who)
        for i, row in enumerate(rows.select_columns(list(demos.columns))):
            try:
                puzzle, reference = demos.read(row)
            except Exception as err:
                raise DataError(f"{source}: {where(lines, i)} is not a valid {task.name} demonstration "
                                f"({first_line(err, typed=True)})") from None
            if puzzle not in references or len(reference) < len(references[puzzle]):  # several: the shortest
                references[puzzle] = reference
    except UnicodeDecodeError as err:
        raise DataError(f"{source}: not UTF-8 text ({first_line(err, typed=True)})") from None
    return references, source


# ---------------------------------------------------------------- reading and linting
def hub_reachable(timeout: float = 3.0) -> bool:
    """Fail in seconds, not after datasets' long retries, when there is no network."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return True  # offline mode: let datasets read its cache (it fails fast when it can't)
    url = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _empty(value) -> bool:
    return value is None or (isinstance(value, str) and not value.strip()) or (
        isinstance(value, (list, tuple, dict)) and not value)


def _row_problem(row: dict, required) -> str | None:
    """What is wrong with one row's `required` fields (absent, empty, absurdly long), or None."""
    lacking = [name for name in required if _empty(row.get(name))]
    if lacking:
        return f"lacks a value for {', '.join(map(repr, lacking))}"
    long = [name for name in required if isinstance(row[name], str) and len(row[name]) > MAX_ROW_CHARS]
    if long:
        return (f"has a {long[0]!r} of {len(row[long[0]]):,} characters, over the {MAX_ROW_CHARS:,} a row may "
                "hold (plumbing/data.py: MAX_ROW_CHARS)")
    return None


class JSONNumber(float):
    """A JSON number with a fraction or exponent, printed as the file wrote it: str() of "1e5" is "1e5", not
    "100000.0"; it is still a float for the rows that want a number (countdown's target 24.0 is 24)."""

    def __new__(cls, text: str):
        number = super().__new__(cls, text)
        number.text = text
        return number

    def __str__(self):
        return self.text

    __repr__ = __str__


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")  # Python's json reads NaN and Infinity; a row's text is not NaN


def parse_json(text: str):
    """JSON as the file holds it: strings stay the strings they are ("1e5", "null", "7"), numbers keep their text."""
    return json.loads(text, parse_float=JSONNumber, parse_constant=_not_json)


def _parse_line(raw: bytes, required) -> tuple[dict | None, str | None]:
    """(the row, None) of one line of a JSON Lines file, or (None, what is wrong with it)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return None, f"is not UTF-8 text (byte 0x{raw[err.start]:02x} at byte {err.start + 1} of the line)"
    if len(text) > MAX_ROW_CHARS:  # before parsing: a 50 MB line costs a read, not a parse
        return None, (f"is {len(text):,} characters long, over the {MAX_ROW_CHARS:,} a row may hold "
                      "(plumbing/data.py: MAX_ROW_CHARS)")
    try:
        row = parse_json(text)
    except json.JSONDecodeError as err:
        return None, f"is not valid JSON ({err.msg} at column {err.colno})"
    except ValueError as err:
        return None, f"is not valid JSON ({err})"
    if not isinstance(row, dict):
        return None, "is not a JSON object"
    return row, _row_problem(row, required)


def check_jsonl(path: str, required, task: str, hint: str = "", flag: str = "--data-file") -> tuple[list, list[int]]:
    """(rows, their line numbers) of a JSON Lines file, each value as the file holds it (blank lines are skipped,
    as datasets does). DataError, one line naming the first bad line and how many are bad, when any line is not
    UTF-8, not one JSON object, longer than MAX_ROW_CHARS, or lacks a value for a `required` field."""
    rows, lines, first, bad = [], [], None, 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            lines.append(number)
            row, problem = _parse_line(raw, required)
            rows.append(row)
            if problem is not None:
                first, bad = first or f"line {number} {problem}", bad + 1
    if bad:
        raise DataError(f"{flag} {path}: {first}; {bad} of {len(lines)} rows are bad ({task} needs "
                        f"{', '.join(required)} in every row){hint}")
    return rows, lines


def _json_array(path: str, flag: str) -> list | None:
    """The rows of a .json file that holds one array of objects, or None when it holds JSON Lines."""
    with open(path, "rb") as f:
        raw = f.read()
    if not raw.lstrip().startswith(b"["):
        return None
    try:
        rows = parse_json(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise DataError(f"{flag} {path}: not UTF-8 text (byte 0x{raw[err.start]:02x} at byte {err.start + 1})"
                        ) from None
    except ValueError as err:
        raise DataError(f"{flag} {path}: not valid JSON ({first_line(err)})") from None
    bad = [i for i, row in enumerate(rows) if not isinstance(row, dict)]
    if bad:
        raise DataError(f"{flag} {path}: row {bad[0] + 1} of its array is not a JSON object")
    return rows


class Rows:
    """A JSON file's rows with each value as the file holds it, read as a datasets.Dataset is here (column_names,
    a column's values, select). datasets' JSON reader would re-type a column of mixed types through pandas: the
    question "1e5" became 100000.0, "null" None, and countdown's target "7" the number 7."""

    def __init__(self, rows: list[dict]):
        self.rows = rows
        self.column_names = list(dict.fromkeys(name for row in rows for name in row))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, column: str) -> list:
        return [row.get(column) for row in self.rows]

    def __iter__(self):
        return ({name: row.get(name) for name in self.column_names} for row in self.rows)

    def select(self, indices) -> "Rows":
        return Rows([self.rows[i] for i in indices])

    def select_columns(self, columns) -> "Rows":
        return Rows([{name: row.get(name) for name in columns} for row in self.rows])


def _datasets():
    import datasets  # slow import, only needed for hub-backed tasks

    datasets.disable_progress_bars()  # a bar per split on stderr, where an error should be the only line
    return datasets


def read_file(path: str, flag: str, required, task: str, hint: str = ""):
    """(datasets.Dataset, each row's line number, or None unless JSON Lines) of a local file given with `flag`."""
    if error := data_file_error(path, flag):
        raise DataError(error)
    if os.path.getsize(path) == 0 or not open(path, "rb").read(4096).strip():  # datasets: "StopIteration: "
        raise DataError(f"{flag} {path}: the file is empty; it needs {task}'s rows")
    if path.lower().endswith((".json", ".jsonl")):  # read here, as the file holds it (Rows)
        array = _json_array(path, flag) if path.lower().endswith(".json") else None
        if array is None:
            rows, lines = check_jsonl(path, required, task, hint, flag)
            return Rows(rows), lines
        return Rows(array), None  # check_rows checks each row's values, naming it "row N"
    try:
        return _datasets().load_dataset("parquet", data_files=path, split="train"), None
    except Exception as err:
        raise DataError(f"{flag} {path}: cannot read it ({first_line(err, typed=True)})") from None


def data_file_error(path: str, flag: str = "--data-file", splits=("train", "test")) -> str | None:
    """Why `path` cannot be read as a data file, as one line, or None: a name that is not .jsonl, .json or
    .parquet, a folder, or no such file. With "{split}" in its name (one file per split), each of `splits`'."""
    for name in dict.fromkeys(path.replace("{split}", split) for split in splits):
        each = f" (one file per split: {{split}} in {path} stands for {' and '.join(splits)})" if name != path else ""
        if os.path.isdir(name):
            return f"{flag} {name} is a folder; pass a .jsonl, .json or .parquet file{each}"
        if os.path.splitext(name)[1].lower() not in (".json", ".jsonl", ".parquet"):
            return f"{flag} {name}: expected a .jsonl, .json or .parquet file"
        if not os.path.isfile(name):
            return f"{flag} {name} does not exist{each}"
    return None


def read_hub(hub_id: str, config: str | None, split: str, advice: str):
    """One split of a hub dataset; DataError, one line ending in `advice`, when it cannot be had."""
    if not hub_reachable():
        raise DataError(f"cannot reach the Hugging Face Hub to load {hub_id}: {advice}, "
                        "or set HF_HUB_OFFLINE=1 to use a cached copy")
    try:
        return _datasets().load_dataset(hub_id, config, split=split)
    except Exception as err:
        raise DataError(f"cannot load {hub_id} ({first_line(err, typed=True)}): {advice}") from None


def where(lines: list[int] | None, i: int) -> str:
    return f"line {lines[i]}" if lines else f"row {i + 1}"


def check_rows(rows, lines, columns, required, source: str, who: str, hint: str = "") -> None:
    """DataError, one line, when `rows` lack one of `columns`, or a row lacks a value in a `required` one (a JSON
    Lines file was checked line by line as it was read: check_jsonl)."""
    missing = [column for column in columns if column not in rows.column_names]
    if missing:
        raise DataError(f"{source} lacks column(s) {', '.join(missing)} needed by {who} "
                        f"(it has: {', '.join(rows.column_names)}){hint}")
    if lines is None:
        problems = [(i, problem) for i, values in enumerate(zip(*(rows[c] for c in required)))
                    if (problem := _row_problem(dict(zip(required, values)), required))]
        if problems:
            raise DataError(f"{source}: {where(lines, problems[0][0])} {problems[0][1]}; {len(problems)} of "
                            f"{len(rows)} rows are bad ({who} needs {', '.join(required)} in every row)")


# ---------------------------------------------------------------- the training order (train.py)
@lru_cache(maxsize=2)
def epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def batch_indices(step: int, batch: int, n: int, seed: int, refill: int = 0) -> list[int]:
    """Prompts of `step`: a seeded permutation of the training set per epoch, read in order (no state). Refill
    round r >= 1 of the step (rollout.py: dapo_rollout) reads a permutation of its own, seeded by (seed, step, r):
    what a refill consumes is a function of the step, so a resumed run draws the same and the stream is unmoved."""
    if refill:
        order = np.random.default_rng([seed, step, refill]).permutation(n)  # 3 words: no epoch's seed
        return [int(order[i % n]) for i in range(batch)]
    return [int(epoch_order(seed, pos // n, n)[pos % n]) for pos in range(step * batch, (step + 1) * batch)]


def load_data(args, task, weights: dict, master: bool = True):
    """train.py's rows: the task's training rows and at most --eval-examples held-out rows (said in one line when
    none); a data file with only held-out rows is a DataError."""
    sim = "sim" in weights  # Countdown-Sim joins GOLD's demos
    demos = dict(demos=True, demo_file=args.demo_file or None) if sim else {}
    train_set = task.load("train", data_file=args.data_file or None, seed=args.seed, **demos)
    test_set = task.load("test", data_file=args.data_file or None, limit=args.eval_examples, seed=args.seed,
                         **({} if task.has_verifier else demos)) if args.eval_examples else []  # scored exactly
    if not train_set:
        raise DataError(f"--data-file {args.data_file}: every row falls in the held-out split (~10% by prompt hash)")
    if args.eval_examples and not test_set and master:
        print(f"note: --data-file {args.data_file} leaves no held-out rows (tasks.py holds out ~10% by prompt "
              "hash): no evaluation before, during (--eval-every) or after training, no eval.json")
    if master and (repeated := repeated_prompts(test_set, train_set)):
        print(f"note: {len(repeated)} of {len(test_set)} held-out rows repeat a training prompt up to whitespace and "
              f"case (first: {repeated[0].source or repeated[0].uid}): kept, but their score is not a held-out one")
    return train_set, test_set


def _prompt_text(example) -> str:
    return " ".join(" ".join(str(m.get("content", "")) for m in example.prompt).casefold().split())


def repeated_prompts(held_out: list, train: list) -> list:
    """The held-out examples whose prompt a training example has too, up to whitespace and case. The split hashes
    the exact text, so a copy with another space or capital can land on both sides (and a hub's own test split, or
    a {split} file, can repeat a training row outright). They are kept and named (train.py says so in one line):
    dropping them would change the held-out set a run reports against."""
    if not held_out:
        return []
    seen = {_prompt_text(example) for example in train}
    return [example for example in held_out if _prompt_text(example) in seen]
