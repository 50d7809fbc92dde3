"""Reward functions for the paper's tasks (SoftmaxGRPO, Section 5.1, Appendix B.3 and B.5).

Model output is untrusted input. Every reward takes any string and returns a float in [0, 1]: it
never raises, never executes model text, and returns within MATH_TIMEOUT_S on adversarial input.
An exception inside a reward is a bug (the rewards are written not to raise on any text), so it is
not silent: it scores 0, is counted (`take_error_count()`, which train.py logs per step as
reward/errors), and the first one of a run prints its traceback to stderr. A math-verify call that
outlasts MATH_TIMEOUT_S scores 0 and is counted the same way. With
SOFTMAX_GRPO_STRICT_REWARDS=1 in the environment (or `rewards.STRICT = True`) it raises instead;
the test suite runs that way (tests/conftest.py).

    final_answer(text)                     answer part of a think-then-answer completion
    math_reward(completion, gold)          math-verify against \\boxed{gold} (GSM8K, DeepMath)
    countdown_reward(completion, numbers, target)   exact rational check of an expression (Countdown)
    integer_reward(completion, gold)       last number or boxed number, a whole one (the `arith` demo task)
    similarity_reward(completion, reference)   r_sim = 0.6 F1_SQuAD + 0.4 ROUGE-L F1 (Appendix B.5)
    format_reward(completion)              1 for exactly one non-empty <think>...</think> + an answer
    REWARD_TERMS                           --reward-weights' terms by name, each (completion, example) -> float;
                                           "exact", the task's verifier, is tasks.Task.reward's own

Tests: python -m pytest tests/test_rewards.py -q

How this departs from, or pins down, the paper (math-verify in a child process, ROUGE-L on SQuAD words,
Countdown's answer line, the verdicts the paper leaves open): docs/rewards.md, numbered as the comments cite them.
"""

import ast
import atexit
import functools
import inspect
import os
import re
import string
import sys
import threading
import traceback
from collections import Counter
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from plumbing.boxes import _depth, _last_box_run, last_boxed, last_boxes, plain_number  # noqa: F401 (re-exported)
from plumbing.math_worker import MathWorker


def safe_reward(fn):
    """Make a reward total (every reward below wears it): an exception scores 0 (counted; the first traceback
    printed); clip to [0, 1]."""
    @functools.wraps(fn)
    def wrapped(*args):
        try:
            return min(1.0, max(0.0, float(fn(*args))))
        except Exception:
            if STRICT:
                raise
            _count_error(f"{fn.__name__} raised and scored 0. Set SOFTMAX_GRPO_STRICT_REWARDS=1 to raise.\n"
                         f"{traceback.format_exc()}")
            return 0.0
    return wrapped


# ---------------------------------------------------------------- math (GSM8K, DeepMath)
@safe_reward
def math_reward(completion, gold) -> float:
    """1.0 when the final answer equals `gold` under math-verify, with gold wrapped in \\boxed{}."""
    answer = math_answer(completion)
    gold = _text(gold).strip()
    if not answer or not gold or _depth(answer) > MAX_DEPTH:
        return 0.0
    gold = gold if "\\boxed" in gold else "\\boxed{" + plain_number(gold) + "}"
    return _math_worker.verify(answer, gold)


# ---------------------------------------------------------------- Countdown
@safe_reward
def countdown_reward(completion, numbers, target) -> float:
    """1.0 when the expression uses each of `numbers` exactly once, only + - * / ( ), = target."""
    numbers, target = [int(n) for n in numbers], Fraction(int(target))
    expr = countdown_expression(completion)
    if expr.count("=") == 1:  # "... = 24" is accepted only with the right right-hand side
        expr, rhs = expr.split("=")
        if not re.fullmatch(r"\s*-?[0-9]{1,12}\s*", rhs) or int(rhs) != target:
            return 0.0
    if len(expr) > MAX_EXPR_CHARS or not re.fullmatch(r"[0-9+\-*/() ]+", expr) or _depth(expr) > 16:
        return 0.0  # characters whitelisted before the parser sees them: no names, calls, dots
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:  # "(3+3)*4*", "3 3 4 1", "(3+3)*4*1)": model text that is no expression, a wrong answer
        return 0.0
    nodes = list(ast.walk(tree))
    if not all(isinstance(node, _ALLOWED_NODES) for node in nodes):
        return 0.0  # Pow, FloorDiv, Mod, tuples, ...
    used = [node.value for node in nodes if isinstance(node, ast.Constant)]
    if any(type(value) is not int for value in used) or Counter(used) != Counter(numbers):
        return 0.0  # each supplied integer exactly once, checked before any arithmetic
    try:
        return float(_evaluate(tree) == target)
    except _DivisionByZero:
        return 0.0


