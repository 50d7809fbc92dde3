"""train.py's held-out sets: the task's own test split, and the benchmarks --eval-tasks names (docs/eval.md).

    --eval-tasks math500,aime24                    # each from its hub dataset (tasks.py)
    --eval-tasks math500=path/to/math500.jsonl     # or from a local file with the task's columns, read whole

Each set is scored with its own task's verifier (similarity without one) at every evaluation of the run.
"""

import os

import torch

from plumbing.data import DataError
from plumbing.parallel import gather_rows


def parse_eval_tasks(text: str, registry: dict) -> list[tuple[str, str | None]]:
    """[(task name, local file or None)] of --eval-tasks "NAME[=FILE],..."; ValueError, one line, for a piece
    without a name, a task not in `registry` (tasks.TASKS), a name given twice or a file that does not exist."""
    sets = []
    for piece in filter(str.strip, text.split(",")):
        name, equals, path = (part.strip() for part in piece.partition("="))
        if name not in registry:
            raise ValueError(f"--eval-tasks: unknown task {name!r}: choose from {', '.join(registry)}")
        if equals and not os.path.isfile(path):
            raise ValueError(f"--eval-tasks: {name}'s file {path!r} does not exist")
        if name in (seen for seen, _ in sets):
            raise ValueError(f"--eval-tasks: {name} is given twice")
        sets.append((name, path if equals else None))
    return sets


def load_eval_sets(args, task, test_set: list, registry: dict) -> dict:
    """{set name: (task, examples)}: the task's own held-out rows (when any), then each --eval-tasks set of
    `registry` (tasks.TASKS), at most --eval-examples prompts each, shuffled by --seed as the task's own (eval.py
    --limit N --seed S loads the same)."""
    sets = {task.name: (task, test_set)} if test_set else {}
    for name, path in parse_eval_tasks(args.eval_tasks, registry):
        if name in sets:
            raise DataError(f"--eval-tasks: {name} is the task's own held-out set, scored already")
        other = registry[name]
        rows = other.load("test", data_file=path, limit=args.eval_examples, seed=args.seed)
        if not rows:
            raise DataError(f"--eval-tasks: {name} has no held-out rows" + (f" in {path}" if path else ""))
        sets[name] = (other, rows)
    return sets


def gather_samples(records: list[dict], field: str, size: int, K: int, device) -> torch.Tensor:
    """(n, K) float64: `field` ("reward", "passed") of the K samples of every rank's records (eval.evaluate's, this
    rank's block of a set), all ranks' in rank order. Each rank's block is padded to `size` rows of NaN for the
    gather, and those rows are dropped after it."""
    block = torch.full((size, K), torch.nan, dtype=torch.float64)  # (size, K)
    for j, record in enumerate(records):
        block[j] = torch.tensor([sample[field] for sample in record["samples"]], dtype=torch.float64)
    table = gather_rows(block, device)  # (world * size, K)
    return table[~table[:, 0].isnan()]
