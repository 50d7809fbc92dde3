"""Tasks (Section 5.1, Appendix B.3): dataset rows into `Example`s and a completion's reward (docs/tasks.md).

python -m pytest tests/test_tasks.py -q
"""

import functools
import hashlib
import itertools
import math
import os
import random
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import rewards
from plumbing.cli import choose, first_line, parse_weights
from plumbing.data import DataError, read_rows, records, rows_revision, where
from plumbing.models import ModelLoadError
from rewards import REWARD_TERMS, countdown_reward, final_answer, math_reward


@dataclass
class Example:
    prompt: list[dict]
    gold: str | None
    reference: str  # demonstration for sim
    meta: dict = field(default_factory=dict)
    uid: str = ""  # task name + prompt hash
    source: str = ""  # "FILE line 3"
    revision: str = ""  # its file's sha256 or its hub dataset's commit


@dataclass(kw_only=True)
class Task:
    """A hub-backed (hub_id, columns, make_example) or procedural (generate) task; `columns`: {name: type}, the
    row gate's (plumbing/data.py: check_rows), where a type that admits None makes the column optional."""

    name: str
    hub_id: str | None = None
    columns: dict[str, type] = field(default_factory=dict)
    key: tuple[str, ...] = ()  # the columns that identify a prompt; (): the first column
    key_text: Callable[[dict], list] = dict.values  # the texts of a prompt's key that its digest hashes
    make_example: Callable[[dict], Example] | None = None
    verifier: Callable[[str, Example], float] | None = None
    answer: Callable[[str], str] = final_answer
    hub_config: str | None = None
    hub_test_split: str | None = None  # None: held out by prompt hash
    generate: Callable[[str, int, int], list[Example]] | None = None
    hint: str = ""
    # sim's demonstrations from another dataset (departure 3): ({puzzle: demonstration}, source) of a --demo-file
    # or None (the hub's), joined to each row by the puzzle of its key
    demos: Callable[[str | None], tuple[dict[tuple, str], str]] | None = None
    puzzle: Callable[[dict], tuple] | None = None
    prompt_tokens: int = 1024  # for tools/memory_plan.py
    held_out_only: bool = False  # a benchmark: never trained on
    decontaminate: tuple[str, ...] = ()  # held-out sets whose prompts training drops (load_data)

    def __post_init__(self):
        self.key = self.key or tuple(self.columns)[:1]  # most tasks' prompt is their first column

    @property
    def has_verifier(self) -> bool:
        return self.verifier is not None

    def load(
        self,
        split: str = "train",
        *,
        data_file: str | None = None,
        limit: int | None = None,
        seed: int = 0,
        demos: bool = False,
        demo_file: str | None = None,
    ) -> list[Example]:
        """Shuffled examples of `split`: rows split by key hash (departure 4), joined to demonstrations for sim
        (`demos`), shuffled, cut, made examples. DataError for bad data. The doors (config.py: check_args, eval.py:
        main) refuse a --demo-file it would not read and a benchmark's train split."""
        if self.generate is not None:
            if data_file:
                raise DataError(f"{self.name} is generated procedurally and takes no --data-file")
            default = 5000 if split == "train" else 500  # departure 5
            return self.generate(split, default if limit is None else limit, seed)
        path = data_file.replace("{split}", split) if data_file else None
        hub_split = (split == "test" and self.hub_test_split) or "train"  # no test split: the hash holds out
        hub = self.hub_id and (self.hub_id, self.hub_config, hub_split)
        columns = {**self.columns, "reference": str | None}  # a file may bring its own demonstrations
        rows, lines, source = read_rows(path, "--data-file", hub, columns, self.name, self.hint)
        if data_file:
            whole = path != data_file or self.held_out_only  # a {split} file is its split; a benchmark is held out
        else:
            whole = self.hub_test_split is not None  # the hub's own test split holds out, not the hash
        what = f"{self.name} example"
        keys = records(rows, self.key)
        digests = _each(lambda key: digest(*self.key_text(key)), enumerate(keys), lines, source, what)
        earlier = Counter()  # a repeated prompt gets #1, #2, ...: every uid names one row
        uids = []
        for row_digest in digests:
            uids.append(f"{self.name}-{row_digest[:12]}" + (f"#{earlier[row_digest]}" if earlier[row_digest] else ""))
            earlier[row_digest] += 1
        # departure 4: without a test split, ~10% held out by prompt hash: the same rows on every run, rank and copy
        keep = [i for i, row_digest in enumerate(digests) if whole or in_test(row_digest) == (split == "test")]
        join = demos and self.demos is not None and "reference" not in rows.column_names
        if join:  # before the limit: --eval-examples counts rows that have a demonstration
            references, demo_source = self.demos(demo_file)
            puzzles = _each(self.puzzle, enumerate(keys), lines, source, what)
            joined = [i for i in keep if puzzles[i] in references]
            if keep and not joined:
                raise DataError(
                    f"none of the {len(keep)} {self.name} {split} puzzles of {source} has a demonstration "
                    f"in {demo_source} (joined by target and sorted numbers): pass --demo-file FILE "
                    "with theirs"
                )
            if len(joined) < len(keep):
                _note(
                    f"{len(keep) - len(joined)} of {len(keep)} {self.name} {split} puzzles have no "
                    f"demonstration in {demo_source}: left out"
                )
            keep = joined
        random.Random(seed).shuffle(keep)
        keep = keep[:limit]  # None: every row
        chosen = rows.select(keep)  # only the rows kept become examples: a bad row outside them is never read
        made = _each(lambda row: (self.make_example(row), row.get("reference")), zip(keep, chosen), lines, source, what)
        revision = rows_revision(path, rows)
        golds = {}  # {prompt digest: its golds}
        for i, (example, own) in zip(keep, made):
            golds.setdefault(digests[i], set()).add(example.gold)
            reference = own or (references[puzzles[i]] if join else example.reference)  # a file's own wins
            example.reference = str(reference)
            example.uid = uids[i]
            example.source = f"{source} {where(lines, i)}"
            example.revision = revision
            if demos and not example.reference.strip():  # sim would score every completion against ""
                raise DataError(
                    f"{source}: {where(lines, i)} has no demonstration for the similarity reward (its 'reference' "
                    f"is empty or absent, and the {self.name} row gives none); every row needs one for --reward sim"
                )
        clash = sum(len(each) > 1 for each in golds.values())
        if clash:
            _note(
                f"{clash} {self.name} {split} prompt(s) of {source} have two or more different golds; each copy "
                "trains on its own"
            )
        return [example for example, _ in made]

    def reward(self, completion: str, example: Example, kind: str = "exact", **lengths) -> float:
        """One reward term in [0, 1]: "exact" (the verifier) or a REWARD_TERMS key; reward_weights, the door,
        refuses "exact" for a task with no verifier."""
        term = self.verifier if kind == "exact" else REWARD_TERMS[kind]
        return rewards.safe_reward(term)(completion, example, **lengths)

    def extract(self, completion: str) -> str:
        """The answer the verifier sees, cut to 500 characters."""
        return self.answer(completion)[:500]


