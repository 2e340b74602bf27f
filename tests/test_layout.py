"""The package's layout: imports point down the layers and never form a cycle, no module
uses another's private names, and every op table agrees with the op catalogue (ops.py).

Imports are read with ``ast`` from the source, so function-local imports and imports
under ``TYPE_CHECKING`` count like the others.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import pypto_inductor
from pypto_inductor import ops
from pypto_inductor.codegen import reference
from pypto_inductor.codegen.cpp import ops as cpp_ops
from pypto_inductor.codegen.pypto import ops as pypto_ops
from pypto_inductor.ir import OpKind
from pypto_inductor.lowering import pointwise

ROOT = Path(pypto_inductor.__file__).parent
REPO = ROOT.parent
PACKAGE = "pypto_inductor"

# Each top-level module or folder of the package, by layer: a module imports only from
# its own layer (without a cycle) or from the layers below.
LAYERS = [
    {"ir", "hardware", "sizes", "ops", "config", "progress"},
    {"lowering", "fusion"},
    {"codegen"},
    {"runtime", "calibrate", "graph_cache", "training_cache", "precompile"},
    {"report"},
    {"api", "backend"},
    {"__init__", "__main__", "cli", "models", "zoo"},
]
LAYER = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    name = ".".join(parts)
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, list[str], int]]:
    """(imported module, imported names, line) of every import statement of a module."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append((target, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
    return out


def _edges() -> dict[str, dict[str, int]]:
    """module -> {package module it imports: line}; ``from . import x`` is an edge to x."""
    edges: dict[str, dict[str, int]] = {m: {} for m in MODULES}
    for name, path in MODULES.items():
        for target, names, line in _imports(name, path):
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
            for t in subs or [target]:
                if t in MODULES and t != name:
                    edges[name].setdefault(t, line)
    return edges


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYER["__init__" if len(parts) == 1 else parts[1]]


def test_every_top_level_module_has_a_layer():
    tops = {m.split(".")[1] for m in MODULES if "." in m} | {"__init__"}
    assert tops <= set(LAYER), sorted(tops - set(LAYER))


def test_no_import_cycle():
    edges = _edges()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[str] = []

    def visit(u: str) -> None:
        state[u] = 1
        stack.append(u)
        for v in sorted(edges[u]):
            if state.get(v) == 1:
                cycles.append(" -> ".join(stack[stack.index(v):] + [v]))
            elif v not in state:
                visit(v)
        stack.pop()
        state[u] = 2

    for m in sorted(MODULES):
        if m not in state:
            visit(m)
    assert not cycles, "\n".join(cycles)


def test_imports_point_down_the_layers():
    bad = [f"{m}:{line} imports {t} (layer {_layer(t)} above {_layer(m)})"
           for m, targets in _edges().items() for t, line in targets.items()
           if _layer(t) > _layer(m)]
    assert not bad, "\n".join(bad)


def _ours(module: str, local: set[str]) -> bool:
    return module.split(".")[0] in local | {PACKAGE}


def _private_uses(path: Path, local: set[str]) -> list[str]:
    """Private names of our other modules that the file at ``path`` uses: imported by name,
    read as an attribute of a module it imported, or patched by name (setattr/setitem)."""
    tree = ast.parse(path.read_text())
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    aliases: set[str] = set()  # names bound to modules of ours
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            if not _ours(target, local):
                continue
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    out.append(f"{path.name}:{node.lineno} imports {target}.{a.name}")
                aliases.add(a.asname or a.name)  # a module, or a class or function of ours
        elif isinstance(node, ast.Import):
            for a in node.names:
                if _ours(a.name, local):
                    aliases.add(a.asname or a.name.split(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in aliases and node.attr.startswith("_") \
                and not node.attr.startswith("__"):
            out.append(f"{path.name}:{node.lineno} uses {node.value.id}.{node.attr}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("setattr", "setitem", "delattr") and len(node.args) >= 2 \
                and isinstance(node.args[0], ast.Name) and node.args[0].id in aliases \
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str) \
                and node.args[1].value.startswith("_") \
                and not node.args[1].value.startswith("__"):
            out.append(f"{path.name}:{node.lineno} patches {node.args[0].id}.{node.args[1].value}")
    return out


def test_no_private_name_is_used_outside_its_module():
    # test modules import each other by name (conftest puts tests/ on the path)
    local = {p.stem for p in (REPO / "tests").glob("*.py")} | {"tests", "benchmarks"}
    bad = []
    for path in MODULES.values():
        bad += _private_uses(path, set())
    for path in sorted((REPO / "tests").rglob("*.py")) + sorted((REPO / "benchmarks").glob("*.py")):
        bad += _private_uses(path, local)
    assert not bad, "\n".join(bad)


# --- the op catalogue ------------------------------------------------------------------------
def test_lowering_tables_agree_with_the_catalogue():
    for table, arity in ((pointwise.UNARY, 1), (pointwise.BINARY, 2)):
        for name in table.values():
            info = ops.OPS.get(name)
            assert info is not None, f"{name} is not in ops.OPS"
            assert (info.kind, info.arity) == (OpKind.ELEMENTWISE, arity), info


def test_lowerings_emit_only_catalogued_ops():
    """Every op name a lowering writes out (``ctx.emit("cast", ...)``,
    ``ctx.pointwise("add", ...)``, ``_reduce(ctx, "amax", ...)``) is in the catalogue."""
    named = set()
    for path in (ROOT / "lowering").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name)):
                fn = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
                args = node.args[1:] if fn == "_reduce" else node.args
                if fn in ("emit", "pointwise", "_reduce") and args \
                        and isinstance(args[0], ast.Constant) and isinstance(args[0].value, str):
                    named.add(args[0].value)
    assert named and named <= set(ops.OPS), sorted(named - set(ops.OPS))


def test_reference_runs_every_catalogued_op():
    assert set(reference.REFERENCE) == set(ops.OPS), \
        sorted(set(reference.REFERENCE) ^ set(ops.OPS))


@pytest.mark.parametrize("table", [cpp_ops.OPS, pypto_ops.OPS], ids=["cpp", "pypto"])
def test_target_op_tables_are_in_the_catalogue(table):
    assert set(table) <= set(ops.OPS), sorted(set(table) - set(ops.OPS))


def test_cpp_table_is_elementwise_and_its_float_ops_are_the_catalogue_s():
    assert {ops.OPS[n].kind for n in cpp_ops.OPS} <= {OpKind.ELEMENTWISE, OpKind.CAST}
    assert cpp_ops.FLOAT_ONLY == {n for n in cpp_ops.OPS if ops.OPS[n].float_only}


def test_flop_weights():
    assert ops.flop_weight("add") == 1 and ops.flop_weight("exp") > ops.flop_weight("sqrt") > 1
    assert all(info.flops >= 1 for info in ops.OPS.values())
