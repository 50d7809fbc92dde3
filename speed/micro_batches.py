"""Micro-batches cut by length; the plain version cuts in sampling order.

python -m pytest tests/test_train.py -k micro_batch_grouping
"""


def micro_batch_rows(prompts, completions, rows, size) -> list[list[int]]:
    """`rows` in micro-batches of at most `size`, longest first (later ones fit in freed blocks)."""
    rows = sorted(rows, key=lambda i: (len(completions[i]), len(prompts[i])), reverse=True)
    return [rows[a : a + size] for a in range(0, len(rows), size)]
