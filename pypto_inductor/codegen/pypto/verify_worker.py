"""The host-value worker: runs one pypto kernel through pypto's host interpreter.

Run by :mod:`.verify` as ``python verify_worker.py JOB``. ``JOB`` (JSON) names the
kernel (``PyptoKernel.to_json()``), the calculator library, the launcher module
(loaded by path, as :mod:`.sim_worker` does), a ``torch.save`` file with the
inputs and goldens, where to save the outputs and the result, and whether to
run pypto's per-pass checks. One kernel per process: pypto writes its
``verify_result_brief.csv`` only when the process exits, and keeps parser
state after a failed kernel.

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
    opts = {"enable_pass_verify": True, "pass_verify_error_tol": job["tol"]}
    if not job["per_pass"]:
        opts["pass_verify_pass_filter"] = []  # the whole-tensor graph only
    pypto.set_verify_options(**opts)
    launcher_module = _load_launcher(job["launcher"])
    data = torch.load(job["data"])
    out = {}
    try:
        launcher = launcher_module.PyptoLauncher.load(job["kernel"], os.getcwd())
        if data.get("goldens") is not None:  # pypto's own verdict against our reference
            pypto.set_verify_golden_data(goldens=[None] * len(data["inputs"]) + [
                g.to(getattr(torch, p["dtype"])).contiguous().reshape(
                    [int(d) for d in p["shape"]])
                for g, p in zip(data["goldens"], launcher.outputs)])
        outs = launcher(data["inputs"])
        torch.save([o.clone() for o in outs], job["outputs"])
    except BaseException as e:  # noqa: BLE001 - reported to the caller
        text = "".join(traceback.format_exception_only(type(e), e))
        lines = [line for line in text.splitlines()
                 if line.strip() and not re.search(r"\+0x[0-9a-f]+\)", line)]
        out["error"] = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(lines[:8]))[:1500]
    with open(job["result"], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]
    main(sys.argv[1])
