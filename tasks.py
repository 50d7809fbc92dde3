"""Tasks: data, prompts, demonstrations and rewards (SoftmaxGRPO Section 5.1, Appendix B.3).

    name         data: hub id (or --data-file with the same columns)             --reward exact    sim
    gsm8k        openai/gsm8k "main": question, answer ("... #### 72")           math-verify       yes
    countdown    Jiayi-Pan/Countdown-Tasks-3to4: nums, target                    expression check  *
    deepmath     zwhe99/DeepMath-103K: question, final_answer, r1_solution_1..3  math-verify       yes
    poetry       --data-file: instruction, poem (jnb666/poems has poems only)    refused           yes
    meetingbank  microsoft/MeetingBank-LLMCompressed: prompt, compressed_prompt  refused           yes
    arith        procedural "What is 7 + 5?" (the CPU demo)                      last integer      yes
    countdown24  procedural 24-game puzzles: four integers 1-13, solvable        expression check  yes

A new task is one more `Task(...)` entry in TASKS, built with keywords (see the README's "Fork it").

    from tasks import get_task
    task = get_task("gsm8k")
    examples = task.load("train", data_file=None, limit=1000, seed=0)   # DataError when offline
    task.reward(completion_text, examples[0], kind="exact")

Tests: python -m pytest tests/test_tasks.py -q

Choices the paper leaves open, and departures:
1. Think-then-answer format: every prompt but arith has a system message asking for reasoning in
   <think> </think> and the answer after it (Appendix B.6 templates are not in the text).
   GSM8K and DeepMath append the boxed instruction; Countdown states the puzzle only; Poetry's
   system message starts with the paper's "You are a helpful assistant that writes poetry."
2. arith keeps the bare "What is a + b?" user message (a, b in 0-15) with no format rule, so that the
   embedded 135M demo model, which does not follow a think-then-answer format, already answers some
   sums right at temperature 1 and the demo's rewards are not all zero (`python eval.py --model
   smollm2-135m --task arith --samples 8` measures how many); its 256 problems split by hash into 192
   train and 64 test (the demo's held-out set).
3. Demonstrations (the `reference` for --reward sim): GSM8K uses its own worked answer (calculator
   notes removed, "#### N" written as \\boxed{N}); the paper's HAD653/gsm8k-cot-120b is not joined
   (its columns could not be checked offline). DeepMath uses the shortest of the three R1
   solutions with its thinking removed (the reward compares final answers). MeetingBank has no
   summaries, so GPT-4's compressed transcript (`compressed_prompt`) is the reference. countdown24
   uses a brute-force solution. * Countdown-Tasks-3to4 has none; the paper took them from
   HuggingFaceTB/Countdown-Task-GOLD (verified_Qwen2.5-7B-Instruct), so --reward sim stops with a
   DataError there. A `reference` column in any --data-file replaces the task's own demonstration.
4. Splits: gsm8k uses the hub's test split. Hub datasets without one, and any single --data-file,
   get a deterministic held-out 10% by a hash of the prompt. A --data-file containing "{split}"
   (data/gsm8k-{split}.jsonl) is read whole, one file per split.
5. Procedural tasks: train streams cycle over their problems in seeded order (default 5000
   examples); test returns each held-out problem once, at most 500 (arith: 64 problems;
   countdown24: the 136 solvable puzzles among the 10% of multisets held out by hash).
"""

import hashlib
import itertools
import json
import os
import random
import re
import socket
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

from rewards import (
    countdown_expression,
    countdown_reward,
    final_answer,
    integer_reward,
    last_boxed,
    math_reward,
    similarity_reward,
)

FORMAT_RULE = ("First think through the task inside <think> </think> tags, "
               "then give your answer after </think>.")
SYSTEM = "You are a helpful assistant. " + FORMAT_RULE
POETRY_SYSTEM = "You are a helpful assistant that writes poetry. " + FORMAT_RULE
BOXED = "Please reason step by step, and put your final answer within \\boxed{}."
TEST_PERCENT = 10  # held-out share when a dataset has no test split
# A row (a JSON line, or one field of a hub or parquet row) longer than this is refused at load: about 250k
# tokens at ~4 characters per token, beyond the context of any model this trains (Qwen2.5: 32k, 131k with
# YaRN). A 50 MB line would otherwise be tokenised whole and sized into the sampler.
MAX_ROW_CHARS = 1_000_000


