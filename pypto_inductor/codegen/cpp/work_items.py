"""A kernel's loop over work items written once for its parallel and serial branches
(emit_rows.ONE_BODY): a lambda over a range of work items, which the serial branch calls on
all of them and each thread of the ``omp parallel for`` on its part.

The lambda captures the kernel's variables by reference, and GCC does not hoist a captured
value's load out of an ``omp simd`` loop: a contiguous read ``in0[b0 + c]`` became a gather
through the reloaded pointer (a softmax forward, 512 x 64, one thread: 19.6 -> 66 us a
call). So the lambda first copies every kernel variable its loop names into a local of the
same type (``__restrict__`` kept), as the serial copy and OpenMP's outlined function see
them: the same loop code, the same bits. The emitter records each variable as it declares
it (:class:`KernelVar`, ``RowEmitter.declare_kernel_vars``): the C++ is not parsed back.
"""
from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class KernelVar:
    """A variable of the kernel function's scope (a parameter, or one its emitter declared
    before a loop over work items): what the lambda's local copy of it needs."""
    name: str
    ctype: str  # its type without a top-level const: "int64_t", "const float* __restrict__"
    array: bool = False  # an array of ctype (copied as a pointer to its first element)


# the kernel function's parameters (emit_rows' signature)
PARAMS = (KernelVar("ptrs", "void* const*"), KernelVar("meta", "const int64_t*"),
          KernelVar("syms", "const int64_t*"), KernelVar("nt", "int"))


def local_copies(kernel_vars, loop: list[str]) -> list[str]:
    """Lines for the lambda's top: each of ``kernel_vars`` (the kernel's variables in scope
    at the loop) that ``loop`` names, copied into a const local of its type (an array as
    a pointer to its first element). The copies open a block (closed by the caller after
    the loop)."""
    names = set(re.findall(r"[A-Za-z_]\w*", "\n".join(loop)))
    used = [v for v in kernel_vars if v.name in names]
    # the parameters, then the others by name: the copies' order steers GCC's register
    # allocation, and this one keeps the object code the kernels were measured with
    used = [v for v in PARAMS if v in used] + sorted(
        (v for v in used if v not in PARAMS), key=lambda v: v.name)
    out = [f"  const auto pi_c_{v.name} = {v.name};" for v in used]
    out.append("  {")
    out += [f"  {v.ctype}{'*' if v.array else ''} const {v.name} = pi_c_{v.name};"
            for v in used]
    return out


def one_body(kernel_vars, loop: list[str], count: str, condition: str,
             pragma: str) -> list[str]:
    """The loop over ``count`` work items (``loop``: its lines, the first ``for (int64_t
    wi = 0; wi < count; ++wi) {``) as a lambda over a range of them, then the branches:
    under ``condition`` an ``omp parallel for`` (``pragma``) over nt parts, else one call.
    ``kernel_vars``: the kernel's variables in scope at the loop (local_copies)."""
    m = re.fullmatch(r"(\s*)for \(int64_t (\w+) = 0; \2 < (.+); \+\+\2\) \{", loop[0])
    assert m and m.group(3) == count, loop[0]
    v = m.group(2)
    return [
        "  {",  # a scope: a kernel may have several such loops (emit_columns' passes)
        "  auto pi_items = [&](int64_t pi_w0, int64_t pi_w1) __attribute__((noinline)) {",
        *local_copies(kernel_vars, loop),
        # the range lies in [0, count), as the loop's did: GCC still derives a row's indices
        # from wi without the divisions and products per row (a pointwise RMSNorm part, 512
        # x 64, one thread: 1.99 -> 1.89 us a call, the serial copy's 1.92)
        f"  if (pi_w0 < 0 || pi_w1 > {count}) __builtin_unreachable();",
        f"{m.group(1)}for (int64_t {v} = pi_w0; {v} < pi_w1; ++{v}) {{", *loop[1:],
        "  }",  # the copies' block
        "  };",
        f"  if ({condition}) {{", pragma,
        "  for (int64_t pi_k = 0; pi_k < nt; ++pi_k)",
        f"    pi_items({count} * pi_k / nt, {count} * (pi_k + 1) / nt);",
        "  } else {", f"    pi_items(0, {count});", "  }",
        "  }"]
