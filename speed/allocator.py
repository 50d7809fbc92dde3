"""glibc keeps freed pages and returns them once a step; the plain version re-mmaps large blocks.

python -m pytest tests/test_train.py -k "freed_memory"
"""

import ctypes


def _glibc(name: str):
    """glibc's function `name`, or None."""
    try:
        return getattr(ctypes.CDLL("libc.so.6"), name)
    except (OSError, AttributeError):
        return None


# SPEED TRICK: tests/test_train.py::test_keep_freed_memory_stops_refaulting_large_blocks: glibc mmaps each large block
# afresh and unmaps it when freed, so every step page-faults its activations in again
def keep_freed_memory() -> bool:
    """Serve large blocks from the heap and keep freed memory; False where not glibc."""
    mallopt = _glibc("mallopt")
    M_TRIM_THRESHOLD = -1  # malloc.h
    M_MMAP_MAX = -4
    return mallopt is not None and bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


# MEMORY TRICK: tests/test_train.py::test_release_freed_memory_hands_kept_pages_back: what keep_freed_memory keeps
# would otherwise only grow
def release_freed_memory() -> bool:
    """malloc_trim: stops resident memory creeping up; False where not glibc."""
    if (malloc_trim := _glibc("malloc_trim")) is not None:
        malloc_trim(0)
    return malloc_trim is not None
