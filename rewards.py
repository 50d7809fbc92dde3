"""Rewards (Section 5.1, Appendix B.3, B.5; departures: docs/rewards.md): any string -> [0, 1], model text never run.
An exception scores 0 and is counted (reward/errors), or raises with SOFTMAX_GRPO_STRICT_REWARDS=1 (the tests).

    python -m pytest tests/test_rewards.py -q
"""

import ast
import atexit
import functools
import inspect
import operator
import os
import re
import string
import sys
import threading
import traceback
from collections import Counter
from fractions import Fraction

from plumbing.cli import first_line, plain
from plumbing.math_worker import MathWorker


def safe_reward(fn):
    """Clip to [0, 1]; an exception scores 0 and is counted."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        try:
            return min(1.0, max(0.0, float(fn(*args, **kwargs))))
        except Exception:
            if STRICT:
                raise
            _count_error(
                f"{fn.__name__} raised and scored 0. Set SOFTMAX_GRPO_STRICT_REWARDS=1 to raise.\n"
                f"{traceback.format_exc()}"
            )
            return 0.0

    return wrapped


@safe_reward
def math_reward(completion, gold) -> float:
    """1.0 when the final answer equals `gold` under math-verify."""
    answer, gold = math_answer(completion), math_text(gold)
    if not answer or not gold or bracket_depth(answer) > MAX_DEPTH:
        return 0.0
    gold = gold if "\\boxed" in gold else "\\boxed{" + gold + "}"
    return _math_worker.verify(answer, gold)


@safe_reward
def countdown_reward(completion, numbers, target) -> float:
    """1.0 for an expression of + - * / ( ) using each of `numbers` once, = target (departure 3). `numbers` and
    `target` are ints: the data gate (tasks.py) refuses a row with others."""
    expr = countdown_expression(completion)
    if expr.count("=") == 1:
        expr, rhs = expr.split("=")
        # at most 12 digits: int() of a long digit string is slow, and past 4,300 digits it raises
        if not re.fullmatch(r"\s*-?[0-9]{1,12}\s*", rhs) or int(rhs) != target:
            return 0.0
    try:
        tree = arithmetic_tree(expr)
        used = [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)]  # ints: no . e j allowed
        if Counter(used) != Counter(numbers):
            return 0.0
        return float(_evaluate(tree.body) == target)  # exact rationals: 8 / (3 - 8 / 3) is 24, not 23.999...
    except (ValueError, SyntaxError, ZeroDivisionError):  # not plain arithmetic; not an expression; a division by 0
        return 0.0


@safe_reward
def integer_reward(completion, gold) -> float:
    """1.0 when integer_answer(completion) is the integer `gold` (arith, whose golds are generated integers)."""
    return float(integer_answer(completion) == integer_answer(gold))


@safe_reward
def similarity_reward(completion, reference) -> float:
    """r_sim = 0.6 * F1_SQuAD + 0.4 * ROUGE-L F1 against `reference` (Appendix B.5, departure 2)."""
    pred, ref = squad_words(final_answer(completion)), squad_words(reference)
    if not pred or not ref:
        return 0.0
    overlap = sum((Counter(pred) & Counter(ref)).values())
    lcs = lcs_length(pred[:MAX_WORDS], ref[:MAX_WORDS])
    return 0.6 * _f1(overlap, pred, ref) + 0.4 * _f1(lcs, pred, ref)  # Appendix B.5's weights


@safe_reward
def format_reward(completion) -> float:
    """1.0 for one leading non-empty <think>...</think> and a non-empty answer."""
    text = _text(completion)
    if text.count("<think>") != 1 or text.count("</think>") != 1:
        return 0.0
    before, _, rest = text.partition("<think>")
    thought, closed, _ = rest.partition("</think>")
    return float(all([closed, not before.strip(), thought.strip(), final_answer(text)]))


def overlong_reward(completion, example, *, n_tokens: int, max_tokens: int, overlong_buffer: int) -> float:
    """DAPO's soft overlong punishment (arXiv 2503.14476, Eq. 13) plus 1, so in [0, 1]."""
    return 1.0 + min(0.0, (max_tokens - overlong_buffer - n_tokens) / overlong_buffer)  # Eq. 13 + 1