class DataError(ValueError):
    """A one-line, user-facing data problem: dataset unreachable, file missing, columns missing."""


@dataclass
class Example:
    prompt: list[dict]  # chat messages [{"role": ..., "content": ...}]
    gold: str | None  # verifier answer (None when the task has no verifier)
    reference: str  # demonstration for the similarity reward ("" when none)
    meta: dict = field(default_factory=dict)  # task extras, JSON-serialisable
    uid: str = ""  # stable id: task name + hash of the prompt (+ "#pass" for repeated problems)


def _digest(*parts) -> str:
    return hashlib.sha1("\x1f".join(str(part) for part in parts).encode()).hexdigest()


def _in_test(digest: str) -> bool:
    return int(digest[:8], 16) % 100 < TEST_PERCENT


def _chat(user: str, system: str | None = SYSTEM) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user}]


def _boxed_or_answer(completion: str) -> str:
    answer = final_answer(completion)
    boxed = last_boxed(answer)
    return answer if boxed is None else boxed


# ---------------------------------------------------------------- hub-backed tasks: one row -> Example
def _gsm8k(row: dict) -> Example:
    if "####" not in str(row["answer"]):
        raise ValueError("its answer has no final '#### N'")
    reasoning, _, answer = str(row["answer"]).rpartition("####")
    gold = answer.strip().replace(",", "")
    reasoning = re.sub(r"<<[^>]*>>", "", reasoning).strip()  # drop calculator notes "<<48/2=24>>"
    return Example(_chat(f"{row['question']}\n{BOXED}"), gold,
                   f"{reasoning}\nThe answer is \\boxed{{{gold}}}.")


def _countdown(row: dict) -> Example:
    numbers, target = [int(n) for n in row["nums"]], int(row["target"])
    user = (f"Using the numbers {numbers}, write an arithmetic expression that equals {target}. "
            "Use each number exactly once, with only +, -, *, / and parentheses.")
    return Example(_chat(user), str(target), "", {"numbers": numbers, "target": target})


def _deepmath(row: dict) -> Example:
    solutions = [str(row[f"r1_solution_{i}"]) for i in (1, 2, 3) if row.get(f"r1_solution_{i}")]
    shortest = min(solutions, key=len) if solutions else ""  # Appendix B.3: shortest of three
    return Example(_chat(f"{row['question']}\n{BOXED}"), str(row["final_answer"]).strip(),
                   final_answer(shortest))


def _poetry(row: dict) -> Example:
    return Example(_chat(str(row["instruction"]), POETRY_SYSTEM), None, str(row["poem"]))


def _meetingbank(row: dict) -> Example:
    user = ("Summarize this city council meeting transcript concisely and informatively.\n\n"
            f"{row['prompt']}")
    return Example(_chat(user), None, str(row["compressed_prompt"]))


# ---------------------------------------------------------------- procedural tasks
def _passes(items: list, seed: int, repeat: bool):
    """Yield (item, pass) in seeded shuffles of `items`: once, or forever when `repeat`."""
    rng = random.Random(seed)
    for pass_index in itertools.count():
        order = list(items)
        rng.shuffle(order)
        yield from ((item, pass_index) for item in order)
        if not repeat or not items:
            return


ARITH_MAX, ARITH_TEST = 16, 64  # operands 0..15; 64 of the 256 problems held out


def _arith(split: str, limit: int, seed: int) -> list[Example]:
    problems = sorted(((a, b) for a in range(ARITH_MAX) for b in range(ARITH_MAX)),
                      key=lambda ab: _digest("arith", *ab))
    problems = problems[:ARITH_TEST] if split == "test" else problems[ARITH_TEST:]  # disjoint by problem
    return [Example(_chat(f"What is {a} + {b}?", system=None), str(a + b), f"{a} + {b} = {a + b}",
                    {"a": a, "b": b}, f"arith-{a}+{b}#{p}")
            for (a, b), p in itertools.islice(_passes(problems, seed, split == "train"), limit)]


