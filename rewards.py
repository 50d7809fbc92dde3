"""Reward functions for the paper's tasks (SoftmaxGRPO, Section 5.1, Appendix B.3 and B.5).

Model output is untrusted input. Every reward takes any string and returns a float in [0, 1]: it
never raises, never executes model text, and returns within about a second on adversarial input.

    final_answer(text)                     answer part of a think-then-answer completion
    math_reward(completion, gold)          math-verify against \\boxed{gold} (GSM8K, DeepMath)
    countdown_reward(completion, numbers, target)   exact rational check of an expression (Countdown)
    integer_reward(completion, gold)       last integer or boxed integer (the `arith` demo task)
    similarity_reward(completion, reference)   r_sim = 0.6 F1_SQuAD + 0.4 ROUGE-L F1 (Appendix B.5)
    format_reward(completion)              1 for exactly one non-empty <think>...</think> + an answer

Tests: python -m pytest tests/test_rewards.py -q

How this departs from, or pins down, the paper:
1. math-verify bounds its time with SIGALRM, which only works in the main thread. Here it runs in a
   long-lived child process (math_worker.py; `python -c`, not multiprocessing, so it works from threads,
   forked and daemonic workers, and scripts without a `__main__` guard), with a warm spare beside it. A call
   slower than MATH_TIMEOUT_S kills the child and scores 0; the spare takes over at once. Before
   sympy sees an answer it is cut to its last MAX_ANSWER_CHARS characters and rejected when nested
   deeper than MAX_DEPTH brackets. Model text never runs as code: math-verify hands sympy's
   parse_expr only strings of digits and operators (math_verify/parser.py, v0.9). Cost: ~1 ms a call;
   the first call in a process waits ~1 s for the child to import sympy.
2. ROUGE-L is computed here as an LCS over the same SQuAD-normalised words as F1 (bit-parallel LCS,
   Hyyro 2004), not with rouge-score, whose own tokenizer would make the two halves disagree.
   Only the first MAX_WORDS words of each side enter the LCS (a lower bound on adversarially long
   text; real completions are far shorter).
3. Countdown accepts the last \\boxed{} of the answer, else its last non-empty line, optionally
   ending in "= target"; unicode and LaTeX operators are mapped to + - * /; unary minus is allowed.
"""

import ast
import atexit
import functools
import os
import re
import string
from collections import Counter
from fractions import Fraction

from math_worker import MathWorker

MATH_TIMEOUT_S = 0.8  # wall time for one math-verify call before the worker is killed
MAX_ANSWER_CHARS = 1000  # math answers: only the tail reaches sympy
MAX_DEPTH = 32  # deeper bracket nesting scores 0 without parsing
MAX_EXPR_CHARS = 200  # a Countdown expression over four numbers is ~25 characters
MAX_WORDS = 20_000  # per side, for the O(n * m / 64) LCS


def _text(value) -> str:
    """Model output as str; bytes are decoded with replacement, anything else stringified."""
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", errors="replace")
    return "" if value is None else str(value)


def _reward(fn):
    """Make a reward total: any exception scores 0 and the result is clipped to [0, 1]."""
    @functools.wraps(fn)
    def wrapped(*args):
        try:
            return min(1.0, max(0.0, float(fn(*args))))
        except Exception:  # RecursionError, MemoryError, ZeroDivisionError, ... from hostile text
            return 0.0
    return wrapped


def final_answer(text) -> str:
    """Text after the last </think> when present, then inside the last <answer>...</answer>."""
    text = _text(text)
    end = text.rfind("</think>")
    if end >= 0:
        text = text[end + len("</think>"):]
    start = text.rfind("<answer>")
    if start >= 0:
        text = text[start + len("<answer>"):]
        close = text.find("</answer>")
        text = text if close < 0 else text[:close]  # unclosed (truncated) answer: keep the rest
    return text.strip()


