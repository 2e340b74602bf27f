"""Inference convolutions as oneDNN primitives we hold: one per call site of
lowering/conv.py's ``conv_fused`` (``csrc/onednn_conv.cpp``, built on first use; the
cpu target installs :func:`make` as ``conv.direct_conv``).

ATen's ``mkldnn::_convolution_pointwise`` rebuilds its ideep descriptors, attributes and
its primitive-descriptor cache key on every call: at the zoo ResNet's sizes that is
~22-25 us a call above oneDNN's own execution (32 vs 10 us a 1x1 convolution, 75 vs 52 us
a 3x3 one, float32, one thread), as much as a small convolution. Holding the primitive and
the prepacked weight, a call is one ``execute``.

torch ships oneDNN's headers but not its symbols (``libtorch_cpu.so`` keeps them local),
so this links a oneDNN v3 install of its own: ``PYPTO_INDUCTOR_ONEDNN_DIR``, else the
Python environment's prefix (``include/dnnl.hpp``, ``lib/libdnnl.so``: what the
``onednn-cpu-gomp`` and ``onednn-devel-cpu-gomp`` wheels install, extra ``onednn``; GNU
OpenMP like torch, whose ``libgomp.so.1`` it then shares). Without one, or when the
build fails, :func:`make` returns None and conv.py calls ATen.

A primitive is made for one input shape and the thread count at that time (after a
``torch.set_num_threads``, conv.py makes another); its scratchpad is per thread.
"""
from __future__ import annotations

import ctypes
import os
import sys
import warnings
from pathlib import Path

import torch

ONEDNN_DIR_ENV = "PYPTO_INDUCTOR_ONEDNN_DIR"
_SOURCE = Path(__file__).with_name("csrc") / "onednn_conv.cpp"
# an NCHW-contiguous input (a net's image) reordered by oneDNN inside the call, not copied
# by ATen before it (4x3x32x32: ATen's copy has an inner dim of 3)
NCHW_INPUT_REORDER = True
_lib: list = []  # [the loaded library or None], once per process


def install_dir() -> str | None:
    """The oneDNN install to link: ``PYPTO_INDUCTOR_ONEDNN_DIR``, else the Python
    environment's prefix when the ``onednn`` extra put oneDNN there."""
    root = os.environ.get(ONEDNN_DIR_ENV)
    if not root and (Path(sys.prefix) / "lib" / "libdnnl.so").exists() and (
            Path(sys.prefix) / "include" / "dnnl.hpp").exists():
        root = sys.prefix
    return root or None


def library() -> ctypes.CDLL | None:
    if _lib:
        return _lib[0]
    lib = None
    root = install_dir()
    if root:
        from . import compiler
        inc, libdir = Path(root) / "include", Path(root) / "lib"
        try:
            lib = compiler.load_library(
                _SOURCE.read_text(), ("pconv_create", "pconv_run"),
                flags=(f"-I{inc}", f"-L{libdir}", "-Wl,--no-as-needed", "-ldnnl",
                       f"-Wl,-rpath,{libdir}"))
        except Exception as e:  # noqa: BLE001 - any build problem: ATen's path instead
            warnings.warn(f"pypto_inductor: direct oneDNN convolutions off ({e})")
            lib = None
        if lib is not None:
            lib.pconv_create.restype = ctypes.c_void_p
            lib.pconv_create.argtypes = [ctypes.c_int] + [ctypes.c_long] * 14 + [ctypes.c_int] * 3
            lib.pconv_packed_weight_bytes.restype = ctypes.c_long
            lib.pconv_packed_weight_bytes.argtypes = [ctypes.c_void_p]
            lib.pconv_pack_weight.argtypes = [ctypes.c_void_p] * 3
            lib.pconv_pack_weight.restype = None
            lib.pconv_run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 4
            lib.pconv_run.restype = None
            lib.pconv_destroy.argtypes = [ctypes.c_void_p]
            lib.pconv_destroy.restype = None
    _lib.append(lib)
    return lib


class DirectConv:
    """``y = act(conv(x, w) + b [+ other])`` for one input shape; ``x`` any layout (NCHW-
    contiguous goes through oneDNN's reorder), ``other`` channels-last contiguous, ``y``
    channels-last."""

    def __init__(self, lib, handle, packed, bias, out_shape, dtype):
        self._lib, self._handle = lib, handle
        self._packed, self._bias = packed, bias  # kept alive: the primitive reads them
        self._run = lib.pconv_run
        self._w = packed.data_ptr()
        self._b = None if bias is None else bias.data_ptr()
        n, c, h, w = out_shape
        self._shape, self._strides = out_shape, (c * h * w, 1, w * c, c)
        self._dtype = dtype
        # oneDNN splits the work for the thread count at creation: conv.py makes a new
        # primitive when torch's changes
        self.threads = torch.get_num_threads()

    def __call__(self, x: torch.Tensor, other: torch.Tensor | None) -> torch.Tensor:
        nhwc = x.is_contiguous(memory_format=torch.channels_last)
        nchw = not nhwc and NCHW_INPUT_REORDER and x.is_contiguous()
        if not (nhwc or nchw):
            x = x.contiguous(memory_format=torch.channels_last)
        y = torch.empty_strided(self._shape, self._strides, dtype=self._dtype)
        self._run(self._handle, x.data_ptr(), nchw, self._w, self._b,
                  None if other is None else other.data_ptr(), y.data_ptr())
        return y

    def __del__(self):
        handle, self._handle = self._handle, None
        if handle:
            try:
                self._lib.pconv_destroy(handle)
            except Exception:  # noqa: BLE001 - interpreter shutdown: nothing to free into
                pass


def make(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, stride, padding,
         dilation, groups: int, act: str, has_add: bool) -> DirectConv | None:
    """The primitive for ``x``'s shape with ``w`` (plain OIHW, BatchNorm folded) packed into
    it, or None: no library, an unsupported case, or oneDNN has no implementation."""
    if (act not in ("none", "relu") or x.dtype not in (torch.float32, torch.bfloat16)
            or x.dim() != 4):
        return None
    lib = library()
    if lib is None:
        return None
    n, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    handle = lib.pconv_create(int(x.dtype == torch.bfloat16), n, c, h, wd, o, kh, kw,
                              stride[0], stride[1], padding[0], padding[1], dilation[0],
                              dilation[1], groups, int(b is not None), int(act == "relu"),
                              int(has_add))
    if not handle:
        return None
    w = w.contiguous()
    packed = torch.empty(lib.pconv_packed_weight_bytes(handle), dtype=torch.uint8)
    lib.pconv_pack_weight(handle, w.data_ptr(), packed.data_ptr())
    if b is not None:
        b = b.detach().clone()  # a copy: nothing here keeps a model's parameter alive
    oh = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (wd + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    return DirectConv(lib, handle, packed, b, (n, o, oh, ow), x.dtype)