# ---------------------------------------------------------------- arith (CPU demo)
@safe_reward
def integer_reward(completion, gold) -> float:
    """1.0 when the boxed answer, else the last number of the final answer, is the integer `gold`: both read by
    integer_answer, so "2.5" and "1,5" are not 5 (nor 25 or 15) and "1,234" is 1234 on either side."""
    answer, gold = integer_answer(completion), integer_answer(gold)
    if not re.fullmatch(r"-?[0-9]+", gold):
        raise ValueError(f"integer_reward: the gold answer {gold!r} is not an integer")  # a bad row, not a miss
    return float(answer == gold)


# ---------------------------------------------------------------- similarity (Appendix B.5)
@safe_reward
def similarity_reward(completion, reference) -> float:
    """r_sim = 0.6 * F1_SQuAD + 0.4 * ROUGE-L F1 of the final answer vs `reference` (Appendix B.5)."""
    pred, ref = squad_words(final_answer(completion)), squad_words(reference)
    if not pred or not ref:
        return 0.0  # an empty reference gives no signal (and must not reward empty answers)
    overlap = sum((Counter(pred) & Counter(ref)).values())  # SQuAD F1 counts shared words
    lcs = lcs_length(pred[:MAX_WORDS], ref[:MAX_WORDS])
    return 0.6 * _f1(overlap, len(pred), len(ref)) + 0.4 * _f1(lcs, len(pred), len(ref))


@safe_reward
def format_reward(completion) -> float:
    """1.0 for exactly one non-empty <think>...</think> (nothing before it) and a non-empty answer."""
    text = _text(completion)
    if text.count("<think>") != 1 or text.count("</think>") != 1:
        return 0.0
    before, _, rest = text.partition("<think>")
    thought, closed, _ = rest.partition("</think>")
    return float(closed != "" and not before.strip() and bool(thought.strip())
                 and bool(final_answer(text)))


