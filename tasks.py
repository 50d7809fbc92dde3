"""Tasks: data, prompts, demonstrations and rewards (SoftmaxGRPO Section 5.1, Appendix B.3).

    name          data: hub id (or --data-file with the same columns)              --reward exact    sim
    gsm8k         openai/gsm8k "main": question, answer ("... #### 72")            math-verify       yes
    countdown     Jiayi-Pan/Countdown-Tasks-3to4: nums, target                     expression check  joined*
    deepmath      zwhe99/DeepMath-103K: question, final_answer, r1_solution_1..3   math-verify       yes
    poetry        --data-file: instruction, poem (jnb666/poems has poems only)     refused           yes
    meetingbank   microsoft/MeetingBank-LLMCompressed: prompt, compressed_prompt   refused           yes
    openthoughts  open-thoughts/OpenThoughts3-1.2M: conversations [{from, value}]  refused           yes
    arith         procedural "What is 7 + 5?" (the CPU demo)                       last integer      yes
    countdown24   procedural 24-game puzzles: four integers 1-13, solvable         expression check  yes

A new task is one more `Task(...)` entry in TASKS, built with keywords (see the README's "Fork it").

    from tasks import get_task, reward_weights
    task = get_task("gsm8k")
    examples = task.load("train", data_file=None, limit=1000, seed=0)   # DataError when offline
    task.reward(completion_text, examples[0], kind="exact")   # or "sim", or any term of rewards.REWARD_TERMS
    reward_weights(task, "exact", "exact=1,format=0.1")       # --reward-weights: {"exact": 1.0, "format": 0.1}
    get_task("countdown").load("train", demos=True)           # puzzles joined to Countdown-Task-GOLD (*)

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
   summaries, so GPT-4's compressed transcript (`compressed_prompt`) is the reference. OpenThoughts
   uses the gpt turn that answers the first human turn, its thinking removed as for DeepMath (a turn
   whose <think> never closes is a bad row); its preset trains on 0.35 format + 0.65 sim
   (--reward-weights), as the official run does. countdown24 uses a brute-force solution. A `reference`
   column in any --data-file replaces the task's own demonstration.
   * Countdown-Tasks-3to4 has none. With `demos=True` (train.py and eval.py pass it when the reward
   uses sim) each puzzle is joined to a demonstration of HuggingFaceTB/Countdown-Task-GOLD,
   configuration verified_Qwen2.5-7B-Instruct, as the paper's (or --demo-file's: the same columns nums,
   target, messages), by its target and its numbers sorted: their order does not change which
   expressions solve it. The reference is the answer of the demonstration's last assistant turn (thinking
   and <answer> tags removed, as the official reward reads it); several for one puzzle: the shortest.
   Puzzles without one are dropped with a one-line note, and a DataError stops a load where none has
   one. The official prepare_data.py trains on GOLD's own rows; this keeps the puzzles of the task's data
   that GOLD solves. A --data-file with a `reference` column is not joined.
4. Splits: gsm8k uses the hub's test split. Hub datasets without one, and any single --data-file,
   get a deterministic held-out 10% by a hash of the prompt (OpenThoughts: of its human turn, so a
   question asked more than once stays in one split). A --data-file containing "{split}"
   (data/gsm8k-{split}.jsonl) is read whole, one file per split.
5. Procedural tasks: train streams cycle over their problems in seeded order (default 5000
   examples); test returns each held-out problem once, at most 500 (arith: 64 problems;
   countdown24: the 136 solvable puzzles among the 10% of multisets held out by hash).
"""

import hashlib
import itertools
import json
import math
import os
import random
import re
import socket
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