def _search(items: list[tuple[float, str]], numbers: list[int], target: int) -> str | None:
    """Depth-first search over pairs; floats to prune, the exact `countdown_reward` to accept."""
    if len(items) == 1:
        value, expr = items[0]
        expr = expr[1:-1] if expr.startswith("(") else expr  # outer parentheses
        ok = abs(value - target) < 1e-6 and countdown_reward(expr, numbers, target) == 1.0
        return expr if ok else None
    for i, j in itertools.combinations(range(len(items)), 2):
        (a, left), (b, right) = items[i], items[j]
        rest = [item for k, item in enumerate(items) if k not in (i, j)]
        options = [(a + b, f"({left} + {right})"), (a * b, f"({left} * {right})"),
                   (a - b, f"({left} - {right})"), (b - a, f"({right} - {left})")]
        options += [(a / b, f"({left} / {right})")] if b else []
        options += [(b / a, f"({right} / {left})")] if a else []
        for option in options:
            found = _search(rest + [option], numbers, target)
            if found:
                return found
    return None


@cache
def solve_countdown(numbers: tuple[int, ...], target: int = 24) -> str | None:
    """An expression using each number once that equals `target` exactly, or None (brute force)."""
    return _search([(float(n), str(n)) for n in numbers], list(numbers), target)


def _countdown24(split: str, limit: int, seed: int) -> list[Example]:
    quads = [q for q in itertools.combinations_with_replacement(range(1, 14), 4)
             if _in_test(_digest("countdown24", *q)) == (split == "test")]  # disjoint by multiset
    rng, out = random.Random(seed + 1), []
    for quad, p in _passes(quads, seed, repeat=split == "train"):
        if len(out) >= limit:
            break
        solution = solve_countdown(quad)
        if solution is None:  # about a quarter of the multisets cannot make 24
            continue
        numbers = rng.sample(quad, 4)  # shown in a random order
        example = _countdown(dict(nums=numbers, target=24))
        example.reference, example.uid = solution, f"countdown24-{'-'.join(map(str, quad))}#{p}"
        out.append(example)
    return out


# ---------------------------------------------------------------- loading
def _hub_reachable(timeout: float = 3.0) -> bool:
    """Fail in seconds, not after datasets' long retries, when there is no network."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return True  # offline mode: let datasets read its cache (it fails fast when it can't)
    url = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


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
                "hold (tasks.MAX_ROW_CHARS)")
    return None


def _line_problem(raw: bytes, required) -> str | None:
    """What is wrong with one line of a JSON Lines file, or None."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return f"is not UTF-8 text (byte 0x{raw[err.start]:02x} at byte {err.start + 1} of the line)"
    if len(text) > MAX_ROW_CHARS:  # before parsing: a 50 MB line costs a read, not a parse
        return f"is {len(text):,} characters long, over the {MAX_ROW_CHARS:,} a row may hold (tasks.MAX_ROW_CHARS)"
    try:
        row = json.loads(text)
    except json.JSONDecodeError as err:
        return f"is not valid JSON ({err.msg} at column {err.colno})"
    return "is not a JSON object" if not isinstance(row, dict) else _row_problem(row, required)


def check_jsonl(path: str, required, task: str, hint: str = "") -> list[int]:
    """Line numbers of the rows of a JSON Lines file (blank lines are skipped, as datasets does). DataError, one
    line naming the first bad line and how many are bad, when any line is not UTF-8, not one JSON object,
    longer than MAX_ROW_CHARS, or lacks a value for a `required` field."""
    lines, first, bad = [], None, 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            lines.append(number)
            if (problem := _line_problem(raw, required)) is not None:
                first, bad = first or f"line {number} {problem}", bad + 1
    if bad:
        raise DataError(f"--data-file {path}: {first}; {bad} of {len(lines)} rows are bad ({task} needs "
                        f"{', '.join(required)} in every row){hint}")
    return lines


