"""The host-value worker: runs one pypto kernel through pypto's host interpreter.

Run by :mod:`.verify` as ``python verify_worker.py JOB``. ``JOB`` (JSON) names the
calculator library, the launcher module (loaded by path, as :mod:`.sim_worker`
does), a JSON-lines results file, whether to run pypto's per-pass checks, and
the kernels (``PyptoKernel.to_json()``), each with its folder, a ``torch.save``
file of inputs and goldens and where to save its outputs. pypto writes its
``verify_result_brief.csv`` files only when the process exits (the caller reads
them then); after a failed kernel the worker exits with code 3 (pypto keeps
parser state) and the caller starts a fresh one for the rest.

Why the patch below: in jit mode pypto registers "host copies" of the kernel's
arguments for its interpreter with ``CopyToHost``, which does nothing without an
NPU, so the interpreter would run on zeros. In SIM mode the tensors already
live on the host: registering them as they are makes the interpreter compute
real values into the kernel's own output buffers.
"""
import ctypes
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


def _register_host_tensors() -> None:
    import pypto
    from pypto import pypto_impl
    from pypto.frontend.parser import entry
    from pypto.runtime import _pto_verify_datas

    def setup_verify_data(pto_tensors) -> None:
        if not pypto.get_verify_options().get("enable_pass_verify"):
            return
        pypto_impl.SetVerifyData(entry._pto_to_tensor_data(pto_tensors), [],
                                 _pto_verify_datas.get_data())

    entry.JitCallableWrapper._setup_verify_data = staticmethod(setup_verify_data)


def main(job_path: str) -> None:
    job = json.load(open(job_path))
    import torch
    import pypto

    # The calculator (pypto's torch op library) must be global: the interpreter looks up
    # GetCalcOps in the process. Mark it loaded so pypto does not rebuild it in a temp dir.
    ctypes.CDLL(job["calculator"], mode=ctypes.RTLD_GLOBAL)
    from pypto._utils import BuildOnlineManager
    BuildOnlineManager().calculator_loaded = True
    _register_host_tensors()
    launcher_module = _load_launcher(job["launcher"])
    base = os.getcwd()
    results = open(job["results"], "a", buffering=1)
    for item in job["items"]:
        work = os.path.join(base, item["dir"])
        os.makedirs(work, exist_ok=True)
        results.write(json.dumps({"index": item["index"], "started": True}) + "\n")
        opts = {"enable_pass_verify": True, "pass_verify_error_tol": item["tol"]}
        if not job["per_pass"]:
            opts["pass_verify_pass_filter"] = []  # the whole-tensor graph only
        pypto.set_verify_options(**opts)
        data = torch.load(item["data"])
        out = {"index": item["index"]}
        try:
            os.chdir(work)
            launcher = launcher_module.PyptoLauncher.load(item["kernel"], work)
            # pypto's own verdict against our reference output as the golden
            pypto.set_verify_golden_data(goldens=[None] * len(data["inputs"]) + [
                g.to(getattr(torch, p["dtype"])).contiguous().reshape(
                    [int(d) for d in p["shape"]])
                for g, p in zip(data["goldens"], launcher.outputs)])
            outs = launcher(data["inputs"])
            torch.save([o.clone() for o in outs], item["outputs"])
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            text = "".join(traceback.format_exception_only(type(e), e))
            lines = [line for line in text.splitlines()
                     if line.strip() and not re.search(r"\+0x[0-9a-f]+\)", line)]
            out["error"] = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(lines[:8]))[:1500]
        finally:
            os.chdir(base)
        results.write(json.dumps(out) + "\n")
        if "error" in out:  # pypto keeps parser state after a failure: a fresh worker goes on
            results.close()
            sys.stdout.flush()
            sys.exit(3)
    results.close()


if __name__ == "__main__":
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]
    main(sys.argv[1])