from rewards import (
    REWARD_TERMS,
    countdown_expression,
    countdown_reward,
    final_answer,
    integer_reward,
    last_boxed,
    math_reward,
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


def _openthoughts_turns(conversation) -> tuple[str, str]:
    """(first human turn, the gpt turn answering it) of an OpenThoughts3 conversation [{"from", "value"}, ...]."""
    if not isinstance(conversation, list) or not all(isinstance(turn, dict) for turn in conversation):
        raise ValueError("its conversations is not a list of {from, value} turns")
    speakers = [turn.get("from") for turn in conversation]
    if "human" not in speakers:
        raise ValueError("its conversations has no human turn")
    asked = speakers.index("human")
    if "gpt" not in speakers[asked:]:
        raise ValueError("its conversations has no gpt turn after the human one")
    answered = speakers.index("gpt", asked)
    return str(conversation[asked].get("value") or ""), str(conversation[answered].get("value") or "")


def _openthoughts(row: dict) -> Example:
    question, response = _openthoughts_turns(row["conversations"])
    if not question.strip():
        raise ValueError("its human turn is empty")
    reference = final_answer(response)  # the similarity reward compares answers: the thinking is removed
    if not reference:
        raise ValueError("its gpt turn has no answer (it is empty, or its <think> never closes)")
    return Example(_chat(question), None, reference)


def _countdown_puzzle(row: dict) -> tuple:
    """What joins a Countdown puzzle to its demonstration: the numbers sorted (their order does not change which
    expressions solve it) and the target."""
    return tuple(sorted(int(n) for n in row["nums"])), int(row["target"])


def _gold_demonstration(row: dict) -> tuple[tuple, str]:
    """(puzzle, reference) of a Countdown-Task-GOLD row: the answer of its last assistant turn."""
    if not isinstance(row["messages"], list):
        raise ValueError("its messages is not a list of {role, content} turns")
    said = [turn.get("content") for turn in row["messages"]
            if isinstance(turn, dict) and turn.get("role") == "assistant"]
    if not said:
        raise ValueError("its messages have no assistant turn")
    reference = final_answer(str(said[-1] or ""))  # thinking and <answer> tags removed: what the reward compares
    if not reference:
        raise ValueError("its assistant turn has no answer after its thinking")
    return _countdown_puzzle(row), reference


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


def check_jsonl(path: str, required, task: str, hint: str = "", flag: str = "--data-file") -> list[int]:
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
        raise DataError(f"{flag} {path}: {first}; {bad} of {len(lines)} rows are bad ({task} needs "
                        f"{', '.join(required)} in every row){hint}")
    return lines


def _datasets():
    import datasets  # slow import, only needed for hub-backed tasks

    datasets.disable_progress_bars()  # a bar per split on stderr, where an error should be the only line
    return datasets


def _read_file(path: str, flag: str, required, task: str, hint: str = ""):
    """(datasets.Dataset, each row's line number, or None unless JSON Lines) of a local file given with `flag`."""
    kind = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}.get(os.path.splitext(path)[1].lower())
    if kind is None:
        raise DataError(f"{flag} {path}: expected a .jsonl, .json or .parquet file")
    if not os.path.isfile(path):
        raise DataError(f"{flag} {path}: no such file")
    lines = check_jsonl(path, required, task, hint, flag) if path.lower().endswith(".jsonl") else None
    try:
        return _datasets().load_dataset(kind, data_files=path, split="train"), lines
    except Exception as err:
        raise DataError(f"{flag} {path}: cannot read it ({_one_line(err)})") from None


def _read_hub(hub_id: str, config: str | None, split: str, advice: str):
    """One split of a hub dataset; DataError, one line ending in `advice`, when it cannot be had."""
    if not _hub_reachable():
        raise DataError(f"cannot reach the Hugging Face Hub to load {hub_id}: {advice}, "
                        "or set HF_HUB_OFFLINE=1 to use a cached copy")
    try:
        return _datasets().load_dataset(hub_id, config, split=split)
    except Exception as err:
        raise DataError(f"cannot load {hub_id} ({_one_line(err)}): {advice}") from None


def _where(lines: list[int] | None, i: int) -> str:
    return f"line {lines[i]}" if lines else f"row {i + 1}"


def _check_rows(rows, lines, columns, required, source: str, who: str, hint: str = "") -> None:
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
            raise DataError(f"{source}: {_where(lines, problems[0][0])} {problems[0][1]}; {len(problems)} of "
                            f"{len(rows)} rows are bad ({who} needs {', '.join(required)} in every row)")