def _note(text: str) -> None:
    if os.environ.get("RANK", "0") == "0":  # Task.load runs on every rank: one note a run, not one a rank
        print(f"note: {text}", flush=True)


FORMAT_RULE = (
    "First think through the task inside <think> </think> tags, then give your answer after </think>."  # departure 1
)
SYSTEM = "You are a helpful assistant. " + FORMAT_RULE
POETRY_SYSTEM = "You are a helpful assistant that writes poetry. " + FORMAT_RULE
BOXED = "Please reason step by step, and put your final answer within \\boxed{}."


def _chat(user: str, system: str | None = SYSTEM) -> list[dict]:
    turn = {"role": "user", "content": user}
    if not system:
        return [turn]
    return [{"role": "system", "content": system}, turn]


def _boxed_or_answer(completion: str) -> str:
    boxed = rewards.last_boxed(answer := final_answer(completion))
    return answer if boxed is None else boxed


def _math_verifier(completion: str, example: Example) -> float:
    return math_reward(completion, example.gold)


def _countdown_verifier(completion: str, example: Example) -> float:
    return countdown_reward(completion, example.meta["numbers"], example.meta["target"])


def _gsm8k(row: dict) -> Example:
    reasoning, marked, answer = str(row["answer"]).rpartition("####")
    if not marked:
        raise ValueError("its answer has no final '#### N'")
    gold = rewards.math_text(answer)  # as every math gold and boxed prediction: "1,500 dollars" is 1500
    if not re.fullmatch(r"-?[0-9]+(?:\.[0-9]+)?", gold):
        raise ValueError(f"its final answer '#### {answer.strip()}' is not one number")
    reasoning = re.sub(r"<<[^>]*>>", "", reasoning).strip()  # calculator notes
    return Example(_chat(f"{row['question']}\n{BOXED}"), gold, f"{reasoning}\nThe answer is \\boxed{{{gold}}}.")