# --reward-weights' terms besides "exact": (completion, example, and the options it declares), called through
# safe_reward; term_rewards scores rm a batch at a time
REWARD_TERMS = {
    "sim": lambda completion, example: similarity_reward(completion, example.reference),  # Appendix B.5
    "format": lambda completion, example: format_reward(completion),
    "overlong": overlong_reward,
    "rm": lambda completion, example, reward_model: reward_model([example.prompt], [completion])[0],
}


def reward_options(max_tokens: int, overlong_buffer: int = 0, reward_model: str = "") -> dict:
    """The options a reward term may declare, built here for train.py's rollouts and evaluations and eval.py alike:
    the run's lengths (overlong's; a buffer of 0 is DAPO's L_cache of L_max / 5) and --reward-model's model (rm's)."""
    options = dict(max_tokens=max_tokens, overlong_buffer=overlong_buffer or max(1, max_tokens // 5))
    if reward_model:
        options["reward_model"] = load_reward_model(reward_model)
    return options


def declared_lengths(kind: str, **options) -> dict:
    """The `options` that the term `kind` takes."""
    if kind not in REWARD_TERMS:  # "exact": a task's verifier takes no options
        return {}
    declared = inspect.signature(REWARD_TERMS[kind]).parameters  # once a call, not once an option
    return {k: v for k, v in options.items() if k in declared}


def term_rewards(task, term: str, examples: list, completions: list, options: dict) -> list[float]:
    """Term `term` of each (example, Completion), the one scorer of train.py and eval.py: rm a batch at a time, the
    others one by one through task.reward with the options they declare."""
    if term == "rm":
        return options["reward_model"]([ex.prompt for ex in examples], [c.text for c in completions])
    return [
        task.reward(c.text, example, kind=term, **declared_lengths(term, n_tokens=len(c.token_ids), **options))
        for example, c in zip(examples, completions)
    ]


REWARD_MODEL_BATCH = 16  # sequences a forward pass


class RewardModel:
    """--reward-model: an AutoModelForSequenceClassification folder with one label, whose score of a prompt's chat
    and its completion, squashed by a sigmoid, is the rm term in [0, 1]. Float32 on CPU, bf16 on a GPU."""

    def __init__(self, path: str):
        import torch
        from transformers import AutoModelForSequenceClassification

        from plumbing.models import ModelLoadError, _from_pretrained, load_tokenizer

        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
        self.tokenizer = load_tokenizer(path)
        if not self.tokenizer.chat_template:  # it reads a conversation as the policy's prompt was written
            raise ModelLoadError(f"--reward-model {path}: its tokenizer has no chat template to write a conversation")
        self.model = _from_pretrained(AutoModelForSequenceClassification, path, dtype=dtype)
        self.model = self.model.to(self.device).eval().requires_grad_(False)
        if self.model.config.pad_token_id is None:  # it finds each row's last token by the pad id
            self.model.config.pad_token_id = self.tokenizer.pad_token_id or self.tokenizer.eos_token_id

    def __call__(self, prompts: list[list[dict]], completions: list[str]) -> list[float]:
        import torch

        chats = [[*prompt, {"role": "assistant", "content": text}] for prompt, text in zip(prompts, completions)]
        texts = self.tokenizer.apply_chat_template(chats, tokenize=False)
        scores = []
        for start in range(0, len(texts), REWARD_MODEL_BATCH):
            chunk = texts[start : start + REWARD_MODEL_BATCH]
            inputs = self.tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.no_grad():
                logits = self.model(**inputs.to(self.device)).logits[:, 0]
            scores.extend(torch.sigmoid(logits.float()).tolist())
        return scores


load_reward_model = functools.cache(RewardModel)  # the reward model at a path, loaded once a process (a rank)


def reward_model_flag_error(path: str, weights: dict) -> str | None:
    """Why --reward-model and the terms `weights` disagree, as one line (train.py's and eval.py's), or None: the
    terms that declare `reward_model` (rm, a fork's) read it."""
    readers = [term for term in weights if declared_lengths(term, reward_model=path)]
    if path and not readers:
        return "--reward-model is read only by a term that scores with it: add rm=WEIGHT to --reward-weights"
    if readers and not path:
        return f"the {readers[0]} reward term scores with --reward-model PATH, which is not given"
    return None


def reward_model_error(path: str) -> str | None:
    """Why --reward-model `path` is no model the rm term can score with, as one line, or None."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as err:
        return f"--reward-model {path} is not a model folder ({first_line(err)})"
    kinds = config.architectures or ["no architecture"]
    if not kinds[0].endswith("ForSequenceClassification"):
        return f"--reward-model {path} is a {kinds[0]}, not an AutoModelForSequenceClassification"
    if config.num_labels != 1:
        return f"--reward-model {path} has {config.num_labels} labels: rm reads one score (num_labels=1)"
    return None


def final_answer(text) -> str:
    """Text after the last </think>, inside the last <answer>; "" for an unclosed <think>."""
    # the one normaliser every verifier reads through: fullwidth "\uff15" is 5, U+2212 a minus
    _, closed, text = plain(_text(text)).rpartition("</think>")
    if not closed and "<think>" in text:
        return ""  # departure 4
    if "<answer>" in text:
        text = text.rpartition("<answer>")[2].partition("</answer>")[0]
    return text.strip()


_UNIT_WORDS = re.compile(
    r"(?:\\(?:text|mbox|textrm)\{\s*)?(-?[0-9][0-9,]*(?:\.[0-9]+)?)"
    r"(?:\s+|\s*\}?\s*\\(?:text|mbox|textrm)\{\s*)[A-Za-z]{2,}(?:\s+[A-Za-z]+)*\.?\s*\}?"
)
_OPERATOR = r"(?:[-+*/^×÷·]|\\cdot|\\times|\\div)"
_OPERATOR_BEFORE = re.compile(rf"[0-9)}}]\s*{_OPERATOR}\s*$")  # a number ends an expression
_OPERATOR_AFTER = re.compile(rf"\s*{_OPERATOR}\s*[0-9A-Za-z({{\\]")  # a boxed number starts one
_NUMBER = re.compile(r"-?[0-9]+(?:[.,/][0-9]+)*(?:[eE][-+]?[0-9]+)?")


def math_answer(completion) -> str:
    """What math-verify judges: the last box run, a later "final answer is" line, else the tail (departure 4)."""
    answer = final_answer(completion)
    boxes, box_end = last_box_run(answer, limit=MAX_ANSWER_CHARS)
    stated = [match.start() for match in re.finditer(r"final answer is\b", answer, re.IGNORECASE)]
    if stated and stated[-1] > box_end:
        return answer[stated[-1] :].partition("\n")[0][:MAX_ANSWER_CHARS]
    if not boxes:
        return answer[-MAX_ANSWER_CHARS:]
    boxes = [math_text(box) for box in boxes]
    if sum(map(len, boxes)) > MAX_ANSWER_CHARS:
        boxes = boxes[-1:]
    return "\\boxed{" + ", ".join(boxes) + "}"


def integer_answer(text) -> str:
    """Last number of the last \\boxed{} (else of the answer), a whole one as digits ("1,234" -> "1234")."""
    answer = final_answer(text)
    boxed = last_boxed(answer)
    if boxed is not None and re.search(r"[0-9]\s*(?:;|\s,|,(?:\s|~|\\[ ,;:]))\s*-?[0-9]", boxed):
        return ""  # a boxed list, "[8, 0]", holds no one answer
    tail = answer if boxed is None else boxed
    tail = tail[-MAX_ANSWER_CHARS:]
    numbers = list(_NUMBER.finditer(tail))
    if not numbers:
        return ""
    last = numbers[-1]
    operand_end = last.start() + last[0].startswith("-")  # "3-2": the minus is an operator, not a sign
    # an expression is not its last number: "2\cdot 3" is no 3, "10^2" no 2
    if _OPERATOR_BEFORE.search(tail, 0, operand_end):
        return ""
    if boxed is not None and _OPERATOR_AFTER.match(tail, last.end()):
        return ""
    number = last[0]
    whole = re.fullmatch(r"-?[0-9]{1,3}(?:,[0-9]{3})+|-?[0-9]+(?:\.0+)?", number)
    return str(int(number.replace(",", "").split(".")[0])) if whole else number


def math_text(text) -> str:
    """The one normaliser of a math gold and a boxed prediction: U+2212 a minus, a unit word dropped ("72 dollars",
    "5\\text{ cm}"), commas as thousands ("7,425,000") or a decimal comma ("1,22")."""
    text = plain(_text(text)).strip()
    units = _UNIT_WORDS.fullmatch(text)
    if units:
        text = units.group(1)
    if re.fullmatch(r"-?[1-9]\d{0,2}(?:,\d{3})+(?:\.\d+)?", text):
        return text.replace(",", "")
    return text.replace(",", ".") if re.fullmatch(r"-?\d+,\d+", text) else text


# model spellings of the operators; U+2212 has none: final_answer's plain() already made it "-"
_OPERATORS = {
    "×": "*",
    "÷": "/",
    "–": "-",
    "·": "*",
    "\\times": "*",
    "\\cdot": "*",
    "\\div": "/",
    "\\left": "",
    "\\right": "",
    "$": "",
}
_OPERATIONS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
_ALLOWED_NODES = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, *_OPERATIONS)


def countdown_expression(completion) -> str:
    """Last \\boxed{} of the final answer, else its last non-empty line."""
    answer = final_answer(completion)
    expr = last_boxed(answer)
    if expr is None:
        expr = ([""] + answer.splitlines())[-1]  # `answer` is stripped: its last line is its last non-empty one
    for symbol, ascii_op in _OPERATORS.items():
        expr = expr.replace(symbol, ascii_op)
    return expr.strip().rstrip(".").strip()


def arithmetic_tree(expr: str) -> ast.Expression:
    """`expr` parsed, if it is + - * / ( ) over integers, short and shallow; else ValueError saying why (a
    SyntaxError if it is no expression). Whitelisted before parsing: model text never reaches eval, deep nesting
    never the parser."""
    if len(expr) > MAX_EXPR_CHARS or bracket_depth(expr) > 16:
        raise ValueError(f"at most {MAX_EXPR_CHARS} characters and 16 nested brackets")
    if not re.fullmatch(r"[0-9+\-*/() ]+", expr):
        raise ValueError("integers and + - * / ( ) only")
    tree = ast.parse(expr, mode="eval")
    if not all(isinstance(node, _ALLOWED_NODES) for node in ast.walk(tree)):
        raise ValueError("integers and + - * / ( ) only")
    return tree


def calc(expr: str) -> str:
    """The calc tool (rollout.TOOLS): the value of + - * / ( ) over integers, exact, by the whitelist
    countdown_reward checks, never by eval; an integer, else a decimal of 10 significant digits."""
    try:
        tree = arithmetic_tree(expr.strip())
    except ValueError as err:
        raise ValueError(f"calc takes {err}") from None
    try:
        value = _evaluate(tree.body)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.10g}"


def _evaluate(node) -> Fraction:
    """Exact rational value of a whitelisted expression node."""
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp):
        return _OPERATIONS[type(node.op)](_evaluate(node.operand))
    return _OPERATIONS[type(node.op)](_evaluate(node.left), _evaluate(node.right))


# What may part two boxes of one answer: "\\boxed{1} and \\boxed{2}", "y_1 = \\boxed{..} \\) and \\( y_2 = ..."
_LINK_WORDS = r"(?:and|or|for|part|parts|case|cases)"
_PART_LABEL = r"(?:\([a-z0-9]{1,3}\)|[a-z0-9]\))"  # (a), (ii), b)
_BOX_SEPARATOR = re.compile(
    rf"(?:[\s,;$&]|\\quad|\\qquad|\\[,;()]|{_PART_LABEL}|(?<![\w\\]){_LINK_WORDS}(?!\w)"
    rf"|\\text\{{(?:[\s,]|{_PART_LABEL}|{_LINK_WORDS}(?!\w))*\}}"
    r"|(?<![\w\\])[A-Za-z](?:_\{?[A-Za-z0-9]{1,3}\}?)?\s*=)*"  # "y_1 =", "x ="
)


def _box_at(text: str, start: int, limit: int):
    """(content, end) of the \\boxed{ at `start`, or None when unclosed."""
    begin, depth = start + len("\\boxed{"), 1
    for i in range(begin, min(len(text), begin + limit)):
        depth += (text[i] == "{") - (text[i] == "}")
        if depth == 0:
            return text[begin:i].strip(), i + 1
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last balanced \\boxed{...} (of at most 2000 characters), else None."""
    run, _ = last_box_run(text, 2000)
    return run[-1] if run else None


def last_box_run(text: str, limit: int) -> tuple[list[str], int]:
    """(contents of the last box and those only separators part from it, end of the last box or -1)."""
    start = text.rfind("\\boxed{")
    last = _box_at(text, start, limit) if start >= 0 else None
    if last is None:
        return [], -1
    run, end = [last[0]], last[1]
    while (before := text.rfind("\\boxed{", 0, start)) >= 0:
        box = _box_at(text, before, limit)
        if box is None or box[1] > start or not _BOX_SEPARATOR.fullmatch(text[box[1] : start]):
            break  # unclosed, holding the later box, or parted from it by words
        run.append(box[0])
        start = before
    return run[::-1], end


def bracket_depth(text: str) -> int:
    """Deepest bracket nesting, unmatched closers included."""
    depth = deepest = 0
    for char in text:
        depth += (char in "({[") - (char in ")}]")
        deepest = max(deepest, abs(depth))
    return deepest


def squad_words(text) -> list[str]:
    """SQuAD v1.1 normalised words."""
    text = _text(text).lower().translate(_NO_PUNCTUATION)
    return re.sub(r"\b(a|an|the)\b", " ", text).split()


def lcs_length(a: list[str], b: list[str]) -> int:
    """LCS length of two word lists, bit-parallel (Hyyro 2004)."""
    # a whole DP row per big-int operation: a cell-by-cell table of MAX_WORDS x MAX_WORDS is too slow in Python
    positions = {}
    for j, word in enumerate(b):
        positions[word] = positions.get(word, 0) | (1 << j)
    v = full = (1 << len(b)) - 1
    for word in a:
        if match := positions.get(word):
            u = v & match
            v = ((v + u) | (v - u)) & full
    return len(b) - v.bit_count()


def _f1(overlap: int, pred: list[str], ref: list[str]) -> float:
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(pred), overlap / len(ref)
    return 2 * precision * recall / (precision + recall)


def _text(value) -> str:
    return "" if value is None else str(value)


# CPU seconds per math-verify call, then the worker is killed: one pathological answer costs 3 s, not a run
MATH_TIMEOUT_S = 3.0
MAX_ANSWER_CHARS = 1000  # reaching sympy
MAX_DEPTH = 10  # deeper scores 0 unparsed: parsing can outlast the timeout
MAX_EXPR_CHARS = 200
MAX_WORDS = 20_000  # per side, for the LCS
_NO_PUNCTUATION = str.maketrans("", "", string.punctuation)

STRICT = os.environ.get("SOFTMAX_GRPO_STRICT_REWARDS") == "1"  # the tests: a reward bug fails them
_errors = Counter()  # "count": since the last take_error_count; "printed": the first one has printed
_errors_lock = threading.Lock()


def take_error_count() -> int:
    """Reward exceptions since the last call."""
    with _errors_lock:
        return _errors.pop("count", 0)


def _count_error(message: str):
    with _errors_lock:
        _errors["count"] += 1
        first = not _errors["printed"]
        _errors["printed"] = True
    if first:
        print(f"rewards.py: {message}; later errors are only counted (reward/errors).", file=sys.stderr, flush=True)


def _new_worker():
    """A worker of this process's own: a forked child must not share its parent's children, pipes or lock."""
    global _math_worker
    _math_worker = MathWorker(MATH_TIMEOUT_S, _count_error)


_new_worker()
os.register_at_fork(after_in_child=_new_worker)
atexit.register(lambda: _math_worker.close())  # no orphaned sympy children after the run