@dataclass(kw_only=True)
class Demonstrations:
    """A task's demonstrations for the similarity reward, kept in another dataset and joined to its rows by puzzle
    (countdown: Countdown-Task-GOLD's; departure 3)."""

    hub_id: str
    hub_config: str | None = None
    columns: tuple[str, ...]  # every row of it needs a value in each (the hub's, and --demo-file's)
    read: Callable[[dict], tuple[tuple, str]]  # one of its rows -> (puzzle, reference)
    puzzle: Callable[[dict], tuple]  # a task row's `key` columns -> the same puzzle


@dataclass(kw_only=True)
class Task:
    """A task, built with keywords: hub-backed (hub_id, columns, make_example) or procedural (generate)."""

    name: str
    hub_id: str | None = None  # dataset id for datasets.load_dataset (None: --data-file only, or procedural)
    columns: tuple[str, ...] = ()  # required in hub rows and --data-file rows
    key: tuple[str, ...] = ()  # columns that identify a prompt (uid and held-out split)
    key_text: Callable[[dict], str] | None = None  # when only part of them does: {column: value} -> that part
    make_example: Callable[[dict], Example] | None = None
    verifier: Callable[[str, Example], float] | None = None
    answer: Callable[[str], str] = final_answer  # what `extract` reports
    hub_config: str | None = None
    hub_test_split: str | None = None  # the hub's own test split; None -> held-out by prompt
    generate: Callable[[str, int, int], list[Example]] | None = None  # procedural tasks
    hint: str = ""  # appended to the missing-columns error
    may_be_empty: tuple[str, ...] = ()  # columns that must exist but may be empty; the others need a value
    demos: Demonstrations | None = None  # where the similarity reward's demonstrations are, if not in the rows

    @property
    def required(self) -> tuple[str, ...]:
        """The columns every row needs a value in: a row without its answer must not train against "None"."""
        return tuple(column for column in self.columns if column not in self.may_be_empty)

    @property
    def has_verifier(self) -> bool:
        """Tasks without one (poetry, meetingbank, openthoughts) train on the similarity reward only."""
        return self.verifier is not None

    def load(self, split: str = "train", *, data_file: str | None = None, limit: int | None = None, seed: int = 0,
             demos: bool = False, demo_file: str | None = None) -> list[Example]:
        """Examples of `split` ("train" or "test"), shuffled by `seed`, at most `limit`.

        `demos`: the reward uses sim, so a task whose rows have no demonstrations (countdown) joins them from its
        `demos` dataset, or from `demo_file` (--demo-file), leaving out the puzzles that have none (departure 3).
        """
        if split not in ("train", "test"):
            raise DataError(f"{self.name}: split must be 'train' or 'test', not {split!r}")
        if demo_file and self.demos is None:
            raise DataError(f"--demo-file {demo_file}: {self.name} takes no --demo-file (its demonstrations are its "
                            "own; a 'reference' column in --data-file replaces them)")
        if demo_file and not demos:
            raise DataError(f"--demo-file {demo_file} is read only when the reward uses sim (--reward sim, or a sim "
                            "term in --reward-weights)")
        if self.generate is not None:
            if data_file:
                raise DataError(f"{self.name} is generated procedurally and takes no --data-file")
            default = 5000 if split == "train" else 500
            return self.generate(split, default if limit is None else limit, seed)
        rows, whole, lines = self._rows(split, data_file)
        source = data_file.replace("{split}", split) if data_file else self.hub_id
        join = demos and self.demos is not None and "reference" not in rows.column_names  # a file's own win
        try:
            _check_rows(rows, lines, self.columns, self.required, source, self.name, self.hint)
            found = self._demonstrations(demo_file) if join else None
            return self._examples(rows, whole, lines, split, limit, seed, source, found)
        except UnicodeDecodeError as err:  # parquet or .json strings that are not UTF-8, met as they are read
            raise DataError(f"{source}: not UTF-8 text ({_one_line(err)})") from None

    def _examples(self, rows, whole, lines, split, limit, seed, source, found=None) -> list[Example]:
        """`found`: ({puzzle: reference}, where from) to join, or None."""
        digests, puzzles = [], []
        for i, values in enumerate(zip(*(rows[column] for column in self.key))):
            named = dict(zip(self.key, values))
            try:
                digests.append(_digest(*values) if self.key_text is None else _digest(self.key_text(named)))
                puzzles += [self.demos.puzzle(named)] if found else []
            except Exception as err:
                raise DataError(f"{source}: {_where(lines, i)} is not a valid {self.name} example "
                                f"({_one_line(err)})") from None
        seen, uids = {}, []
        for digest in digests:  # a repeated prompt keeps its split and gets "#1", "#2", ...
            seen[digest] = seen.get(digest, -1) + 1
            uids.append(f"{self.name}-{digest[:12]}" + (f"#{seen[digest]}" if seen[digest] else ""))
        keep = [i for i, d in enumerate(digests) if whole or _in_test(d) == (split == "test")]
        if found:  # before the limit: --limit N gives N puzzles that have a demonstration
            references, demo_source = found
            joined = [i for i in keep if puzzles[i] in references]
            if keep and not joined:
                raise DataError(f"none of the {len(keep)} {self.name} {split} puzzles of {source} has a demonstration "
                                f"in {demo_source} (joined by target and sorted numbers): pass --demo-file FILE "
                                "with theirs")
            if len(joined) < len(keep) and os.environ.get("RANK", "0") == "0":  # once, not once per torchrun rank
                print(f"note: {len(keep) - len(joined)} of {len(keep)} {self.name} {split} puzzles have no "
                      f"demonstration in {demo_source}: left out", flush=True)
            keep = joined
        random.Random(seed).shuffle(keep)
        keep = keep[:limit] if limit is not None else keep
        examples = []
        for i, row in zip(keep, rows.select(keep)):
            try:
                example = self.make_example(row)
            except Exception as err:
                raise DataError(f"{source}: {_where(lines, i)} is not a valid {self.name} example "
                                f"({_one_line(err)})") from None
            example.reference = str(row.get("reference") or (found[0][puzzles[i]] if found else example.reference))
            example.uid = uids[i]
            examples.append(example)
        return examples

    def _rows(self, split: str, data_file: str | None):
        """(datasets.Dataset, whether it already is exactly `split`, each row's line number in a JSON Lines file
        or None) from a file or the hub."""
        if data_file:
            path = data_file.replace("{split}", split)
            rows, lines = _read_file(path, "--data-file", self.required, self.name, self.hint)
            return rows, path != data_file, lines
        advice = f"pass --data-file FILE (.jsonl or .parquet with columns {', '.join(self.columns)})"
        if self.hub_id is None:
            raise DataError(f"{self.name} has no hub dataset: {advice}")
        hub_split = self.hub_test_split if split == "test" and self.hub_test_split else "train"
        return _read_hub(self.hub_id, self.hub_config, hub_split, advice), self.hub_test_split is not None, None

    def _demonstrations(self, demo_file: str | None) -> tuple[dict[tuple, str], str]:
        """({puzzle: reference}, where from) of `demo_file`, or else of the `demos` hub dataset."""
        demos, who = self.demos, f"a {self.name} demonstration"
        if demo_file:
            rows, lines = _read_file(demo_file, "--demo-file", demos.columns, who)
            source = f"--demo-file {demo_file}"
        else:
            advice = f"pass --demo-file FILE (.jsonl or .parquet with columns {', '.join(demos.columns)})"
            rows, lines = _read_hub(demos.hub_id, demos.hub_config, "train", advice), None
            source = f"{demos.hub_id} ({demos.hub_config})"
        references = {}
        try:
            _check_rows(rows, lines, demos.columns, demos.columns, source, who)
            for i, row in enumerate(rows.select_columns(list(demos.columns))):
                try:
                    puzzle, reference = demos.read(row)
                except Exception as err:
                    raise DataError(f"{source}: {_where(lines, i)} is not a valid {self.name} demonstration "
                                    f"({_one_line(err)})") from None
                if puzzle not in references or len(reference) < len(references[puzzle]):  # several: the shortest
                    references[puzzle] = reference
        except UnicodeDecodeError as err:
            raise DataError(f"{source}: not UTF-8 text ({_one_line(err)})") from None
        return references, source

    def reward(self, completion: str, example: Example, kind: str = "exact") -> float:
        """One reward term of a completion: "exact", the task's 0/1 verifier; "sim", similarity to the
        demonstration (Appendix B.5); any other term of rewards.REWARD_TERMS ("format", or a fork's own)."""
        if kind == "exact":
            if not self.has_verifier:
                raise ValueError(f"{self.name} has no verifier: use --reward sim")
            return self.verifier(completion, example)
        if kind == "sim" and not example.reference:
            joined = "load the task with demos=True (train.py and eval.py do for sim), or " if self.demos else ""
            raise DataError(f"{self.name} example {example.uid} has no demonstration for --reward sim: {joined}pass "
                            "--data-file with a 'reference' column")
        if kind in REWARD_TERMS:
            return REWARD_TERMS[kind](completion, example)
        raise ValueError(f"unknown reward kind {kind!r}: use one of {', '.join(('exact', *REWARD_TERMS))}")

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
         answer=countdown_expression,
         demos=Demonstrations(hub_id="HuggingFaceTB/Countdown-Task-GOLD", hub_config="verified_Qwen2.5-7B-Instruct",
                              columns=("nums", "target", "messages"), read=_gold_demonstration,
                              puzzle=_countdown_puzzle)),
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
    Task(name="openthoughts", hub_id="open-thoughts/OpenThoughts3-1.2M", columns=("conversations",),
         key=("conversations",), key_text=lambda row: _openthoughts_turns(row["conversations"])[0],
         make_example=_openthoughts),
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


