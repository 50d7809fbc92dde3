"""Micro-batches cut by length, then agreed in count across ranks; the plain version cuts in sampling order.

python -m pytest tests/test_train.py -k micro_batch_grouping
"""

import torch
import torch.distributed as dist


# MEMORY TRICK: tests/test_train.py::test_micro_batch_grouping_keeps_the_update: rows of like length pad less, and
# the longest first lets every later micro-batch fit in the blocks the first freed
def micro_batch_rows(prompts, completions, rows, size) -> list[list[int]]:
    """`rows` in micro-batches of at most `size`, longest first."""

    def length(i):
        return len(completions[i]), len(prompts[i])

    rows = sorted(rows, key=length, reverse=True)
    return [rows[a : a + size] for a in range(0, len(rows), size)]


def agreed(rows: list[list[int]], device) -> list[list[int]]:
    """`rows`' micro-batches cut until this rank has as many as the rank with the most: FSDP2 runs its collectives
    once a micro-batch, so a rank with fewer would wait for the others forever."""
    count = torch.tensor(len(rows), device=device)
    if dist.is_initialized():
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return split_to(rows, int(count))


def split_to(rows: list[list[int]], count: int) -> list[list[int]]:
    """`rows` with the largest micro-batch halved until there are `count`. Every rank holds as many rows (config.py:
    --rollout-batch divides by ranks x minibatches), so another rank's count never exceeds this rank's rows."""
    rows = list(rows)
    while len(rows) < count:
        largest = max(range(len(rows)), key=lambda i: len(rows[i]))
        part = rows.pop(largest)
        half = len(part) // 2
        rows[largest:largest] = [part[:half], part[half:]]
    return rows
