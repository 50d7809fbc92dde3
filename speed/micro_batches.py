"""Micro-batches cut by length, then agreed in count across ranks; the plain version cuts in sampling order.

python -m pytest tests/test_train.py -k micro_batch_grouping
"""

import torch
import torch.distributed as dist


# MEMORY TRICK: tests/test_train.py::test_micro_batch_grouping_keeps_the_update: rows of like length pad less, and
# the longest first lets every later micro-batch fit in the blocks the first freed
def micro_batch_rows(prompts, completions, rows, size, budget=0) -> list[list[int]]:
    """`rows` in micro-batches of at most `size` sequences, longest first; a token `budget` > 0 also holds each to
    that many tokens as the padded batch computes them (its rows x (longest prompt + longest completion)), and a
    sequence longer than the budget gets a micro-batch of its own."""

    def length(i):
        return len(completions[i]), len(prompts[i])

    batches = []
    for i in sorted(rows, key=length, reverse=True):
        grown = [*batches[-1], i] if batches else [i]
        width = max(len(completions[j]) for j in grown) + max(len(prompts[j]) for j in grown)
        fits = len(grown) <= size and (budget == 0 or len(grown) * width <= budget)
        if batches and fits:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


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