def reward_weights(task: Task, reward: str, text: str) -> dict[str, float]:
    """{term: weight} of --reward-weights ("format=0.35,sim=0.65"), or {reward: 1.0} when it is empty.

    The reward is r = sum_k w_k r_k (train.py: score). ValueError, one line naming the flag, for a piece that is not
    TERM=WEIGHT, a weight that is not a finite number, a term given twice, an unknown term, "exact" on a task without
    a verifier, no term at all, or every weight 0. A negative weight is a penalty; a 0 logs its term
    (reward/TERM) without training on it.
    """
    valid = ("exact", *REWARD_TERMS)
    if not text.strip():
        if reward == "exact" and not task.has_verifier:
            raise ValueError(f"task {task.name} has no verifier: use --reward sim")
        return {reward: 1.0}
    weights = {}
    for piece in filter(str.strip, text.split(",")):  # "exact=1," : a trailing comma is no term
        term, equals, value = (part.strip() for part in piece.partition("="))
        if not equals or not term:
            raise ValueError(f"--reward-weights: {piece.strip()!r} is not TERM=WEIGHT (e.g. format=0.35,sim=0.65)")
        try:
            weight = float(value)
        except ValueError:
            weight = math.nan
        if not math.isfinite(weight):
            raise ValueError(f"--reward-weights: the weight of {term} must be a finite number, not {value!r}")
        if term in weights:
            raise ValueError(f"--reward-weights: {term} is given twice")
        if term not in valid:
            raise ValueError(f"--reward-weights: unknown term {term!r}: choose from {', '.join(valid)}")
        if term == "exact" and not task.has_verifier:
            raise ValueError(f"--reward-weights: task {task.name} has no verifier, so no exact term: choose from "
                             f"{', '.join(valid[1:])}")
        weights[term] = weight
    if not weights:
        raise ValueError(f"--reward-weights {text!r} names no term: give TERM=WEIGHT, e.g. format=0.35,sim=0.65")
    if not any(weights.values()):
        raise ValueError("--reward-weights: every weight is 0, so every reward would be 0")
    return weights
