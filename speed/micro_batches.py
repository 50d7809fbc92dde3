"""Micro-batches cut by length (train.py: ppo_update), so that little compute goes to padding.

The plain version cuts the rows in sampling order. The loss has one denominator per minibatch, so the grouping does
not change the update: tests/test_train.py::test_micro_batch_grouping_keeps_the_update and
test_every_loss_agg_is_invariant_to_micro_batches hold it to the whole minibatch in one pass.
"""


def micro_batch_rows(prompts, completions, rows, size) -> list[list[int]]:
    """`rows` cut into micro-batches of at most `size`, sorted by length so that little compute goes to padding.
    The loss has one denominator per minibatch, so the grouping does not change it (tests/test_train.py::
    test_micro_batch_grouping_keeps_the_update, and test_every_loss_agg_is_invariant_to_micro_batches).
    Longest first: each later micro-batch's activations then fit in the blocks the earlier ones freed, where
    shortest first needs slightly larger blocks every time and the CPU heap grows beside the old ones."""
    rows = sorted(rows, key=lambda i: (len(completions[i]), len(prompts[i])), reverse=True)
    return [rows[a:a + size] for a in range(0, len(rows), size)]