def _countdown(row: dict) -> Example:
    numbers = [int(n) for n in row["nums"]]  # the gate took 3.0 as an int
    target = int(row["target"])
    user = (
        f"Using the numbers {numbers}, write an arithmetic expression that equals {target}. "
        "Use each number exactly once, with only +, -, *, / and parentheses."
    )
    return Example(_chat(user), str(target), "", {"numbers": numbers, "target": target})


def _countdown_puzzle(row: dict) -> tuple:
    """(sorted numbers, target): joins a Countdown puzzle to its demonstration."""
    return tuple(sorted(int(n) for n in row["nums"])), int(row["target"])


def _gold_demonstration(row: dict) -> tuple[tuple, str]:
    """(puzzle, last assistant answer) of a Countdown-Task-GOLD row."""
    said = [turn.get("content") for turn in row["messages"] if turn.get("role") == "assistant"]
    if not said:
        raise ValueError("its messages have no assistant turn")
    if not (reference := final_answer(str(said[-1] or ""))):
        raise ValueError("its assistant turn has no answer after its thinking")
    return _countdown_puzzle(row), reference


def _countdown_gold(demo_file: str | None) -> tuple[dict[tuple, str], str]:
    """({puzzle: shortest demonstration}, source) of `demo_file`, else of the hub's Countdown-Task-GOLD."""
    hub = ("HuggingFaceTB/Countdown-Task-GOLD", "verified_Qwen2.5-7B-Instruct", "train")
    columns = {"nums": list[int], "target": int, "messages": list[dict]}
    what = "countdown demonstration"
    rows, lines, source = read_rows(demo_file, "--demo-file", hub, columns, f"a {what}")
    pairs = _each(_gold_demonstration, enumerate(records(rows, columns)), lines, source, what)
    references = {}
    for puzzle, reference in sorted(pairs, key=lambda pair: len(pair[1])):  # stable: the first of the shortest
        references.setdefault(puzzle, reference)
    return references, source


def _deepmath(row: dict) -> Example:
    solutions = [str(row[f"r1_solution_{i}"]) for i in (1, 2, 3) if row.get(f"r1_solution_{i}")]
    shortest = min(solutions, key=len, default="")  # Appendix B.3: shortest of three
    return Example(_chat(f"{row['question']}\n{BOXED}"), str(row["final_answer"]).strip(), final_answer(shortest))


def _openthoughts(row: dict) -> Example:
    question, response = _openthoughts_turns(row["conversations"])
    if not question.strip():
        raise ValueError("its human turn is empty")
    if not (reference := final_answer(response)):
        raise ValueError("its gpt turn has no answer (it is empty, or its <think> never closes)")
    return Example(_chat(question), None, reference)