@dataclass(kw_only=True)
class Task:
    """A task, built with keywords: hub-backed (hub_id, columns, make_example) or procedural (generate)."""

    name: str
    hub_id: str | None = None  # dataset id for datasets.load_dataset (None: --data-file only, or procedural)
    columns: tuple[str, ...] = ()  # required in hub rows and --data-file rows
    key: tuple[str, ...] = ()  # columns that identify a prompt (uid and held-out split)
    make_example: Callable[[dict], Example] | None = None
    verifier: Callable[[str, Example], float] | None = None
    answer: Callable[[str], str] = final_answer  # what `extract` reports
    hub_config: str | None = None
    hub_test_split: str | None = None  # the hub's own test split; None -> held-out by prompt
    generate: Callable[[str, int, int], list[Example]] | None = None  # procedural tasks
    hint: str = ""  # appended to the missing-columns error
    may_be_empty: tuple[str, ...] = ()  # columns that must exist but may be empty; the others need a value

    @property
    def required(self) -> tuple[str, ...]:
        """The columns every row needs a value in: a row without its answer must not train against "None"."""
        return tuple(column for column in self.columns if column not in self.may_be_empty)

    @property
    def has_verifier(self) -> bool:
        """Tasks without one (poetry, meetingbank) train on the similarity reward only."""
        return self.verifier is not None

    def load(self, split: str = "train", *, data_file: str | None = None,
             limit: int | None = None, seed: int = 0) -> list[Example]:
        """Examples of `split` ("train" or "test"), shuffled by `seed`, at most `limit`."""
        if split not in ("train", "test"):
            raise DataError(f"{self.name}: split must be 'train' or 'test', not {split!r}")
        if self.generate is not None:
            if data_file:
                raise DataError(f"{self.name} is generated procedurally and takes no --data-file")
            default = 5000 if split == "train" else 500
            return self.generate(split, default if limit is None else limit, seed)
        rows, whole, lines = self._rows(split, data_file)
        source = data_file.replace("{split}", split) if data_file else self.hub_id
        missing = [column for column in self.columns if column not in rows.column_names]
        if missing:
            raise DataError(f"{source} lacks column(s) {', '.join(missing)} needed by {self.name} "
                            f"(it has: {', '.join(rows.column_names)}){self.hint}")
        try:
            return self._examples(rows, whole, lines, split, limit, seed, source)
        except UnicodeDecodeError as err:  # parquet or .json strings that are not UTF-8, met as they are read
            raise DataError(f"{source}: not UTF-8 text ({_one_line(err)})") from None

    def _examples(self, rows, whole, lines, split, limit, seed, source) -> list[Example]:
        def where(i):
            return f"line {lines[i]}" if lines else f"row {i + 1}"

        if lines is None:  # a JSON Lines file was checked line by line as it was read (check_jsonl)
            problems = [(i, problem) for i, values in enumerate(zip(*(rows[c] for c in self.required)))
                        if (problem := _row_problem(dict(zip(self.required, values)), self.required))]
            if problems:
                raise DataError(f"{source}: {where(problems[0][0])} {problems[0][1]}; {len(problems)} of "
                                f"{len(rows)} rows are bad ({self.name} needs {', '.join(self.required)} in every "
                                "row)")
        digests = [_digest(*values) for values in zip(*(rows[column] for column in self.key))]
        seen, uids = {}, []
        for digest in digests:  # a repeated prompt keeps its split and gets "#1", "#2", ...
            seen[digest] = seen.get(digest, -1) + 1
            uids.append(f"{self.name}-{digest[:12]}" + (f"#{seen[digest]}" if seen[digest] else ""))
        keep = [i for i, d in enumerate(digests) if whole or _in_test(d) == (split == "test")]
        random.Random(seed).shuffle(keep)
        keep = keep[:limit] if limit is not None else keep
        examples = []
        for i, row in zip(keep, rows.select(keep)):
            try:
                example = self.make_example(row)
            except Exception as err:
                raise DataError(f"{source}: {where(i)} is not a valid {self.name} example ({_one_line(err)})") from None
            example.reference = str(row.get("reference") or example.reference)
            example.uid = uids[i]
            examples.append(example)
        return examples

    def _rows(self, split: str, data_file: str | None):
        """(datasets.Dataset, whether it already is exactly `split`, each row's line number in a JSON Lines file
        or None) from a file or the hub."""
        import datasets  # slow import, only needed for hub-backed tasks

        datasets.disable_progress_bars()  # a bar per split on stderr, where an error should be the only line
        if data_file:
            path = data_file.replace("{split}", split)
            kind = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}.get(
                os.path.splitext(path)[1].lower())
            if kind is None:
                raise DataError(f"--data-file {path}: expected a .jsonl, .json or .parquet file")
            if not os.path.isfile(path):
                raise DataError(f"--data-file {path}: no such file")
            lines = check_jsonl(path, self.required, self.name, self.hint) if path.lower().endswith(".jsonl") else None
            try:
                return datasets.load_dataset(kind, data_files=path, split="train"), path != data_file, lines
            except Exception as err:
                raise DataError(f"--data-file {path}: cannot read it ({_one_line(err)})") from None
        advice = (f"pass --data-file FILE (.jsonl or .parquet with columns "
                  f"{', '.join(self.columns)})")
        if self.hub_id is None:
            raise DataError(f"{self.name} has no hub dataset: {advice}")
        if not _hub_reachable():
            raise DataError(f"cannot reach the Hugging Face Hub to load {self.hub_id}: {advice}, "
                            "or set HF_HUB_OFFLINE=1 to use a cached copy")
        hub_split = self.hub_test_split if split == "test" and self.hub_test_split else "train"
        try:
            rows = datasets.load_dataset(self.hub_id, self.hub_config, split=hub_split)
        except Exception as err:
            raise DataError(f"cannot load {self.hub_id} ({_one_line(err)}): {advice}") from None
        return rows, self.hub_test_split is not None, None

    def reward(self, completion: str, example: Example, kind: str = "exact") -> float:
        """kind "exact": the task's 0/1 verifier; kind "sim": similarity to the demonstration."""
        if kind == "exact":
            if not self.has_verifier:
                raise ValueError(f"{self.name} has no verifier: use --reward sim")
            return self.verifier(completion, example)
        if kind == "sim":
            if not example.reference:
                raise DataError(f"{self.name} example {example.uid} has no demonstration for "
                                "--reward sim: pass --data-file with a 'reference' column")
            return similarity_reward(completion, example.reference)
        raise ValueError(f"unknown reward kind {kind!r}: use 'exact' or 'sim'")

    def extract(self, completion: str) -> str:
        """The answer the verifier looks at (for eval output), at most 500 characters."""
        return self.answer(completion)[:500]


