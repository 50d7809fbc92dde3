"""Checked rows of a data file (.jsonl, .json, .parquet) or hub dataset, and the training order.

python -m pytest tests/test_tasks.py tests/test_bad_input.py -q
"""

import hashlib
import json
import os
import socket
import typing
import urllib.parse
from functools import lru_cache

import numpy as np

from plumbing.cli import first_line

MAX_ROW_CHARS = 1_000_000  # ~250k tokens
MAX_LINE_BYTES = 16 * MAX_ROW_CHARS  # a few columns of MAX_ROW_CHARS, in UTF-8
MAX_ARRAY_BYTES = 2**28  # a .json array is parsed whole: 256 MB of text already takes a few GB as Python objects


class DataError(ValueError):
    """A one-line, user-facing data problem."""


class Rows(list):
    """A JSON file's rows as json reads them, with the Dataset interface (datasets' reader re-types "7" as 7)."""

    @property
    def column_names(self) -> list[str]:
        return list(dict.fromkeys(name for row in self for name in row))

    def __getitem__(self, column: str) -> list:
        return [row.get(column) for row in self]  # a column, as a Dataset gives it (records reads it so)

    def select(self, indices) -> "Rows":
        return Rows(list.__getitem__(self, i) for i in indices)


def hub_reachable() -> bool:
    """Fail in seconds, not after datasets' retries, without a network."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return True  # datasets reads its cache
    url = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=3.0).close()
        return True
    except OSError:
        return False


def data_file_error(path: str, flag: str = "--data-file", splits=("train", "test")) -> str | None:
    """Why `path` ("{split}": each split's file) is no data file, or None."""
    for name in dict.fromkeys(path.replace("{split}", split) for split in splits):
        each = f" (one file per split: {{split}} in {path} stands for {' and '.join(splits)})" if name != path else ""
        if os.path.isdir(name):
            return f"{flag} {name} is a folder; pass a .jsonl, .json or .parquet file{each}"
        if os.path.splitext(name)[1].lower() not in (".json", ".jsonl", ".parquet"):
            return f"{flag} {name}: expected a .jsonl, .json or .parquet file"
        if not os.path.isfile(name):
            return f"{flag} {name} does not exist{each}"
    return None


def _dataset(failed: str, *args, **kwargs):
    """datasets.load_dataset, its text checked as UTF-8; DataError "`failed` (ERROR)"."""
    import datasets  # slow import

    datasets.disable_progress_bars()
    try:
        rows = datasets.load_dataset(*args, **kwargs)
        rows.data.table.validate(full=True)  # else invalid UTF-8 raises mid-load
        return rows
    except Exception as err:
        raise DataError(f"{failed} ({first_line(err, typed=True)})") from None


def read_rows(path: str | None, flag: str, hub: tuple | None, columns: dict, who: str, hint: str = ""):
    """(rows, line numbers or None, source) of `path`, else of the `hub` dataset (id, config, split), via check_rows."""
    advice = f"pass {flag} FILE (.jsonl or .parquet with columns {', '.join(columns)})"
    source = f"{flag} {path}"
    lines = None  # a parquet file or hub dataset has rows, not lines
    if path and (error := data_file_error(path, flag)):
        raise DataError(error)
    if path and os.path.getsize(path) == 0:
        raise DataError(f"{source}: the file is empty; it needs {who}'s rows")
    if path and path.lower().endswith(".parquet"):
        rows = _dataset(f"{source}: cannot read it", "parquet", data_files=path, split="train")
    elif path:
        rows, lines = _read_json(path, source)
    elif not hub:
        raise DataError(f"{who} has no hub dataset: {advice}")
    elif not hub_reachable():
        raise DataError(
            f"cannot reach the Hugging Face Hub to load {hub[0]}: {advice}, "
            "or set HF_HUB_OFFLINE=1 to use a cached copy"
        )
    else:
        source = hub[0]
        rows = _dataset(f"cannot load {source}: {advice}", *hub[:2], split=hub[2])
    check_rows(rows, lines, columns, source, who, hint)
    return rows, lines, source


def rows_revision(path: str | None, rows) -> str:
    """`path`'s sha256, as the official prepare_data.py's manifest has it; else the hub commit of `rows`."""
    if path is None:  # datasets caches a hub dataset's rows in a folder named by its commit
        return os.path.basename(os.path.dirname(next((file["filename"] for file in rows.cache_files), "")))
    stat = os.stat(path)
    return _sha256(path, stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=4)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    """Keyed by size and mtime too: a file's train and test split are hashed once, a rewritten file again."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _read_json(path: str, source: str) -> tuple:
    """(Rows, line numbers) of a JSON Lines file, or (Rows, None) of a .json array; a line is read in bounded chunks."""
    rows, lines = [], []
    with open(path, "rb") as f:
        array = path.lower().endswith(".json") and f.read(4096).lstrip().startswith(b"[")
        f.seek(0)
        if array:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_ARRAY_BYTES:  # JSON Lines is read a row at a time
                raise DataError(
                    f"{source}: a .json array is read whole, and this one is {size / 1e6:,.0f} MB, over "
                    f"{MAX_ARRAY_BYTES / 1e6:.0f} MB (plumbing/data.py: MAX_ARRAY_BYTES): write it as JSON Lines"
                )
            rows, lines = _parse(f.read()), None
            if isinstance(rows, ValueError):
                raise DataError(f"{source}: the file {rows}")
        else:
            for number, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), 1):
                if len(raw) > MAX_LINE_BYTES:  # a file with no newline would otherwise be read whole into memory
                    raise DataError(
                        f"{source}: line {number} is over {MAX_LINE_BYTES / 1e6:.0f} MB, more than a row "
                        "may hold (plumbing/data.py: MAX_LINE_BYTES)"
                    )
                if raw.strip():  # as datasets does
                    lines.append(number)
                    rows.append(_parse(raw))
    one = len(rows) == 1 and path.lower().endswith(".json") and not array and isinstance(rows[0], dict) and rows[0]
    # pandas' default to_json() parses as one row whose values are whole columns: say so, not "lacks column"; a
    # .jsonl file is rows by its name, so a one-row file of list columns (an openthoughts conversation) is one row
    if one and all(isinstance(value, (dict, list)) for value in one.values()):
        raise DataError(
            f"{source}: the file is one JSON object of columns (pandas' to_json() layout), not rows: "
            "write a list of row objects (orient='records') or JSON Lines (orient='records', lines=True)"
        )
    bad = [i for i, row in enumerate(rows) if not isinstance(row, dict)]
    if bad:
        row = rows[bad[0]]
        why = str(row) if isinstance(row, ValueError) else "is not a JSON object"
        layout = " (a .json file holds a list of row objects, or one object per line)" if path.endswith(".json") else ""
        raise DataError(f"{source}: {where(lines, bad[0])} {why}; {len(bad)} of {len(rows)} rows are bad{layout}")
    return Rows(rows), lines


def _parse(raw: bytes):
    """JSON of `raw`, else a ValueError saying why not."""
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError as err:
        return ValueError(f"is not UTF-8 text (byte 0x{raw[err.start]:02x} at byte {err.start + 1})")
    except ValueError as err:  # also NaN, Infinity: not JSON
        at = f" at column {err.colno}" if isinstance(err, json.JSONDecodeError) else ""
        return ValueError(f"is not valid JSON ({getattr(err, 'msg', err)}{at})")


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def where(lines: list[int] | None, i: int) -> str:
    return f"line {lines[i]}" if lines else f"row {i + 1}"


def _empty(value) -> bool:
    """None, [], {} or blank text: a required column's value that would make an empty prompt or gold."""
    return value is None or value in ([], {}) or isinstance(value, str) and not value.strip()


def is_a(value, kind) -> bool:
    """isinstance for a column's declared type: str, int (3.0 too), float, dict, list[T], A | B; a bool is none."""
    args = typing.get_args(kind)  # list[T]: (T,); A | B: (A, B); a plain type: ()
    if typing.get_origin(kind) is list:
        return isinstance(value, list) and all(is_a(each, args[0]) for each in value)
    if args:
        return any(is_a(value, each) for each in args)
    return not isinstance(value, bool) and (
        isinstance(value, kind) or kind is int and isinstance(value, float) and value.is_integer()
    )


def check_rows(rows, lines, columns: dict, source: str, who: str, hint: str) -> None:
    """The one gate for rows: DataError when `rows` lack a column, or a row a value of its column's type ({name:
    type}; a type that admits None is optional), or one of over MAX_ROW_CHARS."""
    required = [name for name, kind in columns.items() if not is_a(None, kind)]  # str | None: optional
    names = rows.column_names
    missing = [column for column in required if column not in names]
    if missing:
        raise DataError(
            f"{source} lacks column(s) {', '.join(missing)} needed by {who} (it has: {', '.join(names)}){hint}"
        )
    present = [column for column in columns if column in names]
    problems = [_row_problem(row, required, columns) for row in records(rows, present)]
    bad = [i for i, problem in enumerate(problems) if problem]  # all of them: the message counts them
    if bad:
        raise DataError(
            f"{source}: {where(lines, bad[0])} {problems[bad[0]]}; {len(bad)} of {len(rows)} rows are bad ({who} "
            f"needs {', '.join(required)} in every row){hint}"
        )


def records(rows, columns) -> list[dict]:
    """Each row as {column: value} of `columns` only, read a column at a time (as a Dataset reads fastest)."""
    return [dict(zip(columns, values)) for values in zip(*[rows[column] for column in columns])]


def _row_problem(row: dict, required: list, columns: dict) -> str | None:
    """Why one row fails the gate, or None: a required value missing, a value of another type, a huge string."""
    lacking = [name for name in required if _empty(row[name])]
    if lacking:
        return f"lacks a value for {', '.join(map(repr, lacking))}"
    wrong = [name for name, value in row.items() if not _empty(value) and not is_a(value, columns[name])]
    if wrong:
        kind = columns[wrong[0]]
        kind = kind.__name__ if isinstance(kind, type) else kind  # str, not <class 'str'>
        shown = json.dumps(row[wrong[0]], default=repr)
        cut = "..." if len(shown) > 80 else ""
        return f"has a {wrong[0]!r} that is not {kind}: {shown[:80]}{cut}"
    long = [name for name, value in row.items() if isinstance(value, str) and len(value) > MAX_ROW_CHARS]
    if long:  # a whole book in one cell would fill the context and the memory before any token is scored
        return (
            f"has a {long[0]!r} of {len(row[long[0]]):,} characters, over the "
            f"{MAX_ROW_CHARS:,} a row may hold (plumbing/data.py: MAX_ROW_CHARS)"
        )
    return None


@lru_cache(maxsize=2)  # a step's prompts may straddle two epochs: both permutations stay at hand
def epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def batch_indices(step: int, batch: int, n: int, seed: int, refill: int = 0) -> list[int]:
    """Prompts of `step` from a seeded permutation per epoch; refill round r reads one seeded by (seed, step, r)."""
    if refill:
        order = np.random.default_rng([seed, step, refill]).permutation(n)
        return [int(order[i % n]) for i in range(batch)]
    return [int(epoch_order(seed, pos // n, n)[pos % n]) for pos in range(step * batch, (step + 1) * batch)]