def _openthoughts_turns(conversation) -> tuple[str, str]:
    """(first human turn, next gpt turn) of an OpenThoughts3 conversation (a list[dict], by the row gate)."""
    speakers = [turn.get("from") for turn in conversation]
    if "human" not in speakers:
        raise ValueError("its conversations has no human turn")
    asked = speakers.index("human")
    if "gpt" not in speakers[asked:]:
        raise ValueError("its conversations has no gpt turn after the human one")
    values = [conversation[i].get("value") for i in (asked, speakers.index("gpt", asked))]
    return tuple(str(value or "") for value in values)


ARITH_MAX, ARITH_TEST = 16, 64  # departures 2, 5


def seeded_passes(items: list, seed: int, repeat: bool):
    """(item, pass) over seeded shuffles of `items`, forever when `repeat`."""
    rng = random.Random(seed)
    for pass_index in itertools.count():
        order = list(items)
        rng.shuffle(order)
        for item in order:
            yield item, pass_index
        if not repeat:
            return


CALC_NOTE = "You may use a calculator: write <calc>EXPRESSION</calc>, and its value follows as <result>VALUE</result>."


def _arith(split: str, limit: int, seed: int, note: str = "") -> list[Example]:
    """a + b for a, b < ARITH_MAX; `note` follows the question (arith-calc's announces rollout.TOOLS' calc)."""
    pairs = itertools.product(range(ARITH_MAX), repeat=2)
    problems = sorted(pairs, key=lambda ab: digest("arith", *ab))
    problems = problems[:ARITH_TEST] if split == "test" else problems[ARITH_TEST:]
    examples = []
    for (a, b), p in itertools.islice(seeded_passes(problems, seed, split == "train"), limit):
        prompt = _chat(f"What is {a} + {b}?{note}", system=None)
        examples.append(Example(prompt, str(a + b), f"{a} + {b} = {a + b}", {"a": a, "b": b}, f"arith-{a}+{b}#{p}"))
    return examples


def _countdown24(split: str, limit: int, seed: int) -> list[Example]:
    quads = [
        q
        for q in itertools.combinations_with_replacement(range(1, 14), 4)
        if in_test(digest("countdown24", *q)) == (split == "test")
    ]
    rng, out = random.Random(seed + 1), []
    for quad, p in seeded_passes(quads, seed, repeat=split == "train"):
        if len(out) >= limit:
            break
        if (solution := solve_countdown(quad)) is None:
            continue
        example = _countdown(dict(nums=rng.sample(quad, 4), target=24))
        example.reference = solution
        example.uid = f"countdown24-{'-'.join(map(str, quad))}#{p}"
        out.append(example)
    return out


@functools.cache
def solve_countdown(numbers: tuple[int, ...], target: int = 24) -> str | None:
    """An expression of the numbers, each once, equal to `target`, or None."""
    return _search([(float(n), str(n)) for n in numbers], target)


def _search(items: list[tuple[float, str]], target: int) -> str | None:
    if len(items) == 1:
        value, expr = items[0]
        expr = expr[1:-1] if expr.startswith("(") else expr
        # exact here: any other value p/q that four integers up to 13 make is at least 1/q, far over 1e-6, away
        return expr if abs(value - target) < 1e-6 else None
    for i, j in itertools.combinations(range(len(items)), 2):
        (a, left), (b, right) = items[i], items[j]
        rest = [item for k, item in enumerate(items) if k not in (i, j)]
        options = [
            (a + b, f"({left} + {right})"),
            (a * b, f"({left} * {right})"),
            (a - b, f"({left} - {right})"),
            (b - a, f"({right} - {left})"),
        ]
        if b:
            options.append((a / b, f"({left} / {right})"))
        if a:
            options.append((b / a, f"({right} / {left})"))
        for option in options:
            if found := _search(rest + [option], target):
                return found
    return None


def _poem(row: dict) -> Example:
    return Example(_chat(str(row["instruction"]), POETRY_SYSTEM), None, str(row["poem"]))


def _meeting(row: dict) -> Example:
    user = f"Summarize this city council meeting transcript concisely and informatively.\n\n{row['prompt']}"
    return Example(_chat(user), None, str(row["compressed_prompt"]))  # whole transcripts


