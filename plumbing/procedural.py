"""What tasks.py's procedural tasks (arith, countdown24; docs/tasks.md, departures 2 and 5) draw on: seeded passes over
a list of problems, and the depth-first search that finds a Countdown puzzle's reference solution.

    python -m pytest tests/test_tasks.py -q
"""

import itertools
import random
from collections.abc import Callable


def seeded_passes(items: list, seed: int, repeat: bool):
    """Yield (item, pass) in seeded shuffles of `items`: once, or forever when `repeat`."""
    rng = random.Random(seed)
    for pass_index in itertools.count():
        order = list(items)
        rng.shuffle(order)
        yield from ((item, pass_index) for item in order)
        if not repeat or not items:
            return


def search_expression(items: list[tuple[float, str]], numbers: list[int], target: int,
                      accept: Callable[[str, list[int], int], float]) -> str | None:
    """Depth-first search over pairs of (value, expression) items for an expression of `numbers` equal to `target`:
    floats to prune, `accept` (tasks.py passes the exact countdown_reward) scoring 1.0 to take one."""
    if len(items) == 1:
        value, expr = items[0]
        expr = expr[1:-1] if expr.startswith("(") else expr  # outer parentheses
        ok = abs(value - target) < 1e-6 and accept(expr, numbers, target) == 1.0
        return expr if ok else None
    for i, j in itertools.combinations(range(len(items)), 2):
        (a, left), (b, right) = items[i], items[j]
        rest = [item for k, item in enumerate(items) if k not in (i, j)]
        options = [(a + b, f"({left} + {right})"), (a * b, f"({left} * {right})"),
                   (a - b, f"({left} - {right})"), (b - a, f"({right} - {left})")]
        options += [(a / b, f"({left} / {right})")] if b else []
        options += [(b / a, f"({right} / {left})")] if a else []
        for option in options:
            found = search_expression(rest + [option], numbers, target, accept)
            if found:
                return found
    return None
