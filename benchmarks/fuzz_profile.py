"""``python -m benchmarks.fuzz_profile FIRST N``: where a fuzz case's time goes.

Runs ``tests.fuzz.runner.run_case`` on seeds FIRST .. FIRST+N-1 in this process and
reports, per phase, wall time and CPU time (this process's plus its children's, the g++
builds: on a loaded machine wall time is mostly waiting). Each phase is timed by a
wrapper around one function, outermost call only, so phases nest (Dynamo's ``_compile``
includes our ``compile_graph``, which includes g++). Use a fresh
``PYPTO_INDUCTOR_CACHE_DIR`` to see the cold cost; figures in docs/fuzz.md, "Throughput".
"""
from __future__ import annotations

import collections
import os
import sys
import time
import warnings


def _cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    first, n = int(argv[0]), int(argv[1])
    warnings.simplefilter("ignore")
    os.environ.setdefault("PYPTO_INDUCTOR_NO_CALIBRATE", "1")
    os.environ.setdefault("PYPTO_INDUCTOR_COMPILE_JOBS", "1")
    os.environ.setdefault("PYPTO_INDUCTOR_PCH", "1")  # as the fuzz workers
    start = time.monotonic()
    import torch  # noqa: F401
    import_torch = time.monotonic() - start
    import torch._dynamo.convert_frame as convert_frame
    import torch._inductor.compile_fx as compile_fx

    from pypto_inductor import backend
    from pypto_inductor.codegen.cpp import compiler
    from tests.fuzz import check, generator, runner
    imports = time.monotonic() - start

    wall, cpu, depth = collections.Counter(), collections.Counter(), collections.Counter()
    fallbacks = []

    def wrap(module, name, label):
        real = getattr(module, name)

        def timed(*args, **kwargs):
            outer = depth[label] == 0
            depth[label] += 1
            w0, c0 = time.monotonic(), _cpu()
            try:
                result = real(*args, **kwargs)
                if label.startswith("shared") and not result:
                    fallbacks.append(args[0].seed)
                return result
            finally:
                depth[label] -= 1
                if outer:
                    wall[label] += time.monotonic() - w0
                    cpu[label] += _cpu() - c0
        setattr(module, name, timed)
        return timed

    runner.generate = wrap(generator, "generate", "generator (incl. its validation)")
    wrap(generator, "_validated", "generator's validation runs")
    wrap(check, "reference", "check.reference (all calls)")
    wrap(check, "compare_runs", "comparisons")
    wrap(convert_frame, "_compile", "Dynamo (incl. AOTAutograd and our compile)")
    wrap(backend, "compile_graph", "our compile_graph (incl. g++)")
    wrap(compiler, "compile_library", "g++")
    wrap(runner, "check_shared", "shared check (both targets, one trace)")
    wrap(runner, "check_program", "separate compiles (fallback, upstream check)")
    wrap(runner, "shrink", "shrinking")
    wrap(compile_fx, "compile_fx", "Inductor")

    per, w0, c0 = [], time.monotonic(), _cpu()
    for seed in range(first, first + n):
        t = time.monotonic()
        result = runner.run_case(seed)
        per.append((seed, round(time.monotonic() - t, 2), len(result.failures)))
    total_wall, total_cpu = time.monotonic() - w0, _cpu() - c0
    print(f"import torch {import_torch:.2f} s, all imports {imports:.2f} s (wall, once a worker)")
    print(f"{n} cases: {total_wall:.1f} s wall ({60 * n / total_wall:.1f} cases/min), "
          f"{total_cpu:.1f} s CPU ({total_cpu / n:.2f} s a case)")
    for label in sorted(wall, key=lambda k: -cpu[k]):
        print(f"  {label:48s} wall {wall[label]:7.1f} s {100 * wall[label] / total_wall:5.1f}%"
              f"   CPU {cpu[label]:7.1f} s {100 * cpu[label] / total_cpu:5.1f}%")
    print("shared check fell back on seeds:", sorted(set(fallbacks)) or "none")
    print("per case (seed, wall s, failures):", per)
    return 0


if __name__ == "__main__":
    sys.exit(main())
