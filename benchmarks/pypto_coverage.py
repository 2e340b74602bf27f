"""``python -m benchmarks.pypto_coverage [models...]``: the transformers zoo on the pypto target.

For each model of :mod:`pypto_inductor.zoo` (tiny configs, random weights), the forward
pass with its loss goes through ``pypto_inductor.report(..., options={"verify": True})``:
every FusionTile is emitted as a pypto kernel, simulated in pypto's simulator (fused and
one kernel per op) and run through pypto's host interpreter against the reference
executor; every SDPA call (the attention rewrite) as the flash-attention kernel of
``codegen/pypto/attention.py``, simulated fused vs unfused and checked against eager SDPA.

Per model: FusionTiles; ``whole``: simulated as one kernel (no split) and verified;
``verified``: every pypto part verified (split tiles too); ``wrong``: a value check that
failed (must be 0); the ops split tiles run eagerly (each split names its op) and why
tiles did not verify. ``--markdown PATH`` writes the table. CPU-heavy: run it niced.
"""
from __future__ import annotations

import argparse
import collections
import sys
import time

import torch

import pypto_inductor
from pypto_inductor import zoo

MODELS = ["gpt2", "llama", "qwen2", "mistral", "phi3", "bert", "t5", "vit", "whisper"]


class _Kwargs(torch.nn.Module):
    """The model called with its batch's keyword arguments given positionally."""

    def __init__(self, model, keys):
        super().__init__()
        self.model, self.keys = model, list(keys)

    def forward(self, *xs):
        return self.model(**dict(zip(self.keys, xs)))


def measure(name: str) -> dict:
    start = time.time()
    model, batch = zoo.build(name), zoo.batch(name)
    rep = pypto_inductor.report(_Kwargs(model, batch), *batch.values(),
                                options={"hardware": "ascend-a2", "verify": True})
    graphs = rep.to_dict()["graphs"]
    tiles = [t for g in graphs for t in g["fusion_tiles"]]
    attn = [a for g in graphs for a in g.get("attention", [])]
    whole = [t for t in tiles if t.get("simulated_cycles_fused") is not None
             and not t.get("split_ops") and t.get("verified")]
    return {
        "model": name, "tiles": len(tiles), "whole": len(whole),
        "verified": sum(1 for t in tiles if t.get("verified")),
        "wrong": [t["name"] for t in tiles if t.get("verified") is False]
        + [a["name"] for a in attn if a.get("verified") is False],
        "split_ops": dict(collections.Counter(op for t in tiles for op in t.get("split_ops") or [])),
        "not_verified": [(" ".join(t["op_kinds"]), (t.get("verify_error") or t.get(
            "simulation_error") or "")[:160]) for t in tiles if t.get("verified") is None],
        "attention": len(attn), "attention_verified": sum(1 for a in attn if a.get("verified")),
        "attention_cycles": [(a.get("simulated_cycles_fused"), a.get("simulated_cycles_unfused"))
                             for a in attn],
        "max_abs_err": max((t.get("max_abs_err") or 0.0 for t in tiles), default=0.0),
        "seconds": round(time.time() - start),
    }


def table(rows: list[dict]) -> str:
    head = ("| model | FusionTiles | whole + verified | % | verified (incl. split) | wrong | "
            "ops split off (eager) | SDPA calls verified | flash vs unfused cycles |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        pct = 100.0 * r["whole"] / r["tiles"] if r["tiles"] else 0.0
        split = ", ".join(f"{k} x{v}" for k, v in sorted(r["split_ops"].items())) or "-"
        cyc = ", ".join(f"{f}/{u}" for f, u in r["attention_cycles"]) or "-"
        lines.append(f"| {r['model']} | {r['tiles']} | {r['whole']} | {pct:.1f} | "
                     f"{r['verified']} | {len(r['wrong'])} | {split} | "
                     f"{r['attention_verified']}/{r['attention']} | {cyc} |")
    tiles = sum(r["tiles"] for r in rows)
    whole = sum(r["whole"] for r in rows)
    lines.append(f"| **all** | {tiles} | {whole} | {100.0 * whole / max(tiles, 1):.1f} | "
                 f"{sum(r['verified'] for r in rows)} | {sum(len(r['wrong']) for r in rows)} |"
                 " | | |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=MODELS)
    ap.add_argument("--markdown", help="write the table to this file")
    args = ap.parse_args(argv)
    rows = []
    for name in args.models:
        r = measure(name)
        rows.append(r)
        print(f"{name}: {r['whole']}/{r['tiles']} whole+verified, {r['verified']} verified, "
              f"wrong {r['wrong']}, split {r['split_ops']}, {r['seconds']} s", flush=True)
        for ops, why in r["not_verified"]:
            print(f"    not verified: {ops} | {why}", flush=True)
    text = table(rows)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
