"""Command-line helpers: one-line errors, an error's first line, a registry lookup, numbers and a NAME=WEIGHT list."""

import argparse
import math
import re
import unicodedata


class OneLineParser(argparse.ArgumentParser):
    """argparse with one-line errors: `PROG: error: MESSAGE` on stderr, exit status 2, no usage dump."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def first_line(err: BaseException, limit: int | None = 300, typed: bool = False) -> str:
    """`err`'s first line (else its type's name), cut to `limit`; typed=True: "OSError: LINE"."""
    line = (str(err).strip().splitlines() or [""])[0]
    return (f"{type(err).__name__}: {line}" if typed else line or type(err).__name__)[:limit]


def flag(name: str) -> str:
    """A field's command-line spelling: lora_rank -> --lora-rank."""
    return "--" + name.replace("_", "-")


def choose(registry: dict, name: str, what: str):
    if name not in registry:
        raise ValueError(f"unknown {what} {name!r}; choose one of {', '.join(registry)}")
    return registry[name]


def plain(text: str) -> str:
    """`text` in NFKC ("８０" -> "80"), U+2212 (NFKC keeps it) as "-"; super- and subscripts stay: "10²" is no 102."""
    # NFKC runs only between super- and subscripts, which it would turn into plain digits
    return re.sub("[^¹²³⁰-₟]+", lambda run: unicodedata.normalize("NFKC", run[0]), text).replace("\u2212", "-")


def number(text, limit: float = math.inf) -> float:
    """The one finite number `text` spells through plain(), at most `limit` in size; else ValueError (inf, "8, 0")."""
    value = float(plain(text))
    if math.isfinite(value) and abs(value) <= limit:  # float() takes "inf" and "nan": a weight or flag must not
        return value
    raise ValueError(f"{text!r} is not a finite number of size at most {limit:.2g}")


FLOAT32_NORMAL_MIN = 2.0**-126  # torch.finfo(torch.float32).tiny


def parse_weights(text: str, flag: str, valid, pair: str, limit: float = math.inf) -> dict[str, float]:
    """{name: weight} of a flag's list "a=0.35,b=0.65"; ValueError "FLAG: ..." otherwise."""
    weights = {}
    for piece in filter(str.strip, text.split(",")):  # a trailing comma is harmless
        name, equals, value = map(str.strip, piece.partition("="))
        if not equals or not name:
            raise ValueError(f"{flag}: {piece.strip()!r} is not {pair}")
        if name in weights:
            raise ValueError(f"{flag}: {name} is given twice")
        if name not in valid:
            choices = ", ".join(valid) if valid else "none yet"  # a registry a fork fills, such as loss.LOSS_TERMS
            raise ValueError(f"{flag}: unknown term {name!r}: choose from {choices}")
        try:
            weights[name] = number(value, limit)
        except ValueError:
            bound = f" (at most {limit:.2g})" if limit < math.inf else ""
            raise ValueError(f"{flag}: the weight of {name} must be a finite number, not {value!r}{bound}") from None
        # rewards and losses are float32 tensors: a weight below float32's normal range scales every one to 0
        if 0 < abs(weights[name]) < FLOAT32_NORMAL_MIN:
            raise ValueError(f"{flag}: the weight of {name}, {value}, is zero or subnormal in float32 (below 1.2e-38)")
    return weights


def reads(needed: str, values: dict) -> bool:
    """Whether a run of `values` reads a flag that needs `needed`: "FLAG" (set to a truthy value) or "FLAG=VALUE"."""
    name, _, wanted = needed.partition("=")
    if wanted:
        return values[name] == wanted
    return bool(values[name])


def unused_flag_error(given, values: dict, needs: dict) -> str | None:
    """The line for a flag given on the command line that no code would read, or None.
    `needs` maps a flag's name to what makes the run read it (`reads`)."""
    for name, needed in needs.items():
        if name in given and not reads(needed, values):
            other, _, wanted = needed.partition("=")
            return f"{flag(name)} is read only with {flag(other)} {wanted or 'set'}"
