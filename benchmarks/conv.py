"""Inference conv nets (conv + BatchNorm + ReLU, eval, no grad): the zoo's ResNet and a
VGG-style conv stack, eager, Inductor, pypto before (each convolution an ATen extern, BN and
ReLU native tiles) and pypto (lowering/conv.py: BN folded, oneDNN post-ops, channels-last),
interleaved in one process; medians and ratios.

    python -m benchmarks.conv [--threads 1] [--cpu-time] [--rounds 5] [--repeats 20] [--dtype bfloat16]
                              [--ab MODULE.ATTR]

``--ab`` adds a variant "off": pypto compiled with that module-level switch False.
"""
from __future__ import annotations

import importlib

import torch
import torch.nn as nn

from pypto_inductor import zoo
from pypto_inductor.backend import pypto_backend
from pypto_inductor.lowering import conv


from . import interleaved_medians, md_table, own_code, parse_timing, timing_parser


def _vgg(width: int = 32) -> nn.Module:
    layers, cin = [], 3
    for cout in (width, width, 2 * width, 2 * width):
        layers += [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU()]
        cin = cout
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10))


def _cases(batch: int):
    g = torch.Generator().manual_seed(0)
    resnet = zoo.build("resnet")
    vgg = _vgg()
    for m in (resnet, vgg):  # non-trivial running statistics, as a trained net has
        for mod in m.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.running_mean.normal_(0, 0.1, generator=g)
                mod.running_var.uniform_(0.5, 1.5, generator=g)
    img = torch.randn(batch, 3, 32, 32, generator=g)
    return [(f"zoo resnet {batch}x3x32x32", lambda x: resnet(x)["logits"], resnet, img),
            (f"vgg-style 4x(conv3x3+bn+relu) {batch}x3x32x32", vgg, vgg, img)]


def run(threads: int, rounds: int, repeats: int, dtype, batch: int,
        ab: str | None = None) -> list[list[str]]:
    torch.set_num_threads(threads)
    switch = None
    if ab:
        modname, attr = ab.rsplit(".", 1)
        switch = (importlib.import_module(modname), attr)
    rows = []
    for name, fn, model, img in _cases(batch):
        model.eval().to(dtype)
        x = img.to(dtype)
        variants = {"eager": fn, "inductor": torch.compile(own_code(fn), backend="inductor"),
                    "pypto before": torch.compile(own_code(fn), backend="pypto"),
                    "pypto": torch.compile(own_code(fn), backend="pypto",
                                           options={"buffering": 2})}
        if switch:
            # a backend callable of its own: a second backend="pypto" compile of the same
            # function with the same options would share the first one's frames
            variants["off"] = torch.compile(
                own_code(fn), backend=lambda gm, ex: pypto_backend(gm, ex, {"buffering": 2}))
        with torch.no_grad():
            ref = fn(x)
            tol = dict(rtol=1e-3, atol=1e-3) if dtype == torch.float32 else \
                dict(rtol=5e-2, atol=5e-2)
            for label, f in variants.items():
                conv.ENABLED = label != "pypto before"  # decided at the first call
                if switch:
                    setattr(*switch, label != "off")
                torch.testing.assert_close(f(x), ref, **tol)
            conv.ENABLED = True
            if switch:
                setattr(*switch, True)
            med = interleaved_medians(variants, lambda f: f(x), rounds, repeats)
        rows.append([name] + [f"{med[v]:.0f}" for v in variants]
                    + [f"{med['pypto before'] / med['pypto']:.2f}x",
                       f"{med['eager'] / med['pypto']:.2f}x",
                       f"{med['inductor'] / med['pypto']:.2f}x"]
                    + ([f"{med['off'] / med['pypto']:.3f}x"] if switch else []))
    return rows


def main(argv=None) -> int:
    p = timing_parser(__doc__, threads=1)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--ab", default=None, help="MODULE.ATTR: a variant with it off")
    a = parse_timing(p, argv)
    header = ["case", "eager us", "inductor us", "pypto before us", "pypto us"] + (
        ["off us"] if a.ab else []) + ["pypto vs before", "pypto vs eager",
                                       "pypto vs inductor"] + (["off/on"] if a.ab else [])
    rows = run(a.threads, a.rounds, a.repeats, getattr(torch, a.dtype), a.batch, a.ab)
    print("\n".join(md_table(header, rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
