"""Micro-batches cut by length; the plain version cuts in sampling order.

python -m pytest tests/test_train.py -k micro_batch_grouping
"""


# MEMORY TRICK: tests/test_train.py::test_micro_batch_grouping_keeps_the_update: rows of like length pad less, and
# the longest first lets every later micro-batch fit in the blocks the first freed
def micro_batch_rows(prompts, completions, rows, size) -> list[list[int]]:
    """`rows` in micro-batches of at most `size`, longest first."""

    def length(i):
        return len(completions[i]), len(prompts[i])

    rows = sorted(rows, key=length, reverse=True)
    return [rows[a : a + size] for a in range(0, len(rows), size)]
