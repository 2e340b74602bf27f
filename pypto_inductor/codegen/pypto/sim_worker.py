"""The simulator's worker process: simulates a batch of pypto kernels in pypto's SIM mode.

Run by :mod:`.sim` as ``python sim_worker.py JOB RESULTS LAUNCHER``: ``JOB`` is a
JSON list of kernels (``PyptoKernel.to_json()``, each with its index and working
folder), ``RESULTS`` a JSON-lines file it appends to (a "started" line, then the
kernel's result: stat report, program.json and Perfetto trace paths, or an error),
``LAUNCHER`` the path of :mod:`.launcher`, loaded by path: the package's
``__init__`` (Dynamo and all) is not needed here. Each kernel runs in its own
folder with its output redirected to ``sim.log``. After a failed kernel the worker
exits with code 3 (pypto keeps parser state after a failure); the caller starts a
fresh worker for the rest of the batch. Only the standard library is imported at
the top: torch and pypto are imported when the worker runs.
"""
import glob
import importlib.util
import json
import os
import re
import sys
import traceback


def _load_launcher(path: str):
    spec = importlib.util.spec_from_file_location("_pypto_inductor_launcher", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["_pypto_inductor_launcher"] = module
    spec.loader.exec_module(module)
    return module


def _error_text(e: BaseException) -> str:
    text = "".join(traceback.format_exception_only(type(e), e))
    lines = [line for line in text.splitlines()
             if line.strip() and not re.search(r"\+0x[0-9a-f]+\)", line)]
    return re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(lines[:8]))[:1500]


def main(job_path: str, results_path: str, launcher_path: str) -> None:
    job = json.load(open(job_path))
    results = open(results_path, "a", buffering=1)
    import torch  # noqa: F401  (imported before pypto, as the package does)
    import pypto  # noqa: F401

    launcher_module = _load_launcher(launcher_path)
    base = os.getcwd()
    for item in job:
        kernel = item["kernel"]
        work = os.path.join(base, item["dir"])
        os.makedirs(work, exist_ok=True)
        results.write(json.dumps({"index": item["index"], "started": True}) + "\n")
        log_path = os.path.join(work, "sim.log")
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        saved = os.dup(1), os.dup(2)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(log, 1)
        os.dup2(log, 2)
        out = {"index": item["index"]}
        try:
            os.chdir(work)
            launcher = launcher_module.PyptoLauncher.load(kernel, work)
            launcher(launcher.example_inputs())
        except BaseException as e:
            out["error"] = _error_text(e)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(log)
            os.chdir(base)
        reports = sorted(glob.glob(os.path.join(work, "output", "output_*",
                                                "CostModelSimulationOutput",
                                                "_simulate.stat.report.txt")))
        if reports:
            out["report"] = reports[-1]
            program = os.path.join(os.path.dirname(os.path.dirname(reports[-1])), "program.json")
            if os.path.exists(program):
                out["program"] = program
            # pypto 0.2.0 spells it "_simulate.pefetto.trace.json"; accept the fixed spelling
            traces = sorted(glob.glob(os.path.join(os.path.dirname(reports[-1]),
                                                   "*p*fetto*.json")))
            if traces:
                out["trace"] = traces[-1]
        out["log"] = log_path
        results.write(json.dumps(out) + "\n")
        if "error" in out:
            # pypto keeps parser state after a failed kernel ("function nested is not
            # allowed" for the next one): leave, and let a fresh worker take the rest.
            results.close()
            os._exit(3)


if __name__ == "__main__":
    # This file's folder (pypto_inductor/codegen/pypto) must not shadow top-level modules.
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]
    main(*sys.argv[1:4])
