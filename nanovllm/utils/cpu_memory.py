"""Keep freed memory in the process on CPU, so large step tensors reuse warm pages.

By default glibc serves every allocation above 128 KiB-32 MiB with a fresh mmap and unmaps it on
free, so each prefill activation or logits tensor is page-faulted in again, page by page; in this
VM that made an allocation-heavy loop 5x slower, and prefill ~10% slower (docs/performance.md, "glibc keeps freed memory").
The CPU platform returns freed memory at once while the weights load (return_freed_memory: each
tensor on its way from a file to its layer is unmapped when freed, so the heap never holds the
copies beside the weights and the peak is the weights plus one tensor), then, once they are held,
trims the heap and keeps freed memory from there on (keep_freed_memory).
"""
import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 1 << 30  # allocations up to 1 GiB come from the heap
TRIM_THRESHOLD_BYTES = 1 << 30  # and up to 1 GiB of free memory at the heap top is kept (C int)


def _libc():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") else None


LOAD_MMAP_THRESHOLD_BYTES = 1 << 20  # while loading: every allocation of 1 MiB or more is its own mapping


def return_freed_memory() -> bool:
    """Serve allocations from 1 MiB up with their own mappings, unmapped when freed (a fixed
    threshold: glibc's dynamic one rises to 32 MiB after the first such free, and the heap then
    keeps the freed copies); False where the C library has no mallopt."""
    libc = _libc()
    return libc is not None and libc.mallopt(M_MMAP_THRESHOLD, LOAD_MMAP_THRESHOLD_BYTES) == 1


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; False where the C library has no
    mallopt (not glibc) or refuses the values. Process-wide and idempotent."""
    libc = _libc()
    if libc is None:
        return False
    ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    ok = libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and ok
    if not ok:
        logger.info("mallopt refused the thresholds: large CPU tensors keep glibc's defaults")
    return ok


def release_freed_memory() -> bool:
    """Hand the heap's free pages back to the kernel (glibc's malloc_trim): called once after the
    weights are loaded, so the loading's transient copies (a dense checkpoint quantized at load, a
    GGUF file's tensors on their way to their layers) do not stay in the process's RSS under the
    raised trim threshold. False where the C library has no malloc_trim."""
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    libc.malloc_trim(0)
    return True
