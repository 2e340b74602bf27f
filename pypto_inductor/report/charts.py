"""The report's charts, drawn by matplotlib as inline SVG (text kept as text).

Each function takes the report's dict (``FusionReport.to_dict()``) and returns an
``<svg>`` string, or "" when there is nothing to draw. matplotlib is imported
here only, when an HTML report is written.
"""
from __future__ import annotations

import io

MAX_BARS = 30  # per chart: more is unreadable; the tables have every tile

# Simulated cycles -> us: pypto's simulator models Ascend A2 (its A2A3.ini clock)
_DEFAULT_SIM_HZ = 1.85e9


def tile_rows(d: dict) -> list[dict]:
    """One row per FusionTile of every graph: label and the times the report knows."""
    hz = d["hardware"].get("freq_hz") or _DEFAULT_SIM_HZ
    rows = []
    for g in d["graphs"]:
        for t in g["fusion_tiles"]:
            cycles = t.get("simulated_cycles_fused")
            rows.append({
                "label": f"{g['name'].split('_')[-1] if len(d['graphs']) > 1 else ''}"
                         f"{' ' if len(d['graphs']) > 1 else ''}{_short(t['name'])}",
                "tile": t["name"], "predicted": t["predicted_us"], "measured": t.get("measured_us"),
                "simulated": round(cycles / hz * 1e6, 3) if cycles else None,
                "flops": t.get("flops", 0), "gm_bytes": t.get("gm_bytes", 0),
                "bound": t.get("bound", ""),
            })
    return rows


def _short(name: str) -> str:
    tail = name.rsplit("_k", 1)[-1] if "_k" in name else name
    return "k" + tail[:28]


def _figure(width: float, height: float):
    """A matplotlib Figure outside pyplot: no global backend or figure state is touched
    (a user's interactive session keeps its own)."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height))


_RC = {"svg.fonttype": "none", "font.size": 8, "axes.titlesize": 10}


def _svg(fig, salt: str) -> str:
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({**_RC, "svg.hashsalt": salt}):  # ids unique in the page
        fig.savefig(buf, format="svg", bbox_inches="tight")
    text = buf.getvalue()
    svg = text[text.index("<svg"):]
    return svg.replace("<svg ", f"<svg class='chart' id='chart-{salt}' ", 1)


def _styled(draw):
    """Draws under the report's rc settings (fonts are read when artists are made)."""
    def wrapper(d: dict) -> str:
        import matplotlib

        with matplotlib.rc_context(_RC):
            return draw(d)
    wrapper.__doc__ = draw.__doc__
    return wrapper


@_styled
def times(d: dict) -> str:
    """Per tile: predicted, measured and simulated time, the slowest tiles first."""
    rows = tile_rows(d)
    if not rows:
        return ""
    rows = sorted(rows, key=lambda r: -max(r["predicted"], r["measured"] or 0,
                                           r["simulated"] or 0))[:MAX_BARS][::-1]
    series = [("predicted", "#7a9cc6")]
    series += [(k, c) for k, c in (("measured", "#d9822b"), ("simulated", "#4a9d5b"))
               if any(r[k] is not None for r in rows)]
    fig = _figure(7.5, 0.9 + 0.22 * len(rows) * len(series) ** 0.5)
    ax = fig.subplots()
    h = 0.8 / len(series)
    for i, (key, colour) in enumerate(series):
        ax.barh([j + (i - (len(series) - 1) / 2) * h for j in range(len(rows))],
                [r[key] or 0 for r in rows], height=h, color=colour, label=key)
    ax.set_yticks(range(len(rows)), [r["label"] for r in rows])
    ax.set_xlabel("time per call (us)")
    total = len(tile_rows(d))
    ax.set_title("time per FusionTile" + (f" (slowest {len(rows)} of {total})"
                                          if total > len(rows) else ""))
    ax.legend(loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    return _svg(fig, "times")


@_styled
def roofline(d: dict) -> str:
    """Arithmetic intensity (flop/byte of global memory) against attained GFLOP/s, under
    the hardware's bandwidth and compute roofs; tiles at their measured time when known,
    else simulated, else predicted."""
    rows = [r for r in tile_rows(d) if r["gm_bytes"]]
    hw = d["hardware"]
    bw, vec = hw.get("gm_bandwidth_GBps"), hw.get("vector_GFLOPs")
    if not rows or not bw or not vec:
        return ""
    fig = _figure(6.5, 4.2)
    ax = fig.subplots()
    floor = 1e-3  # tiles without flops (copies, gathers) sit at the left edge
    marks = {"memory": ("o", "#3b6fb6"), "compute": ("s", "#c0392b"), "launch": ("^", "#888")}
    for bound, (m, c) in marks.items():
        sel = [r for r in rows if r["bound"] == bound]
        if not sel:
            continue
        xs = [max(r["flops"] / r["gm_bytes"], floor) for r in sel]
        ys = [max(r["flops"] / 1e3 / max(_time(r), 1e-3), floor) for r in sel]
        ax.scatter(xs, ys, marker=m, color=c, s=18, label=f"{bound}-bound ({len(sel)})")
    xs = [max(r["flops"] / r["gm_bytes"], floor) for r in rows]
    lo, hi = min(xs + [0.01]) / 2, max(xs + [vec / bw * 4]) * 2
    roofs = [("vector", vec)]
    cube = hw.get("cube_GFLOPs")
    if cube and cube > vec:
        roofs.append(("cube", cube))
    for name, peak in roofs:
        knee = peak / bw
        ax.plot([lo, knee, hi], [lo * bw, peak, peak], color="#444", lw=1)
        ax.text(hi, peak, f" {name} {peak:g} GFLOP/s", va="bottom", ha="right", fontsize=7)
    ax.text(lo * 1.2, lo * bw * 1.5, f"GM {bw:g} GB/s", rotation=0, fontsize=7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (flop / GM byte)")
    ax.set_ylabel("attained GFLOP/s")
    ax.set_title(f"roofline of the tiles ({hw.get('name')})")
    ax.legend(loc="lower right", fontsize=7)
    ax.grid(alpha=0.3, which="both")
    return _svg(fig, "roofline")


def _time(r: dict) -> float:
    return r["measured"] or r["simulated"] or r["predicted"]


@_styled
def top_tiles(d: dict, n: int = 12) -> str:
    """The tiles taking the most time (measured, else simulated, else predicted), with
    their share of the total."""
    rows = tile_rows(d)
    if not rows:
        return ""
    total = sum(_time(r) for r in rows) or 1.0
    top = sorted(rows, key=_time, reverse=True)[:n][::-1]
    basis = ("measured" if all(r["measured"] is not None for r in rows)
             else "simulated" if all(r["simulated"] is not None for r in rows) else "predicted")
    fig = _figure(6.5, 0.8 + 0.24 * len(top))
    ax = fig.subplots()
    colours = {"memory": "#3b6fb6", "compute": "#c0392b", "launch": "#999"}
    ax.barh(range(len(top)), [_time(r) for r in top],
            color=[colours.get(r["bound"], "#777") for r in top])
    for i, r in enumerate(top):
        ax.text(_time(r), i, f" {100 * _time(r) / total:.1f}%", va="center", fontsize=7)
    ax.set_yticks(range(len(top)), [r["label"] for r in top])
    ax.set_xlabel(f"{basis} time per call (us)")
    ax.set_title(f"top {len(top)} tiles by {basis} time (colour: roofline bound)")
    ax.margins(x=0.15)
    return _svg(fig, "top")