def _polaris(row: dict) -> Example:
    user = f"{str(row['problem']).strip()}\n{BOXED}"
    return Example(_chat(user, system=None), str(row["answer"]).strip(), "")  # no system message, as official


def _benchmark(row: dict) -> Example:
    return Example(_chat(f"{row['problem']}\n{BOXED}"), str(row["answer"]).strip(), "")


MATH = dict(verifier=_math_verifier, answer=_boxed_or_answer)  # math-verify scores a boxed or final answer
COUNTDOWN = dict(verifier=_countdown_verifier, answer=rewards.countdown_expression)
ARITH = dict(verifier=lambda completion, ex: rewards.integer_reward(completion, ex.gold), answer=rewards.integer_answer)
PROBLEMS = {"problem": str, "answer": str | int | float}
DEEPMATH = {
    "question": str,
    "final_answer": str | int | float,
    **dict.fromkeys(("r1_solution_1", "r1_solution_2", "r1_solution_3"), str | None),
}
POEMS_HINT = (
    ". jnb666/poems holds poems only; the paper wrote an instruction for each poem with an LLM: pass "
    "them with --data-file (columns instruction, poem)"
)

BUILT_IN = [
    Task(
        name="gsm8k",
        hub_id="openai/gsm8k",
        hub_config="main",
        hub_test_split="test",
        columns={"question": str, "answer": str},
        make_example=_gsm8k,
        **MATH,
    ),
    Task(
        name="countdown",
        hub_id="Jiayi-Pan/Countdown-Tasks-3to4",
        columns={"nums": list[int], "target": int},
        key=("nums", "target"),
        make_example=_countdown,
        **COUNTDOWN,
        demos=_countdown_gold,
        puzzle=_countdown_puzzle,
    ),
    Task(name="deepmath", hub_id="zwhe99/DeepMath-103K", columns=DEEPMATH, make_example=_deepmath, **MATH),
    Task(
        name="poetry",
        hub_id="jnb666/poems",
        columns={"instruction": str, "poem": str},
        make_example=_poem,
        hint=POEMS_HINT,
    ),
    Task(
        name="meetingbank",
        hub_id="microsoft/MeetingBank-LLMCompressed",
        prompt_tokens=2048,
        columns={"prompt": str, "compressed_prompt": str},
        make_example=_meeting,
    ),
    Task(
        name="openthoughts",
        hub_id="open-thoughts/OpenThoughts3-1.2M",
        columns={"conversations": list[dict]},
        key_text=lambda row: _openthoughts_turns(row["conversations"])[:1],  # the question, not its answer
        make_example=_openthoughts,
        prompt_tokens=2048,
    ),
    Task(
        name="arith",
        generate=_arith,
        **ARITH,
        prompt_tokens=40,
    ),
    Task(
        name="arith-calc",  # arith with a calculator: train.py --task arith-calc samples with --rollout tools
        generate=functools.partial(_arith, note=" " + CALC_NOTE),
        **ARITH,
        prompt_tokens=70,
    ),
    Task(
        name="countdown24",
        generate=_countdown24,
        **COUNTDOWN,
        prompt_tokens=120,
    ),
    Task(
        name="polaris",
        hub_id="POLARIS-Project/Polaris-Dataset-53K",
        columns=PROBLEMS,
        decontaminate=("aime25", "math500"),
        make_example=_polaris,
        **MATH,
    ),
]
# held-out benchmarks (docs/eval.md)
BENCHMARKS = [
    ("math500", "HuggingFaceH4/MATH-500", "test"),
    ("aime24", "HuggingFaceH4/aime_2024", "train"),
    ("aime25", "MathArena/aime_2025", "train"),
]
BUILT_IN += [
    Task(
        name=name,
        hub_id=hub_id,
        hub_test_split=split,
        held_out_only=True,
        columns=PROBLEMS,
        make_example=_benchmark,
        **MATH,
    )
    for name, hub_id, split in BENCHMARKS
]
TASKS: dict[str, Task] = {task.name: task for task in BUILT_IN}  # a fork adds TASKS["name"] = Task(...) below