def _last_integer(completion: str) -> str:
    found = re.findall(r"-?[0-9]+", _boxed_or_answer(completion).replace(",", "")[-1000:])
    return found[-1] if found else ""


# A new task is one more entry here. `verifier(completion, example)` scores a completion (0 or 1);
# `answer(completion)` is what eval.py reports as the extracted answer.
TASKS: dict[str, Task] = {task.name: task for task in [
    Task(name="gsm8k", hub_id="openai/gsm8k", hub_config="main", hub_test_split="test",
         columns=("question", "answer"), key=("question",), make_example=_gsm8k,
         verifier=lambda completion, ex: math_reward(completion, ex.gold), answer=_boxed_or_answer),
    Task(name="countdown", hub_id="Jiayi-Pan/Countdown-Tasks-3to4",
         columns=("nums", "target"), key=("nums", "target"), make_example=_countdown,
         verifier=lambda completion, ex: countdown_reward(completion, ex.meta["numbers"], ex.meta["target"]),
         answer=countdown_expression),
    Task(name="deepmath", hub_id="zwhe99/DeepMath-103K",
         columns=("question", "final_answer", "r1_solution_1", "r1_solution_2", "r1_solution_3"),
         may_be_empty=("r1_solution_1", "r1_solution_2", "r1_solution_3"), key=("question",), make_example=_deepmath,
         verifier=lambda completion, ex: math_reward(completion, ex.gold), answer=_boxed_or_answer),
    Task(name="poetry", hub_id="jnb666/poems", columns=("instruction", "poem"),
         key=("instruction",), make_example=_poetry,
         hint=". jnb666/poems holds poems only; the paper wrote an instruction for each poem "
              "with an LLM: pass them with --data-file (columns instruction, poem)"),
    Task(name="meetingbank", hub_id="microsoft/MeetingBank-LLMCompressed",
         columns=("prompt", "compressed_prompt"), key=("prompt",), make_example=_meetingbank),
    Task(name="arith", generate=_arith,
         verifier=lambda completion, ex: integer_reward(completion, ex.gold), answer=_last_integer),
    Task(name="countdown24", generate=_countdown24,
         verifier=lambda completion, ex: countdown_reward(completion, ex.meta["numbers"], ex.meta["target"]),
         answer=countdown_expression),
]}


def get_task(name: str) -> Task:
    """The task called `name`; ValueError listing the valid names otherwise."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}: choose one of {', '.join(TASKS)}")
    return TASKS[name]
