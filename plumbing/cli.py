"""What every command line here shares: an argument parser whose errors are one line, and an error's first line.

Each of train.py, eval.py and tools/ promises one line for a bad input, `PROG: error: MESSAGE`, not a usage dump
or a traceback; errors from libraries can run to pages, so a message quotes only their first line.
"""

import argparse
import sys


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