def get_task(name: str) -> Task:
    return choose(TASKS, name, "task")


def reward_weights(task: Task, reward: str, text: str) -> dict[str, float]:
    """{term: weight} of --reward-weights, else {reward: 1.0}; r = sum_k w_k r_k. The one check of both flags."""
    flag = f"--reward {reward}"
    weights = {reward: 1.0}
    if text.strip():
        flag = "--reward-weights"
        form = "TERM=WEIGHT (e.g. format=0.35,sim=0.65)"
        weights = parse_weights(text, flag, ("exact", *REWARD_TERMS), form, limit=3.4028234663852886e38)  # float32 max
    if "exact" in weights and not task.has_verifier:
        raise ValueError(
            f"{flag}: task {task.name} has no verifier, so no exact term: use --reward sim, or terms of "
            f"{', '.join(REWARD_TERMS)}"
        )
    if not any(weights.values()):
        raise ValueError(f"--reward-weights {text!r}: no term has a nonzero weight, so every reward would be 0")
    return weights


def digest(*parts) -> str:
    # joined by the unit separator, which no text holds: ("a b", "c") and ("a", "b c") hash apart
    return hashlib.sha1("\x1f".join(str(part) for part in parts).encode()).hexdigest()


def in_test(digest: str) -> bool:
    return int(digest[:8], 16) % 100 < 10  # the held-out share when a dataset has no test split


def _each(read: Callable, numbered, lines, source: str, what: str) -> list:
    """read(row) of each (row number, row); DataError naming the first refused."""
    out = []
    for i, row in numbered:
        try:
            out.append(read(row))
        except Exception as err:  # any error in a row's reader is the data's: one line naming the row, no traceback
            raise DataError(
                f"{source}: {where(lines, i)} is not a valid {what} ({first_line(err, typed=True)})"
            ) from None
    return out


def parse_eval_tasks(text: str, registry: dict) -> dict[str, str | None]:
    """{task name: file or None} of --eval-tasks "NAME[=FILE],..."."""
    sets = {}
    for piece in filter(str.strip, text.split(",")):
        name, equals, path = map(str.strip, piece.partition("="))
        if name not in registry:
            raise ValueError(f"--eval-tasks: unknown task {name!r}: choose from {', '.join(registry)}")
        if equals and not os.path.isfile(path):
            raise ValueError(f"--eval-tasks: {name}'s file {path!r} does not exist")
        if name in sets:
            raise ValueError(f"--eval-tasks: {name} is given twice")
        sets[name] = path if equals else None
    return sets


def load_data(args, task: Task, weights: dict, master: bool = True) -> tuple[list[Example], list[Example], dict]:
    """(train rows, at most --eval-examples held-out rows, {set name: (task, rows)}: those rows, then each
    --eval-tasks set); every set is read once."""
    demos = dict(demos=True, demo_file=args.demo_file) if "sim" in weights else {}
    train_set = task.load("train", data_file=args.data_file, seed=args.seed, **demos)
    test_set = []
    if args.eval_examples:
        test_demos = {} if task.has_verifier else demos  # a verifier scores them: sim needs no demonstrations
        test_set = task.load("test", data_file=args.data_file, limit=args.eval_examples, seed=args.seed, **test_demos)
    if not train_set:
        raise DataError(f"--data-file {args.data_file}: every row falls in the held-out split (~10% by prompt hash)")
    named = parse_eval_tasks(args.eval_tasks, TASKS)
    if task.name in named and test_set:
        raise DataError(f"--eval-tasks: {task.name} is the task's own held-out set, scored already")
    decontaminate = getattr(task, "decontaminate", ())  # a fork's task need not subclass Task
    held = {}
    for name in dict.fromkeys([*decontaminate, *named]):
        limit = None if name in decontaminate else args.eval_examples  # read whole once: its first rows are scored
        held[name] = TASKS[name].load("test", data_file=named.get(name), limit=limit, seed=args.seed)
    if decontaminate:  # as the official prepare_data.py: no training prompt an eval set holds
        dropped = {_user_digest(ex) for name in decontaminate for ex in held[name]}
        kept = [ex for ex in train_set if _user_digest(ex) not in dropped]
        if master:
            print(f"note: dropped {len(train_set) - len(kept)} training prompt(s) in {'/'.join(decontaminate)}")
        train_set = kept
        if not train_set:
            raise DataError(f"every training prompt is in {'/'.join(decontaminate)}, which training must not see")
    if args.eval_examples and not test_set and master:
        print(
            f"note: --data-file {args.data_file} leaves no held-out rows (tasks.py holds out ~10% by prompt "
            "hash): no evaluation before, during (--eval-every) or after training, no eval.json"
        )
    eval_sets = {task.name: (task, test_set)} if test_set else {}
    trained = set()
    if named:
        trained = {_user_digest(ex) for ex in train_set}
    for name, path in named.items():
        rows = held[name][: args.eval_examples]
        if not rows:
            raise DataError(f"--eval-tasks: {name} has no held-out rows" + (f" in {path}" if path else ""))
        seen = sum(_user_digest(ex) in trained for ex in rows)  # a held-out score on trained prompts is no score
        if seen:
            raise DataError(
                f"--eval-tasks: {seen} of the {len(rows)} {name} prompts are training prompts too, so not held out"
            )
        eval_sets[name] = (TASKS[name], rows)
    return train_set, test_set, eval_sets


