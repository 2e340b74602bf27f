"""The opt-in precompiled prelude headers (codegen/cpp/pch.py) build the same library."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from pypto_inductor.codegen.cpp import compiler, pch
from pypto_inductor.codegen.cpp.prelude import PRELUDE

SOURCE = PRELUDE + 'extern "C" int64_t pi_test_pow(int64_t b, int64_t e) { return pi_ipow(b, e); }\n'


def _text(so) -> str:
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(so)], capture_output=True,
                         text=True, check=True).stdout
    return out.split("\n", 3)[3]  # past the file name line


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) not installed")
def test_precompiled_header_builds_the_same_library(tmp_path, monkeypatch):
    found = compiler.find_compiler()
    if found is None or "clang" in found[1].lower():
        pytest.skip("g++ only (clang's precompiled headers are another format)")
    monkeypatch.setenv("PYPTO_INDUCTOR_PCH", "0")
    assert pch.flags(found, (), SOURCE, tmp_path) == []
    compiler.compile_library(SOURCE, found, tmp_path / "plain.so")
    monkeypatch.setenv("PYPTO_INDUCTOR_PCH", "1")
    used = pch.flags(found, (), SOURCE, tmp_path)
    assert used and used[0] == "-include"
    assert (tmp_path / "pch").rglob("pi_std.h.gch").__next__().stat().st_size > 0
    assert pch.flags(found, (), "#include <Python.h>\n" + SOURCE, tmp_path) == []  # not ours
    compiler.compile_library(SOURCE, found, tmp_path / "pch.so")
    assert _text(tmp_path / "plain.so") == _text(tmp_path / "pch.so")


def test_header_built_at_the_second_prelude_library_by_default(tmp_path, monkeypatch):
    """PYPTO_INDUCTOR_PCH unset (pch.AUTO): with AUTO_AFTER 1 a process's first library with
    the prelude into a cache directory compiles without the header, the second builds and
    takes it; a new process (fresh state) takes an existing header at once; with AUTO off,
    never."""
    found = compiler.find_compiler()
    if found is None or "clang" in found[1].lower():
        pytest.skip("g++ only (clang's precompiled headers are another format)")
    monkeypatch.delenv("PYPTO_INDUCTOR_PCH", raising=False)
    monkeypatch.setattr(pch, "headers", {})
    monkeypatch.setattr(pch, "prelude_compiles", {})
    monkeypatch.setattr(pch, "AUTO", False)
    assert pch.flags(found, (), SOURCE, tmp_path) == []
    assert pch.flags(found, (), SOURCE, tmp_path) == []
    assert not (tmp_path / "pch").exists()
    monkeypatch.setattr(pch, "AUTO", True)
    monkeypatch.setattr(pch, "AUTO_AFTER", 1)
    monkeypatch.setattr(pch, "prelude_compiles", {})
    assert pch.flags(found, (), SOURCE, tmp_path) == []
    assert not (tmp_path / "pch").exists()
    used = pch.flags(found, (), SOURCE, tmp_path)
    assert used and used[0] == "-include"
    assert pch.flags(found, (), SOURCE, tmp_path) == used
    monkeypatch.setattr(pch, "headers", {})  # a new process: the header is there already
    monkeypatch.setattr(pch, "prelude_compiles", {})
    assert pch.flags(found, (), SOURCE, tmp_path) == used
    shutil.rmtree(tmp_path / "pch")  # removed with its cache: not named again
    assert pch.flags(found, (), SOURCE, tmp_path) == used  # (rebuilt: the 2nd library here)
    assert (tmp_path / "pch").exists()
