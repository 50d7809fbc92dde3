"""Tasks: data, prompts, demonstrations and rewards (SoftmaxGRPO Section 5.1, Appendix B.3).

A task turns a dataset row into an `Example` (chat prompt, gold answer, demonstration) and scores a completion with
its verifier or a term of rewards.REWARD_TERMS; a new task is one more `Task(...)` entry in TASKS. Reading and
checking the rows is plumbing/data.py's. Each task's data, how to call it, and the choices the paper leaves open
(departures 1-5): docs/tasks.md.

    python -m pytest tests/test_tasks.py -q
"""

from __future__ import annotations  # Task names Example, defined below it

import itertools
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache, partial, wraps

from plumbing import data
from plumbing.cli import parse_weights
from plumbing.data import DataError, Demonstrations, digest, in_test
from plumbing.procedural import search_expression, seeded_passes
from rewards import (
    REWARD_TERMS,
    countdown_expression,
    countdown_reward,
    declared_lengths,
    final_answer,
    integer_answer,
    integer_reward,
    last_boxed,
    math_reward,
    safe_reward,
)


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
    prompt_tokens: int = 1024  # its longest prompt, for tools/memory_plan.py: see docs/tasks.md, "Prompt lengths"
    held_out_only: bool = False  # a benchmark (--eval-tasks): every row of its hub split or file is held out

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
        """Examples of `split` ("train" or "test"), shuffled by `seed`, at most `limit`; DataError when offline.

        `demos`: the reward uses sim, so a task whose rows have no demonstrations (countdown) joins them from its
        `demos` dataset, or from `demo_file` (--demo-file), leaving out the puzzles that have none (departure 3).
        """
        data.check_load(self, split, data_file, demos, demo_file)
        if self.generate is not None:  # departure 5: a train stream of 5000, each held-out problem once
            default = 5000 if split == "train" else 500
            return self.generate(split, default if limit is None else limit, seed)
        return data.load_rows(self, split, data_file, limit=limit, seed=seed, demos=demos, demo_file=demo_file)

    def reward(self, completion: str, example: Example, kind: str = "exact", **lengths) -> float:
        """One reward term of a completion: "exact" (the verifier), "sim" (B.5) or any rewards.REWARD_TERMS'.
        Of `lengths` (rollout.score and eval.py pass rewards.declared_lengths'), a term gets those it declares
        (DAPO's overlong one), so a length-aware term needs no edit in either command."""
        if kind == "exact":
            if not self.has_verifier:
                raise ValueError(f"{self.name} has no verifier: use --reward sim")
            return safe_reward(self.verifier)(completion, example)  # in [0, 1]; an exception scores 0
        if kind == "sim" and not example.reference:
            joined = "load the task with demos=True (train.py and eval.py do for sim), or " if self.demos else ""
            raise DataError(f"{self.name} example {example.uid} has no demonstration for --reward sim: {joined}pass "
                            "--data-file with a 'reference' column")
        if kind in REWARD_TERMS:
            term = REWARD_TERMS[kind]
            wanted = declared_lengths(kind, **lengths)
            term = wraps(term)(partial(term, **wanted)) if wanted else term
            return safe_reward(term)(completion, example)  # in [0, 1]; an exception scores 0
        raise ValueError(f"unknown reward kind {kind!r}: use one of {', '.join(('exact', *REWARD_TERMS))}")

    def extract(self, completion: str) -> str:
        """The answer the verifier looks at (for eval output), at most 500 characters."""
        return self.answer(completion)[:500]