def _user_digest(example: Example) -> str:
    return digest(*example.prompt[-1]["content"].split())  # the user turn, spacing aside


def no_room_error(max_tokens: int, context: int | None) -> str | None:
    """The line for a --max-tokens that leaves a prompt no room in `context` (None: unknown), or None."""
    if context is not None and max_tokens >= context:
        return (
            f"--max-tokens {max_tokens:,} leaves no room for a prompt in the model's context of {context:,} "
            "tokens: pass a smaller --max-tokens"
        )


def encode_prompts(tokenizer, examples, max_tokens: int = 0, context: int | None = None) -> list[list[int]]:
    """Chat-template token ids of each prompt, ending with the assistant header, each leaving `max_tokens` of the
    model's `context` (None: unknown) to its completion; DataError for bad rows."""
    import jinja2  # transformers renders chat templates with it

    if error := no_room_error(max_tokens, context):
        raise DataError(error)
    if not tokenizer.chat_template:
        raise ModelLoadError("the tokenizer has no chat template; use an instruct/chat model")
    added = [token.content for token in tokenizer.added_tokens_decoder.values() if token.special]
    specials = sorted({*tokenizer.all_special_tokens, *added} - {""}, key=len, reverse=True)
    for i, ex in enumerate(examples):
        for message in ex.prompt:
            text = str(message["content"])
            found = [token for token in specials if token in text]
            if found:  # the chat template would turn it into a real turn marker
                raise DataError(
                    f"{_row_name(ex, i)}: its {message['role']} text holds the special token {found[0]!r}, "
                    "which the chat template would turn into a real turn marker; remove it from the data"
                )
    try:
        ids = [
            list(tokenizer.apply_chat_template(ex.prompt, add_generation_prompt=True, tokenize=True, return_dict=False))
            for ex in examples
        ]
    except jinja2.TemplateError as err:  # a template's own error, not ours, is the user's to fix
        raise ModelLoadError(
            f"the model's chat template cannot render a prompt ({first_line(err, typed=True)}); "
            "use a model whose tokenizer_config.json has a working chat_template"
        ) from None
    room = math.inf if context is None else context - max_tokens
    too_long = [i for i, p in enumerate(ids) if len(p) > room]
    if too_long:
        first = too_long[0]
        raise DataError(
            f"{_row_name(examples[first], first)}: its prompt is {len(ids[first])} tokens, more than the "
            f"{room} the model's context leaves beside --max-tokens ({len(too_long)} such rows)"
        )
    return ids


def _row_name(example: Example, i: int) -> str:
    source = example.source or f"row {i}"  # a generated example has no source
    return f"{source} ({example.uid})"
