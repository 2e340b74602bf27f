"""How Python calls a compiled kernel: through a small CPython extension, else ctypes.

Through ctypes, filling the pointer array and converting the arguments cost a
noticeable part of a small kernel's call (docs/runtime_overhead.md). The extension's ``call(fn, tensors, meta, syms, nt)`` takes the
kernel's address, a tuple of tensors (inputs then outputs), the address of the
metadata array and the size symbols (an array's address, or the graph code's tuple of
their values: then a layout entry does not depend on symbols the kernel's shapes do
not hold), reads each data pointer with the function torch exports for
Inductor's own kernel bindings
(``torch._C._dynamo.guards._torchinductor_pyobject_tensor_data_ptr``, no torch
headers needed) and runs the kernel with the GIL released. ``call_status`` does the
same for a kernel scanning indices: it gives the kernel a status of its own and
returns it (nonzero: which index check failed). It is built once per
machine into the kernel cache (well under a second). Without Python's
headers, a compiler, or that torch function, kernels are called through ctypes.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import sysconfig
from pathlib import Path

import torch

from . import compiler

_SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <cstdint>

typedef void (*pi_kernel_t)(void* const*, const int64_t*, const int64_t*, int);
static void* (*pi_data_ptr)(PyObject*) = nullptr;
static const Py_ssize_t PI_MAX_TENSORS = 256;
static const Py_ssize_t PI_MAX_SYMS = 64;

// call(fn, tensors, meta, syms, nt[, offsets]): fn(data pointers of tensors, meta, syms, nt);
// syms is an int64 array's address or a tuple of ints; offsets (bytes) move the pointers.
// With status (call_status), the kernel gets one more pointer, to an int64 on this call's
// stack (an index scan's result: indexing.index_prologue), returned as the call's value:
// no tensor, no .item() and nothing shared between threads.
static PyObject* pi_run(PyObject* const* args, Py_ssize_t nargs, bool status) {
  if ((nargs != 5 && nargs != 6) || !PyTuple_CheckExact(args[1]) || pi_data_ptr == nullptr) {
    PyErr_SetString(PyExc_TypeError, "call(fn, tensors: tuple, meta, syms, nt[, offsets])");
    return nullptr;
  }
  PyObject* tensors = args[1];
  const Py_ssize_t n = PyTuple_GET_SIZE(tensors);
  // per tensor, bytes to add to its data pointer: a view passed as its base (with
  // status, one more entry may stand for the status and is not read)
  PyObject* offsets = nargs == 6 ? args[5] : nullptr;
  if (offsets != nullptr && (!PyTuple_CheckExact(offsets) ||
                             (PyTuple_GET_SIZE(offsets) != n &&
                              !(status && PyTuple_GET_SIZE(offsets) == n + 1)))) {
    PyErr_SetString(PyExc_TypeError, "offsets: a tuple of one int per tensor");
    return nullptr;
  }
  if (n + 1 > PI_MAX_TENSORS) {
    PyErr_SetString(PyExc_ValueError, "too many tensors for one kernel call");
    return nullptr;
  }
  const auto fn = reinterpret_cast<pi_kernel_t>(PyLong_AsVoidPtr(args[0]));
  const auto meta = static_cast<const int64_t*>(PyLong_AsVoidPtr(args[2]));
  // the size symbols: an array's address, or the tuple of their values itself
  int64_t values[PI_MAX_SYMS] = {0};
  const int64_t* syms = values;
  if (PyTuple_CheckExact(args[3])) {
    const Py_ssize_t m = PyTuple_GET_SIZE(args[3]);
    if (m > PI_MAX_SYMS) {
      PyErr_SetString(PyExc_ValueError, "too many size symbols for one kernel call");
      return nullptr;
    }
    for (Py_ssize_t i = 0; i < m; ++i) values[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(args[3], i));
  } else {
    syms = static_cast<const int64_t*>(PyLong_AsVoidPtr(args[3]));
  }
  const int nt = static_cast<int>(PyLong_AsLong(args[4]));
  if (PyErr_Occurred()) return nullptr;
  void* ptrs[PI_MAX_TENSORS];
  for (Py_ssize_t i = 0; i < n; ++i) ptrs[i] = pi_data_ptr(PyTuple_GET_ITEM(tensors, i));
  if (offsets != nullptr) {
    for (Py_ssize_t i = 0; i < n; ++i)
      ptrs[i] = static_cast<char*>(ptrs[i]) + PyLong_AsSsize_t(PyTuple_GET_ITEM(offsets, i));
    if (PyErr_Occurred()) return nullptr;
  }
  int64_t code = 0;
  if (status) ptrs[n] = &code;
  Py_BEGIN_ALLOW_THREADS
  fn(ptrs, meta, syms, nt);
  Py_END_ALLOW_THREADS
  if (status) return PyLong_FromLongLong(code);
  Py_RETURN_NONE;
}

static PyObject* pi_call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return pi_run(args, nargs, false);
}

static PyObject* pi_call_status(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return pi_run(args, nargs, true);
}

static PyObject* pi_set_data_ptr(PyObject*, PyObject* address) {
  pi_data_ptr = reinterpret_cast<void* (*)(PyObject*)>(PyLong_AsVoidPtr(address));
  if (PyErr_Occurred()) return nullptr;
  Py_RETURN_NONE;
}

static PyMethodDef pi_methods[] = {
  {"call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(pi_call)),
   METH_FASTCALL, nullptr},
  {"call_status", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(pi_call_status)),
   METH_FASTCALL, nullptr},
  {"set_data_ptr", pi_set_data_ptr, METH_O, nullptr},
  {nullptr, nullptr, 0, nullptr}};
static PyModuleDef pi_module = {PyModuleDef_HEAD_INIT, "pi_native_call", nullptr, -1,
                                pi_methods};
PyMODINIT_FUNC PyInit_pi_native_call(void) { return PyModule_Create(&pi_module); }
"""

state: dict = {}  # "call": the extension's call, or None when unavailable


def _build():
    data_ptr = getattr(getattr(torch._C, "_dynamo", None) and torch._C._dynamo.guards,
                       "_torchinductor_pyobject_tensor_data_ptr", None)
    include = sysconfig.get_paths().get("include")
    if data_ptr is None or not include or not (Path(include) / "Python.h").exists():
        return None
    lib = compiler.load_library(_SOURCE, ("PyInit_pi_native_call",), flags=(f"-I{include}",))
    loader = importlib.machinery.ExtensionFileLoader("pi_native_call", lib._name)
    spec = importlib.util.spec_from_file_location("pi_native_call", lib._name, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    module.set_data_ptr(data_ptr)
    state["call_status"] = module.call_status
    return module.call


def extension_call():
    """The extension's ``call``, built on first use; None where it cannot be built."""
    if "call" not in state:
        try:
            state["call"] = _build()
        except Exception:  # noqa: BLE001 - no headers, compile error, ...: ctypes then
            state["call"] = None
    return state["call"]


def extension_call_status():
    """The extension's ``call_status`` (``call`` that passes the kernel a status int64 of
    its own and returns it), or None where the extension cannot be built."""
    return state.get("call_status") if extension_call() is not None else None
