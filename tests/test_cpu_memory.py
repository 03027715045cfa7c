"""keep_freed_memory(): large CPU tensors come from glibc's heap and stay there once freed, so the
next step reuses warm pages instead of faulting in a fresh mmap (checked with mallinfo2)."""
import ctypes
import ctypes.util

import pytest
import torch

from nanovllm.utils.cpu_memory import keep_freed_memory


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                 "fordblks", "keepcost")]


def glibc():
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallinfo2"):
        pytest.skip("not glibc >= 2.33")
    libc.mallinfo2.restype = MallInfo2
    return libc


def test_large_tensors_come_from_the_heap_and_stay():
    libc = glibc()
    assert keep_freed_memory()
    size = 200 << 20
    mmapped_before = libc.mallinfo2().hblkhd
    t = torch.empty(size, dtype=torch.uint8)
    t.fill_(1)
    assert libc.mallinfo2().hblkhd - mmapped_before < size  # not its own mmap
    arena_in_use = libc.mallinfo2().arena
    assert arena_in_use >= size
    del t
    assert libc.mallinfo2().arena >= size  # freed, but not trimmed back to the OS
    assert libc.mallinfo2().arena >= arena_in_use - (1 << 20)
