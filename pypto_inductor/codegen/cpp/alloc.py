"""Output buffers of the native CPU target.

glibc serves buffers of 32 MiB and more straight from mmap, so every call gets
fresh pages, and in a VM each first touch of a 4 KiB page is an expensive fault
(a large relu into a new tensor runs several times slower than into a reused one:
docs/benchmarks.md). So large outputs get ``madvise(MADV_HUGEPAGE)`` (one fault
per 2 MiB) before the kernel writes them; the advice is per buffer and dies with
it. :class:`BufferPool` keeps dead kernel outputs for later kernels, bounded by the
largest live peak of the compiled graphs.
"""
from __future__ import annotations

import ctypes
import sys
import threading

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
    """Dead native kernel outputs, kept for later kernels of any compiled graph.

    The runtime hands a kernel output back when its slot dies and nothing else holds it
    (``CompiledGraph.__call__``: no other reference, no view); a later kernel takes it
    instead of allocating: the same shape and dtype as it is, else the smallest dead
    buffer of at least its size (up to twice it), reinterpreted. Inside a block an
    allocation cost as much as a 1 MiB kernel's wrapper (glibc sorting the chunks the
    previous steps freed).

    What it holds is bounded: each compiled graph reserves its peak of live pooled
    buffers (at its current sizes, computed when it is built: ``CompiledGraph._pool_peak``),
    and the pool keeps at most the largest reservation of the graphs alive, dropping
    what is given back beyond it. One pool serves every graph of the process (a
    training step's forward and backward graphs take turns with the same buffers), so
    between calls it holds no more than the largest graph's live peak, which eager
    allocates anyway (docs/memory.md).
    """

    def __init__(self):
        self.free: dict[tuple, list[tuple[torch.Tensor, int]]] = {}  # (shape, dtype) -> (buffer, bytes)
        self.held = 0  # bytes of the buffers in ``free``
        self.cap = 0  # the largest reservation
        self.reserved: dict[int, int] = {}  # graph token -> its live peak in bytes
        self.misses = 0  # allocations the pool could not serve
        self.lock = threading.Lock()  # the kernels release the GIL: threads share the pool
        self._released: list[int] = []  # graph tokens gone, not yet applied (``release``)

    def reserve(self, token: int, nbytes: int) -> None:
        """A graph's live peak of pooled bytes (again when its sizes change)."""
        with self.lock:
            self.reserved[token] = nbytes
            self._apply_releases()
            self._set_cap()

    def release(self, token: int) -> None:
        """The graph is gone: its reservation no longer counts. Called by a finalizer,
        which the GC may run on a thread that holds the lock (inside ``empty``): so it
        only queues the token, and whoever holds the lock next applies it."""
        self._released.append(token)  # atomic under the GIL
        if self.lock.acquire(blocking=False):
            try:
                self._apply_releases()
            finally:
                self.lock.release()

    def _apply_releases(self) -> None:
        changed = False
        while self._released:
            changed |= self.reserved.pop(self._released.pop(), None) is not None
        if changed:
            self._set_cap()

    def _set_cap(self) -> None:
        self.cap = max(self.reserved.values(), default=0)
        if self.held > self.cap:  # largest first: fewest buffers to allocate again
            entries = sorted(((nb, key) for key, ts in self.free.items() for _, nb in ts),
                             key=lambda e: -e[0])
            for nb, key in entries:
                if self.held <= self.cap:
                    break
                ts = self.free[key]
                j = next(j for j, (_, n) in enumerate(ts) if n == nb)
                del ts[j]
                self.held -= nb
                if not ts:
                    del self.free[key]

    def empty(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        with self.lock:
            buffers = self.free.get((shape, dtype))
            if buffers:
                t, nb = buffers.pop()
                self.held -= nb
                return t
            t = self._best_fit(shape, dtype)
            if t is not None:
                return t
            self.misses += 1
        return empty(shape, dtype)

    def _best_fit(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor | None:
        need = dtype.itemsize
        for d in shape:
            need *= d
        best = None
        for key, ts in self.free.items():
            if ts and need <= ts[-1][1] <= 2 * need and (best is None or ts[-1][1] < best[1]):
                best = (key, ts[-1][1])
        if best is None:
            return None
        t, nb = self.free[best[0]].pop()
        self.held -= nb
        return torch.empty(0, dtype=dtype).set_(t.untyped_storage(), 0, shape,
                                                _contiguous.get(shape) or _strides(shape))

    def give(self, t: torch.Tensor) -> None:
        nb = t.untyped_storage().nbytes()
        with self.lock:
            self._apply_releases()
            if self.held + nb <= self.cap:  # else dropped: freed when the caller lets go
                self.free.setdefault((tuple(t.shape), t.dtype), []).append((t, nb))
                self.held += nb


POOL = BufferPool()  # the process's pool (``keep_buffers=True``)
