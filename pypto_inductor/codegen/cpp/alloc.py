"""Output buffers of the native CPU target.

glibc serves buffers of 32 MiB and more straight from mmap, so every call gets
fresh pages, and in a VM each first touch of a 4 KiB page is an expensive fault
(a large relu into a new tensor runs several times slower than into a reused one:
docs/benchmarks.md). So large outputs get ``madvise(MADV_HUGEPAGE)`` (one fault
per 2 MiB) before the kernel writes them; the advice is per buffer and dies with
it. :class:`BufferPool` keeps a compiled graph's kernel outputs for its next calls.
"""
from __future__ import annotations

import ctypes
import sys

import torch

HUGE_PAGE = 2 << 20
MIN_ADVISED_BYTES = 4 << 20  # below this the faults cost less than the syscall saves
_MADV_HUGEPAGE = 14


def _thp_madvise_mode() -> bool:
    """True when the kernel gives huge pages on request (``[madvise]`` mode)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[madvise]" in f.read()
    except OSError:
        return False


def _madvise():
    if not sys.platform.startswith("linux") or not _thp_madvise_mode():
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _madvise()


# torch.empty parses its arguments in Python's arg parser; Inductor's allocator entry point
# takes the strides ready-made, at a fraction of the cost (docs/runtime_overhead.md).
# Strides (torch's, a size-0 dim counting as 1) are cached per shape: the call path
# has no room for sizes.contiguous_strides' sympy.
empty_strided_cpu = getattr(getattr(torch._C, "_dynamo", None) and torch._C._dynamo.guards,
                            "_empty_strided_cpu", None)
_contiguous: dict[tuple, tuple] = {}


def _strides(shape: tuple) -> tuple:
    strides, n = [], 1
    for d in reversed(shape):
        strides.append(n)
        n *= max(d, 1)
    if len(_contiguous) > 1024:
        _contiguous.clear()
    stride = _contiguous[shape] = tuple(reversed(strides))
    return stride


def empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """torch.empty, with huge pages advised for the 2 MiB-aligned part of large buffers."""
    if empty_strided_cpu is not None and type(shape) is tuple:
        out = empty_strided_cpu(shape, _contiguous.get(shape) or _strides(shape), dtype)
    else:
        out = torch.empty(shape, dtype=dtype)
    if _MADVISE is not None:
        nbytes = out.numel() * out.element_size()
        if nbytes >= MIN_ADVISED_BYTES:
            start = (out.data_ptr() + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
            end = (out.data_ptr() + nbytes) & ~(HUGE_PAGE - 1)
            if end > start:
                _MADVISE(start, end - start, _MADV_HUGEPAGE)  # advice only: errors ignored
    return out


class BufferPool:
    """Output buffers of one compiled graph's native kernels, kept for its next calls.

    The runtime hands a kernel output back when its slot dies and nothing else holds it
    (``CompiledGraph.__call__``: no other reference, no view); a later kernel wanting the same shape and dtype takes it
    instead of allocating. Inside a block an allocation cost as much as a 1 MiB kernel's
    wrapper (glibc sorting the chunks the previous steps freed). The pool holds
    at most the graph's peak of live kernel outputs, and is emptied when the size
    symbols change, so calls at many sizes do not pile up buffers.
    """

    def __init__(self):
        self.free: dict[tuple, list[torch.Tensor]] = {}
        self.syms: tuple | None = None
        self.misses = 0  # allocations the pool could not serve

    def start(self, syms: tuple) -> None:
        """Called before each run of the graph with its size symbols."""
        if syms != self.syms:
            self.free.clear()
            self.syms = syms

    def empty(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        buffers = self.free.get((shape, dtype))
        if buffers:
            return buffers.pop()
        self.misses += 1
        return empty(shape, dtype)

    def give(self, t: torch.Tensor) -> None:
        self.free.setdefault((tuple(t.shape), t.dtype), []).append(t)
