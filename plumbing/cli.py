"""Command-line helpers: one-line errors, an error's first line, a registry lookup and a NAME=WEIGHT list."""

import argparse
import math
import sys


class OneLineParser(argparse.ArgumentParser):
    """argparse with one-line errors: `PROG: error: MESSAGE` on stderr, exit status 2, no usage dump."""

    def error(self, message):
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def first_line(err: BaseException, limit: int | None = 300, typed: bool = False) -> str:
    """`err`'s first line (else its type's name), cut to `limit`; typed=True: "OSError: LINE"."""
    lines = str(err).strip().splitlines()
    if typed:
        return f"{type(err).__name__}: {lines[0] if lines else ''}"[:limit]
    return (lines[0] if lines else type(err).__name__)[:limit]


def choose(registry: dict, name: str, what: str):
    """registry[name], else ValueError naming the registry's keys."""
    if name not in registry:
        raise ValueError(f"unknown {what} {name!r}; choose one of {', '.join(registry)}")
    return registry[name]


def parse_weights(text: str, flag: str, valid, pair: str, limit: float = math.inf) -> dict[str, float]:
    """{name: weight} of a flag's list "a=0.35,b=0.65"; ValueError "FLAG: ..." otherwise."""
    weights = {}
    for piece in filter(str.strip, text.split(",")):  # a trailing comma is harmless
        name, equals, value = (part.strip() for part in piece.partition("="))
        if not equals or not name:
            raise ValueError(f"{flag}: {piece.strip()!r} is not {pair}")
        try:
            weight = float(value)
        except ValueError:
            weight = math.nan
        if not (math.isfinite(weight) and abs(weight) <= limit):
            raise ValueError(f"{flag}: the weight of {name} must be a finite number, not {value!r}"
                             + (f" (at most {limit:.2g})" if math.isfinite(weight) else ""))
        if name in weights:
            raise ValueError(f"{flag}: {name} is given twice")
        if name not in valid:
            raise ValueError(f"{flag}: unknown term {name!r}: choose from {', '.join(valid) or 'none yet'}")
        weights[name] = weight
    return weights