def overlong_reward(completion, example, *, n_tokens: int, max_tokens: int, overlong_buffer: int) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, Eq. 13) plus 1, so that it lies in [0, 1]
    as every term does: 1 up to L_max - L_cache tokens, falling linearly to 0 at L_max (--max-tokens, where
    sampling stops). L_cache is --overlong-buffer. The + 1 is one constant for every sample: group advantages
    subtract it (all but maxrl, and reinforce with a constant --baseline). rollout.score passes the three lengths."""
    free = max_tokens - overlong_buffer  # L_max - L_cache
    return 1.0 + min(0.0, (free - n_tokens) / overlong_buffer)  # Eq. 13 + 1: 0 <= L - free <= L_cache ramps down


# ---------------------------------------------------------------- reward terms (--reward-weights)
# r = sum_k w_k r_k over the terms --reward-weights names (train.py: score); "exact", the task's verifier, is not
# here: Task.reward scores it. A term takes (completion, example) and may read example.reference, .gold, .meta.
# Task.reward calls every term and verifier through safe_reward, so a fork's plain function is clipped to [0, 1]
# and an exception in it scores 0: REWARD_TERMS["brevity"] = brevity_reward (docs/fork.md).
REWARD_TERMS: dict[str, Callable[[str, Any], float]] = {
    "sim": lambda completion, example: similarity_reward(completion, example.reference),  # Appendix B.5
    "format": lambda completion, example: format_reward(completion),  # the official OpenThoughts run: 0.35 of it
    "overlong": overlong_reward,  # DAPO's Eq. 13 (+ 1), given the completion's token count (--overlong-buffer)
}


def declared_lengths(kind: str, **lengths) -> dict:
    """Of `lengths` (n_tokens, max_tokens, overlong_buffer), those the REWARD_TERMS entry `kind` declares: a
    length-aware term (overlong) gets them from rollout.score and eval.py alike, every other term and the verifier
    none, so a term (or a task) that takes no lengths needs none."""
    term = REWARD_TERMS.get(kind)
    return {k: v for k, v in lengths.items() if term is not None and k in inspect.signature(term).parameters}


# ---------------------------------------------------------------- reading the answer the rewards above score
def final_answer(text) -> str:
    """Text after the last </think> when present, then inside the last <answer>...</answer>.

    "" when a <think> is never closed: the trace was cut off before any answer (departure 4).
    """
    text = _text(text)
    end = text.rfind("</think>")
    if end >= 0:
        text = text[end + len("</think>"):]
    elif "<think>" in text:
        return ""
    start = text.rfind("<answer>")
    if start >= 0:
        text = text[start + len("<answer>"):]
        close = text.find("</answer>")
        text = text if close < 0 else text[:close]  # unclosed (truncated) answer: keep the rest
    return text.strip()


_UNIT_WORDS = re.compile(r"(?:\\(?:text|mbox|textrm)\{\s*)?(-?[0-9][0-9,]*(?:\.[0-9]+)?)"
                         r"(?:\s+|\s*\}?\s*\\(?:text|mbox|textrm)\{\s*)[A-Za-z]{2,}(?:\s+[A-Za-z]+)*\.?\s*\}?")


_FINAL_STATEMENT = re.compile(r"final answer is\b", re.IGNORECASE)  # the phrase math-verify's extraction ranks first


def math_answer(completion) -> str:
    """What math-verify judges: \\boxed{the last run of boxes} wherever it is in the answer; but a statement
    "the final answer is ..." after it (or with no box at all) is the answer, up to its line's end; else the
    answer's tail.

    A number followed by unit words in the box is the number; the unicode minus is "-" (departure 4).
    """
    answer = final_answer(completion).replace("\u2212", "-")
    boxes, box_end = _last_box_run(answer, limit=MAX_ANSWER_CHARS)
    stated = [match.start() for match in _FINAL_STATEMENT.finditer(answer)]
    if stated and stated[-1] > box_end:
        line_end = answer.find("\n", stated[-1])
        return answer[stated[-1]:line_end if line_end >= 0 else len(answer)][:MAX_ANSWER_CHARS]
    if not boxes:
        return answer[-MAX_ANSWER_CHARS:]
    boxes = [units.group(1) if (units := _UNIT_WORDS.fullmatch(box)) else box for box in boxes]
    if sum(map(len, boxes)) > MAX_ANSWER_CHARS:  # a run too long for sympy: its last box alone
        boxes = boxes[-1:]
    return "\\boxed{" + ", ".join(boxes) + "}"  # several boxes: one set, as math-verify reads them


# A number as written: digits with "," "." or "/" inside ("1,234", "2.5", "3/4", "1,5") and an exponent ("1e5").
_NUMBER = re.compile(r"-?[0-9]+(?:[.,/][0-9]+)*(?:[eE][-+]?[0-9]+)?")


def integer_answer(text) -> str:
    """What integer_reward compares, and eval.py reports for arith: the last \\boxed{} of the final answer, else
    the final answer, read for its last number. A whole number comes back as its digits ("1,234" -> "1234",
    "7.0" -> "7", "-3"); any other number as written ("2.5", "1,5", "3/4", "1e5"), which equals no integer gold;
    "" when there is none. A comma is a thousands separator only between groups of three digits."""
    answer = final_answer(text).replace("\u2212", "-")
    boxed = last_boxed(answer)
    found = _NUMBER.findall((boxed if boxed is not None else answer)[-MAX_ANSWER_CHARS:])
    if not found:
        return ""
    number = found[-1]
    if re.fullmatch(r"-?[0-9]{1,3}(?:,[0-9]{3})+|-?[0-9]+(?:\.0+)?", number):
        number = number.replace(",", "").split(".")[0]
        return str(int(number))  # "007" -> "7", "-0" -> "0"
    return number


_OPERATORS = {"×": "*", "÷": "/", "−": "-", "–": "-", "·": "*", "\\times": "*", "\\cdot": "*",
              "\\div": "/", "\\left": "", "\\right": "", "$": ""}


class _DivisionByZero(Exception):
    """A model's expression divides by zero: a wrong answer, not a bug."""