def last_boxed(text: str, limit: int = 2000) -> str | None:
    """Content of the last \\boxed{...} with balanced braces (scans at most `limit` characters)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    begin = start + len("\\boxed{")
    depth = 1
    for i in range(begin, min(len(text), begin + limit)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i].strip()
    return None


def _depth(text: str) -> int:
    """Deepest bracket nesting, counting unmatched closers too (a cut-off tail is all closers)."""
    depth = deepest = 0
    for char in text:
        depth += (char in "({[") - (char in ")}]")
        deepest = max(deepest, abs(depth))
    return deepest


# ---------------------------------------------------------------- math (GSM8K, DeepMath)
_math_worker = MathWorker(timeout=MATH_TIMEOUT_S)
os.register_at_fork(after_in_child=lambda: globals().update(_math_worker=MathWorker(timeout=MATH_TIMEOUT_S)))
atexit.register(lambda: _math_worker.close())


@_reward
def math_reward(completion, gold) -> float:
    """1.0 when the final answer equals `gold` under math-verify, with gold wrapped in \\boxed{}."""
    answer = final_answer(completion)[-MAX_ANSWER_CHARS:]
    gold = _text(gold).strip()
    if not answer or not gold or _depth(answer) > MAX_DEPTH:
        return 0.0
    gold = gold if "\\boxed" in gold else "\\boxed{" + gold + "}"
    return _math_worker.verify(answer, gold)


# ---------------------------------------------------------------- Countdown
_OPERATORS = {"×": "*", "÷": "/", "−": "-", "–": "-", "·": "*", "\\times": "*", "\\cdot": "*",
              "\\div": "/", "\\left": "", "\\right": "", "$": ""}
_ALLOWED_NODES = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant,
                  ast.Add, ast.Sub, ast.Mult, ast.Div, ast.USub)


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
        return -_evaluate(node.operand)
    left, right = _evaluate(node.left), _evaluate(node.right)
    if isinstance(node.op, ast.Add):
        return left + right
    if isinstance(node.op, ast.Sub):
        return left - right
    if isinstance(node.op, ast.Mult):
        return left * right
    return left / right  # ZeroDivisionError scores 0 through @_reward


@_reward
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
    tree = ast.parse(expr, mode="eval")
    nodes = list(ast.walk(tree))
    if not all(isinstance(node, _ALLOWED_NODES) for node in nodes):
        return 0.0  # Pow, FloorDiv, Mod, tuples, ...
    if any(isinstance(node, ast.UnaryOp) and not isinstance(node.op, ast.USub) for node in nodes):
        return 0.0
    used = [node.value for node in nodes if isinstance(node, ast.Constant)]
    if any(type(value) is not int for value in used) or Counter(used) != Counter(numbers):
        return 0.0  # each supplied integer exactly once, checked before any arithmetic
    return float(_evaluate(tree) == target)


# ---------------------------------------------------------------- arith (CPU demo)
@_reward
def integer_reward(completion, gold) -> float:
    """1.0 when the boxed answer, else the last integer of the final answer, equals int(gold)."""
    answer = final_answer(completion)
    boxed = last_boxed(answer)
    answer = (boxed if boxed is not None else answer)[-MAX_ANSWER_CHARS:]
    found = re.findall(r"-?[0-9]+(?:,[0-9]{3})*", answer)
    return float(bool(found) and int(found[-1].replace(",", "")) == int(_text(gold).strip()))


# ---------------------------------------------------------------- similarity (Appendix B.5)
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


@_reward
def similarity_reward(completion, reference) -> float:
    """r_sim = 0.6 * F1_SQuAD + 0.4 * ROUGE-L F1 of the final answer vs `reference` (Appendix B.5)."""
    pred, ref = squad_words(final_answer(completion)), squad_words(reference)
    if not pred or not ref:
        return 0.0  # an empty reference gives no signal (and must not reward empty answers)
    overlap = sum((Counter(pred) & Counter(ref)).values())  # SQuAD F1 counts shared words
    lcs = lcs_length(pred[:MAX_WORDS], ref[:MAX_WORDS])
    return 0.6 * _f1(overlap, len(pred), len(ref)) + 0.4 * _f1(lcs, len(pred), len(ref))


@_reward
def format_reward(completion) -> float:
    """1.0 for exactly one non-empty <think>...</think> (nothing before it) and a non-empty answer."""
    text = _text(completion)
    if text.count("<think>") != 1 or text.count("</think>") != 1:
        return 0.0
    before, _, rest = text.partition("<think>")
    thought, closed, _ = rest.partition("</think>")
    return float(closed != "" and not before.strip() and bool(thought.strip())
                 and bool(final_answer(text)))
