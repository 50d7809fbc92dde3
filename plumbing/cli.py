"""What every command line here shares: an argument parser whose errors are one line, an error's first line, the
one-line errors of a registry lookup and of a flag's NAME=WEIGHT list, and flag help read from a docstring.

Each of train.py, eval.py and tools/ promises one line for a bad input, `PROG: error: MESSAGE`, not a usage dump
or a traceback; errors from libraries can run to pages, so a message quotes only their first line.
"""

import argparse
import inspect
import math
import sys
from collections.abc import Callable


class OneLineParser(argparse.ArgumentParser):
    """argparse with one-line errors: `PROG: error: MESSAGE` on stderr, exit status 2, no usage dump."""

    def __init__(self, prog: str, **kwargs):
        super().__init__(prog=prog, **kwargs)

    def error(self, message):
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def first_line(err: BaseException, limit: int | None = 300, typed: bool = False) -> str:
    """The first line of `err`'s message (its type's name when it has none), cut to `limit` characters (None:
    uncut); typed=True prefixes the type's name, "OSError: ...", for errors whose text alone says too little."""
    lines = str(err).strip().splitlines()
    if typed:
        return f"{type(err).__name__}: {lines[0] if lines else ''}"[:limit]
    return (lines[0] if lines else type(err).__name__)[:limit]


def choose(registry: dict, name: str, what: str):
    """registry[name]; ValueError "unknown WHAT 'NAME'; choose one of ..." naming the registry's keys otherwise."""
    if name not in registry:
        raise ValueError(f"unknown {what} {name!r}; choose one of {', '.join(registry)}")
    return registry[name]


def parse_weights(text: str, flag: str, valid, *, not_a_pair: Callable[[str], str], unknown: Callable[[str], str],
                  not_finite: Callable[[str, str], str] | None = None, limit: float = math.inf,
                  over_limit: str = "") -> dict[str, float]:
    """{name: weight} of a flag's comma list "a=0.35,b=0.65" (--loss-terms, --reward-weights); an empty piece is no
    name, so a trailing comma is harmless. ValueError "FLAG: MESSAGE", one line, at the first bad piece, the message
    the caller's: not_a_pair(piece) for a piece that is not NAME=WEIGHT (and for a bad weight without not_finite),
    not_finite(name, value) for a weight that is not a number of size at most `limit` (with `over_limit` after it
    where the weight is finite, only too large); "NAME is given twice"; and unknown(name) for a name not in `valid`."""
    weights = {}
    for piece in filter(str.strip, text.split(",")):
        name, equals, value = (part.strip() for part in piece.partition("="))
        if not equals or not name:
            raise ValueError(f"{flag}: {not_a_pair(piece.strip())}")
        try:
            weight = float(value)
        except ValueError:
            weight = math.nan
        if not (math.isfinite(weight) and abs(weight) <= limit):
            raise ValueError(f"{flag}: " + (not_finite(name, value) + (over_limit if math.isfinite(weight) else "")
                                            if not_finite else not_a_pair(piece.strip())))
        if name in weights:
            raise ValueError(f"{flag}: {name} is given twice")
        if name not in valid:
            raise ValueError(f"{flag}: {unknown(name)}")
        weights[name] = weight
    return weights


def term_weights(text: str, terms: dict) -> dict[str, float]:
    """{name: coefficient} of --loss-terms ("l2=0.1,other=-1"); ValueError, one line naming the flag, for a piece that
    is not NAME=COEF, a coefficient that is not a finite number, a name given twice or not in `terms` (LOSS_TERMS)."""
    return parse_weights(text, "--loss-terms", terms, not_a_pair=lambda piece: (
        f"{piece!r} is not NAME=COEF with a finite COEF (e.g. l2=0.1)"), unknown=lambda name: (
        f"unknown term {name!r}; choose from {', '.join(terms) or 'none yet'} (loss.py: LOSS_TERMS)"))


def option_help(function, names) -> dict:
    """{option: help} from `function`'s docstring: the "name: help" lines (name in `names`) after "Options", all
    indented alike, each continued by the lines indented deeper below it."""
    helps, name, indent = {}, None, None
    for line in inspect.getdoc(function).split("\nOptions", 1)[1].splitlines()[1:]:
        depth, (head, _, rest) = len(line) - len(line.lstrip()), line.strip().partition(": ")
        indent = depth if indent is None else indent
        if depth == indent and head in names:
            name, helps[head] = head, rest
        elif name and depth > indent:
            helps[name] += " " + line.strip()
        else:
            name = None
    return helps