_ALLOWED_NODES = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant,
                  ast.Add, ast.Sub, ast.Mult, ast.Div, ast.USub, ast.UAdd)


def countdown_expression(completion) -> str:
    """The candidate expression: last \\boxed{} of the final answer, else its last non-empty line."""
    answer = final_answer(completion)
    boxed = last_boxed(answer)
    lines = [line for line in answer.splitlines() if line.strip()]
    expr = boxed if boxed is not None else (lines[-1] if lines else "")
    for symbol, ascii_op in _OPERATORS.items():
        expr = expr.replace(symbol, ascii_op)
    return expr.strip().rstrip(".").strip()


def _evaluate(node) -> Fraction:
    """Exact rational value of a tree that already passed the whitelist."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp):
        return -_evaluate(node.operand) if isinstance(node.op, ast.USub) else _evaluate(node.operand)
    left, right = _evaluate(node.left), _evaluate(node.right)
    if isinstance(node.op, ast.Add):
        return left + right
    if isinstance(node.op, ast.Sub):
        return left - right
    if isinstance(node.op, ast.Mult):
        return left * right
    if right == 0:
        raise _DivisionByZero
    return left / right


_NO_PUNCTUATION = str.maketrans("", "", string.punctuation)


def squad_words(text) -> list[str]:
    """SQuAD v1.1 normalisation: lowercase, drop punctuation, drop a/an/the, split on whitespace."""
    text = _text(text).lower().translate(_NO_PUNCTUATION)
    return re.sub(r"\b(a|an|the)\b", " ", text).split()


def lcs_length(a: list[str], b: list[str]) -> int:
    """Longest common subsequence of two word lists, bit-parallel over b (Hyyro 2004)."""
    positions = {}
    for j, word in enumerate(b):
        positions[word] = positions.get(word, 0) | (1 << j)  # bit j set where b[j] == word
    full = (1 << len(b)) - 1
    v = full  # zero bits of v mark the LCS so far
    for word in a:
        match = positions.get(word)
        if match:
            u = v & match
            v = ((v + u) | (v - u)) & full
    return len(b) - v.bit_count()


def _f1(overlap: int, n_pred: int, n_ref: int) -> float:
    if overlap == 0:
        return 0.0
    precision, recall = overlap / n_pred, overlap / n_ref
    return 2 * precision * recall / (precision + recall)


def _text(value) -> str:
    """Model output as str; bytes are decoded with replacement, anything else stringified."""
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", errors="replace")
    return "" if value is None else str(value)


# ---------------------------------------------------------------- limits, and the errors the rewards count
MATH_TIMEOUT_S = 3.0  # wall time for one math-verify call before the worker is killed (counted in reward/errors)
MAX_ANSWER_CHARS = 1000  # math answers: the boxed content, or without a box the tail, that reaches sympy
MAX_DEPTH = 10  # deeper bracket nesting scores 0 without parsing: its parse alone can outlast the timeout
MAX_EXPR_CHARS = 200  # a Countdown expression over four numbers is ~25 characters
MAX_WORDS = 20_000  # per side, for the O(n * m / 64) LCS


STRICT = os.environ.get("SOFTMAX_GRPO_STRICT_REWARDS", "") == "1"  # True: a reward's exception raises
_errors = {"count": 0, "printed": False}
_errors_lock = threading.Lock()


def take_error_count() -> int:
    """Exceptions the rewards caught (and scored 0) since the last call; resets the count."""
    with _errors_lock:
        count, _errors["count"] = _errors["count"], 0
    return count


def _count_error(message: str):
    """Count one reward error (reward/errors); print `message` for the first one of the run."""
    with _errors_lock:
        _errors["count"] += 1
        first, _errors["printed"] = not _errors["printed"], True
    if first:
        print(f"rewards.py: {message}; later errors are only counted (reward/errors).", file=sys.stderr, flush=True)


_math_worker = MathWorker(timeout=MATH_TIMEOUT_S, on_failure=_count_error)  # a timeout is a counted error
os.register_at_fork(after_in_child=lambda: globals().update(
    _math_worker=MathWorker(timeout=MATH_TIMEOUT_S, on_failure=_count_error)))
atexit.register(lambda: _math_worker.close())