# A new task is one more entry here. `verifier(completion, example)` scores a completion (0 or 1);
# `answer(completion)` is what eval.py reports as the extracted answer. The functions named in a lambda are below.
TASKS: dict[str, Task] = {task.name: task for task in [
    Task(name="gsm8k", hub_id="openai/gsm8k", hub_config="main", hub_test_split="test",
         columns=("question", "answer"), key=("question",), make_example=lambda row: _gsm8k(row),
         verifier=lambda completion, ex: math_reward(completion, ex.gold), answer=lambda text: _boxed_or_answer(text)),
    Task(name="countdown", hub_id="Jiayi-Pan/Countdown-Tasks-3to4",
         columns=("nums", "target"), key=("nums", "target"), make_example=lambda row: _countdown(row),
         verifier=lambda completion, ex: countdown_reward(completion, ex.meta["numbers"], ex.meta["target"]),
         answer=countdown_expression,
         demos=Demonstrations(hub_id="HuggingFaceTB/Countdown-Task-GOLD", hub_config="verified_Qwen2.5-7B-Instruct",
                              columns=("nums", "target", "messages"), read=lambda row: _gold_demonstration(row),
                              puzzle=lambda row: _countdown_puzzle(row))),
    Task(name="deepmath", hub_id="zwhe99/DeepMath-103K",
         columns=("question", "final_answer", "r1_solution_1", "r1_solution_2", "r1_solution_3"),
         may_be_empty=("r1_solution_1", "r1_solution_2", "r1_solution_3"), key=("question",),
         make_example=lambda row: _deepmath(row),
         verifier=lambda completion, ex: math_reward(completion, ex.gold), answer=lambda text: _boxed_or_answer(text)),
    Task(name="poetry", hub_id="jnb666/poems", columns=("instruction", "poem"),
         key=("instruction",), make_example=lambda row: _poetry(row),
         hint=". jnb666/poems holds poems only; the paper wrote an instruction for each poem "
              "with an LLM: pass them with --data-file (columns instruction, poem)"),
    Task(name="meetingbank", hub_id="microsoft/MeetingBank-LLMCompressed",
         columns=("prompt", "compressed_prompt"), key=("prompt",), make_example=lambda row: _meetingbank(row),
         prompt_tokens=2048),  # whole transcripts: as the official 512-prompt openthoughts.yaml
    Task(name="openthoughts", hub_id="open-thoughts/OpenThoughts3-1.2M", columns=("conversations",),
         key=("conversations",), key_text=lambda row: _openthoughts_turns(row["conversations"])[0],
         make_example=lambda row: _openthoughts(row), prompt_tokens=2048),  # the official openthoughts.yaml
    Task(name="arith", generate=lambda split, limit, seed: _arith(split, limit, seed),
         verifier=lambda completion, ex: integer_reward(completion, ex.gold), answer=integer_answer,
         prompt_tokens=40),
    Task(name="countdown24", generate=lambda split, limit, seed: _countdown24(split, limit, seed),
         verifier=lambda completion, ex: countdown_reward(completion, ex.meta["numbers"], ex.meta["target"]),
         answer=countdown_expression, prompt_tokens=120),
    # benchmarks scored by train.py --eval-tasks and eval.py, never trained on (docs/eval.md says why these ids)
    Task(name="math500", hub_id="HuggingFaceH4/MATH-500", hub_test_split="test", held_out_only=True,
         columns=("problem", "answer"), key=("problem",), make_example=lambda row: _benchmark(row),
         verifier=lambda completion, ex: math_reward(completion, ex.gold), answer=lambda text: _boxed_or_answer(text)),
    Task(name="aime24", hub_id="HuggingFaceH4/aime_2024", hub_test_split="train", held_out_only=True,
         columns=("problem", "answer"), key=("problem",), make_example=lambda row: _benchmark(row),
         verifier=lambda completion, ex: math_reward(completion, ex.gold), answer=lambda text: _boxed_or_answer(text)),
    Task(name="aime25", hub_id="MathArena/aime_2025", hub_test_split="train", held_out_only=True,
         columns=("problem", "answer"), key=("problem",), make_example=lambda row: _benchmark(row),
         verifier=lambda completion, ex: math_reward(completion, ex.gold), answer=lambda text: _boxed_or_answer(text)),
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
    no_exact = f"task {task.name} has no verifier, so no exact term: choose from {', '.join(valid[1:])}"
    weights = parse_weights(  # rewards are float32 tensors: 1e39 would be inf, and inf x 0 NaN
        text, "--reward-weights", valid if task.has_verifier else valid[1:], limit=3.4028234663852886e38,
        not_a_pair=lambda piece: f"{piece!r} is not TERM=WEIGHT (e.g. format=0.35,sim=0.65)",
        not_finite=lambda term, value: f"the weight of {term} must be a finite number, not {value!r}",
        over_limit=" (rewards are float32: at most 3.4e38)",
        unknown=lambda term: no_exact if term == "exact" else f"unknown term {term!r}: choose from {', '.join(valid)}")
    if not weights:
        raise ValueError(f"--reward-weights {text!r} names no term: give TERM=WEIGHT, e.g. format=0.35,sim=0.65")
    if not any(weights.values()):
        raise ValueError("--reward-weights: every weight is 0, so every reward would be 0")
    return weights


@dataclass
class Example:
    prompt: list[dict]  # chat messages [{"role": ..., "content": ...}]
    gold: str | None  # verifier answer (None when the task has no verifier)
    reference: str  # demonstration for the similarity reward ("" when none)
    meta: dict = field(default_factory=dict)  # task extras, JSON-serialisable
    uid: str = ""  # stable id: task name + hash of the prompt (+ "#pass" for repeated problems)
    source: str = ""  # where its row is, "rows.jsonl line 3", for errors about it ("" when generated)


# ---------------------------------------------------------------- prompts, and the row readers TASKS names
FORMAT_RULE = ("First think through the task inside <think> </think> tags, "
               "then give your answer after </think>.")  # departure 1
SYSTEM = "You are a helpful assistant. " + FORMAT_RULE
POETRY_SYSTEM = "You are a helpful assistant that writes poetry. " + FORMAT_RULE
BOXED = "Please reason step by step, and put your final answer within \\boxed{}."


def _chat(user: str, system: str | None = SYSTEM) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]


def _boxed_or_answer(completion: str) -> str:
    answer = final_answer(completion)
    boxed = last_boxed(answer)
    return answer if boxed is None else boxed


def _gsm8k(row: dict) -> Example:
    if "####" not in str(row["answer"]):
        raise ValueError("its answer has no final '#### N'")
    reasoning, _, answer = str(row["answer"]).rpartition("####")
    gold = answer.strip()
    if not re.fullmatch(r"-?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?", gold):  # "1,5": 15, or 1.5?
        raise ValueError(f"its final answer '#### {gold}' is not one number (a comma may only group thousands, "
                         "as in 1,500)")
    gold = gold.replace(",", "")  # as math_reward reads a gold (plumbing/boxes.py: plain_number)
    reasoning = re.sub(r"<<[^>]*>>", "", reasoning).strip()  # drop calculator notes "<<48/2=24>>"
    return Example(_chat(f"{row['question']}\n{BOXED}"), gold, f"{reasoning}\nThe answer is \\boxed{{{gold}}}.")


def _countdown(row: dict) -> Example:
    numbers, target = data.integers(row["nums"], "nums"), data.integer(row["target"], "target")  # 24.5: refused
    user = (f"Using the numbers {numbers}, write an arithmetic expression that equals {target}. "
            "Use each number exactly once, with only +, -, *, / and parentheses.")
    return Example(_chat(user), str(target), "", {"numbers": numbers, "target": target})


def _deepmath(row: dict) -> Example:
    solutions = [str(row[f"r1_solution_{i}"]) for i in (1, 2, 3) if row.get(f"r1_solution_{i}")]
    shortest = min(solutions, key=len) if solutions else ""  # Appendix B.3: shortest of three
    return Example(_chat(f"{row['question']}\n{BOXED}"), str(row["final_answer"]).strip(), final_answer(shortest))


def _poetry(row: dict) -> Example:
    return Example(_chat(str(row["instruction"]), POETRY_SYSTEM), None, str(row["poem"]))


def _meetingbank(row: dict) -> Example:
    user = f"Summarize this city council meeting transcript concisely and informatively.\n\n{row['prompt']}"
    return Example(_chat(user), None, str(row["compressed_prompt"]))


def _countdown_puzzle(row: dict) -> tuple:
    """What joins a Countdown puzzle to its demonstration: the numbers sorted (their order does not change which
    expressions solve it) and the target."""
    return tuple(sorted(data.integers(row["nums"], "nums"))), data.integer(row["target"], "target")


# ---------------------------------------------------------------- more row readers TASKS names
def _openthoughts(row: dict) -> Example:
    question, response = _openthoughts_turns(row["conversations"])
    if not question.strip():
        raise ValueError("its human turn is empty")
    reference = final_answer(response)  # the similarity reward compares answers: the thinking is removed
    if not reference:
        raise ValueError("its gpt turn has no answer (it is empty, or its <think> never closes)")
    return Example(_chat(question), None, reference)


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


def _benchmark(row: dict) -> Example:
    """A MATH500 or AIME row: the problem with the boxed-answer instruction, its answer for math-verify."""
    return Example(_chat(f"{row['problem']}\n{BOXED}"), str(row["answer"]).strip(), "")


# ---------------------------------------------------------------- procedural tasks (departures 2 and 5)
ARITH_MAX, ARITH_TEST = 16, 64  # operands 0..15; 64 of the 256 problems held out


def _arith(split: str, limit: int, seed: int) -> list[Example]:
    problems = sorted(((a, b) for a in range(ARITH_MAX) for b in range(ARITH_MAX)),
                      key=lambda ab: digest("arith", *ab))
    problems = problems[:ARITH_TEST] if split == "test" else problems[ARITH_TEST:]  # disjoint by problem
    return [Example(_chat(f"What is {a} + {b}?", system=None), str(a + b), f"{a} + {b} = {a + b}",
                    {"a": a, "b": b}, f"arith-{a}+{b}#{p}")
            for (a, b), p in itertools.islice(seeded_passes(problems, seed, split == "train"), limit)]


def _countdown24(split: str, limit: int, seed: int) -> list[Example]:
    quads = [q for q in itertools.combinations_with_replacement(range(1, 14), 4)
             if in_test(digest("countdown24", *q)) == (split == "test")]  # disjoint by multiset
    rng, out = random.Random(seed + 1), []
    for quad, p in seeded_passes(quads, seed, repeat=split == "train"):
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


@cache
def solve_countdown(numbers: tuple[int, ...], target: int = 24) -> str | None:
    """An expression using each number once that equals `target` exactly, or None (brute force: the first that
    countdown_reward accepts)."""
    return search_expression([(float(n), str(n)) for n in numbers], list(numbers), target, accept=countdown_reward)
