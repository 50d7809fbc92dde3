"""The CPU allocator: glibc keeps freed pages for reuse, and gives them back once a step.

The plain version is glibc's default (large blocks mapped and unmapped afresh). Only the allocator changes,
never a number computed: tests/test_train.py::test_keep_freed_memory_stops_refaulting_large_blocks and
test_release_freed_memory_hands_kept_pages_back. train.py turns both on where there is no GPU.
"""


# ---- SPEED TRICK (skippable): glibc keeps freed memory; only the allocator changes, no number computed
# (tests/test_train.py::test_keep_freed_memory_stops_refaulting_large_blocks checks that the pages are reused)
def keep_freed_memory() -> bool:
    """Ask glibc to serve large blocks from its heap and never hand freed memory back to the OS.

    By default every block over the mmap threshold is a fresh mapping, so each micro-batch's logits and
    log-prob chunks (50-100 MB each) are page-faulted and zeroed anew, and the kernel's page faulting
    becomes a large share of an update step. Reusing the heap's pages avoids that; the cost is that the
    heap never shrinks, so resident memory stays at its high-water mark.
    A no-op (False) where the C library is not glibc.
    """
    import ctypes

    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # malloc.h
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


# ---- MEMORY TRICK (skippable): free heap pages back to the OS once a step; only the allocator changes
# (tests/test_train.py::test_release_freed_memory_hands_kept_pages_back)
def release_freed_memory() -> bool:
    """Hand the pages of glibc's free blocks back to the OS now (malloc_trim); False where not glibc.

    keep_freed_memory's heap otherwise keeps every page it ever touched, and what sampling frees (the
    sampler's weights, KV cache, logits) does not fit training's allocations, which then take new pages
    beside it: resident memory creeps up step after step. train.py calls this once a step, after the
    sampler sleeps. The cost is page faults: training touches its pages afresh each step (measured in
    the README's memory breakdown), instead of only the first time.
    """
    import ctypes

    try:
        malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    malloc_trim(0)
    return True
