"""A kernel's loop over work items written once for its parallel and serial branches
(emit_rows.ONE_BODY): a lambda over a range of work items, which the serial branch calls on
all of them and each thread of the ``omp parallel for`` on its part.

The lambda captures the kernel's variables by reference, and GCC does not hoist a captured
value's load out of an ``omp simd`` loop: a contiguous read ``in0[b0 + c]`` became a gather
through the reloaded pointer (a softmax forward, 512 x 64, one thread: 19.6 -> 66 us a
call). So the lambda first copies every kernel variable its loop names into a local of the
same type (``__restrict__`` kept), as the serial copy and OpenMP's outlined function see
them: the same loop code, the same bits.
"""
from __future__ import annotations

import re

# a declaration at the start of a statement: specifiers, a type, then the first declarator
_DECL = re.compile(
    r"(?:alignas\(\d+\)\s+)?(?:(?:static|thread_local|const|constexpr|unsigned|signed)\s+)*"
    r"(?P<type>[A-Za-z_][\w:]*(?:<[\w\s:,]*>)?)(?:\s*(?:\*\s*(?:const\s+)?)+|\s+)"
    r"(?:__restrict__\s+)?(?P<rest>[A-Za-z_]\w*\s*(?:\[[^\]]*\])?\s*(?:=(?!=)|;|,|\{).*)")
_DECLARATOR = re.compile(r"\s*\**\s*(?:__restrict__\s+)?([A-Za-z_]\w*)\s*(\[[^\]]*\])?\s*(?:=|\{|$)")
_NOT_TYPES = {"else", "return", "if", "for", "while", "do", "case", "goto", "delete", "throw",
              "typedef", "using", "switch", "break", "continue", "default", "new", "sizeof"}
_IDENT = re.compile(r"[A-Za-z_]\w*")
# the kernel function's parameters (prelude.py's signature) and their types
PARAMS = {"ptrs": "void* const*", "meta": "const int64_t*", "syms": "const int64_t*",
          "nt": "int"}


def _split_top(text: str, sep: str) -> list[str]:
    """``text`` split at the ``sep`` characters outside (), [] and {}."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def declared(lines: list[str]) -> dict[str, bool]:
    """The variables declared in ``lines`` (a function's statements from its opening line)
    still in scope after them: name -> whether it is an array."""
    scopes: list[dict[str, bool]] = [{}]
    for line in "\n".join(lines).split("\n"):
        code = line.split("//")[0].strip()
        if not code or code.startswith("#"):
            continue
        for statement in _split_top(code, ";")[:-1] if ";" in code else []:
            m = _DECL.fullmatch(statement.strip() + ";")
            if not m or m.group("type") in _NOT_TYPES:
                continue
            for part in _split_top(m.group("rest").rstrip(";"), ","):
                d = _DECLARATOR.match(part)
                if d:
                    scopes[-1][d.group(1)] = bool(d.group(2))
        for ch in code:
            if ch == "{":
                scopes.append({})
            elif ch == "}" and len(scopes) > 1:
                scopes.pop()
    out: dict[str, bool] = {}
    for scope in scopes:
        out.update(scope)
    return out


def local_copies(before: list[str], loop: list[str]) -> list[str]:
    """Lines for the lambda's top: each variable of ``before`` (the kernel's statements up to
    the loop) and each kernel parameter that ``loop`` names, copied into a local of its
    type; an array as a pointer to its first element. The copies open a block (closed by
    the caller after the loop)."""
    names = set(_IDENT.findall("\n".join(loop)))
    scope = {n: a for n, a in declared(before).items() if n in names}
    params = [n for n in PARAMS if n in names and n not in scope]
    out = [f"  const auto pi_c_{n} = {n};" for n in [*params, *sorted(scope)]]
    out.append("  {")
    out += [f"  {PARAMS[n]} const {n} = pi_c_{n};" for n in params]
    out += [f"  const auto {n} = pi_c_{n};" if scope[n] else
            f"  const decltype({n}) {n} = pi_c_{n};" for n in sorted(scope)]
    return out


def one_body(before: list[str], loop: list[str], count: str, condition: str,
             pragma: str) -> list[str]:
    """The loop over ``count`` work items (``loop``: its lines, the first ``for (int64_t
    wi = 0; wi < count; ++wi) {``) as a lambda over a range of them, then the branches:
    under ``condition`` an ``omp parallel for`` (``pragma``) over nt parts, else one call."""
    m = re.fullmatch(r"(\s*)for \(int64_t (\w+) = 0; \2 < (.+); \+\+\2\) \{", loop[0])
    assert m and m.group(3) == count, loop[0]
    v = m.group(2)
    return [
        "  {",  # a scope: a kernel may have several such loops (emit_columns' passes)
        "  auto pi_items = [&](int64_t pi_w0, int64_t pi_w1) __attribute__((noinline)) {",
        *local_copies(before, loop),
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
