"""Command line: ``python -m pypto_inductor demo`` and ``python -m pypto_inductor report``."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from . import models
from .api import report
from .models import MODELS


def _median_ms(fn, *args, repeats: int = 20) -> float:
    with torch.no_grad():
        for _ in range(3):
            fn(*args)  # warm up (and compile)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn(*args)
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _parse_options(items: list[str]) -> dict:
    """KEY=VALUE pairs; values parsed as JSON when they can be (numbers, true, lists)."""
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--option expects KEY=VALUE, got {item!r}")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def demo(args) -> int:
    torch.manual_seed(0)
    model, inputs = models.build(args.model)
    options = _parse_options(args.option)
    print(f"model: {args.model} ({type(model).__name__}), inputs "
          + ", ".join(str(tuple(x.shape)) for x in inputs))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="pypto", options=options or None)
    start = time.perf_counter()
    with torch.no_grad():
        out = compiled(*inputs)
    compile_s = time.perf_counter() - start
    with torch.no_grad():
        expected = model(*inputs)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    print(f"correct: compiled output matches eager (max abs diff "
          f"{(out - expected).abs().max().item():.2e}); first call incl. compile {compile_s:.2f} s")
    print()
    rep = report(model, *inputs, options=options or None)
    print(rep)
    if args.save:
        print(f"\nreport written to {rep.save(args.save)}")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="pypto", options=options or None)
    eager_ms = _median_ms(model, *inputs, repeats=args.repeats)
    pypto_ms = _median_ms(compiled, *inputs, repeats=args.repeats)
    print(f"\ntime (median of {args.repeats}): eager {eager_ms:.3f} ms, pypto {pypto_ms:.3f} ms, "
          f"eager/pypto = {eager_ms / pypto_ms:.2f}x")
    return 0


def report_cmd(args) -> int:
    model, inputs = models.build(args.model)
    rep = report(model, *inputs, options=_parse_options(args.option) or None,
                 backward=args.backward)
    print(rep)
    if args.save:
        print(f"\nreport written to {rep.save(args.save)}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pypto_inductor")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn, help_text in (("demo", demo, "compile a built-in model, check it, report, time"),
                                ("report", report_cmd, "print the fusion report of a built-in model")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--model", default="gpt_block" if name == "demo" else "transformer",
                       choices=sorted(MODELS))
        p.add_argument("--option", "-o", action="append", default=[], metavar="KEY=VALUE",
                       help="a backend option, e.g. -o capacity_bytes=65536 -o target=reference")
        p.add_argument("--save", metavar="PATH", help="also write the report (.json or .html)")
        if name == "report":
            p.add_argument("--backward", action="store_true", help="include the backward graph")
        else:
            p.add_argument("--repeats", type=int, default=20, help="timing repeats")
        p.set_defaults(fn=fn)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
