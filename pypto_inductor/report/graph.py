"""The tile graph of one plan: its structure as plain data, and its picture as SVG.

:func:`structure` turns a FusionPlan into nodes (ops, with the FusionTile each
belongs to) and edges (with the reason every edge between two kernels was left
unfused). :func:`svg` draws that with a small layered layout written here (no
Graphviz: the report must render wherever the package imports, and a
``dot`` binary is not something pip can install): FusionTiles are the layout's
units, placed in columns by longest path (left to right, inputs first; then
each unit just before its first reader) and
ordered in each column by the barycentre of their neighbours, a few sweeps each
way; each unit is drawn as a coloured box holding its ops.
"""
from __future__ import annotations

import html

from ..ir import ExternOp, TileOp
from ..lowering.indexing import STANDALONE_OPS

COL_W, NODE_W, ROW_H, HEAD_H, GAP, PAD = 190, 150, 20, 16, 14, 10


def structure(plan, fallbacks: dict, native: dict) -> dict:
    """{"nodes": [...], "edges": [...]}: every op with its tile, every producer -> consumer
    edge with ``reason`` None when both ends are in one kernel."""
    tile_of = {op.name: t.name for t in plan.tiles for op in t.ops}
    nodes, by_name = [], {}
    for node in plan.graph.nodes:
        extern = isinstance(node, ExternOp)
        entry = {"name": node.name, "op": node.op_name if extern else node.op,
                 "tile": tile_of.get(node.name), "extern": extern}
        if extern:
            entry["reason"] = node.reason
        elif node.name not in tile_of:
            entry["standalone"] = ("view" if node.is_view else "dead" if _dead(node, plan)
                                   else "op")
        nodes.append(entry)
        by_name[node.name] = entry
    rejected = {(d.producer, d.consumer): d.reason for d in plan.decisions if not d.fused}
    producers = plan.graph.producers()
    edges, seen = [], set()
    for node in plan.graph.nodes:
        for value in node.inputs:
            p = producers.get(value)
            if p is None or (p.name, node.name) in seen:
                continue
            seen.add((p.name, node.name))
            a, b = by_name[p.name], by_name[node.name]
            reason = None
            if a["tile"] is None or a["tile"] != b["tile"]:
                reason = rejected.get((p.name, node.name)) or _why_apart(a, b)
            edges.append({"producer": p.name, "consumer": node.name, "value": value,
                          "reason": reason})
    for t in plan.tiles:  # tiles running on the reference executor, not native code
        why = fallbacks.get(t.name) or (native.get(t.name, {}).get("reason")
                                        if native.get(t.name, {}).get("native") is False else None)
        if why:
            for op in t.ops:
                by_name[op.name]["reference_executor"] = why
    return {"nodes": nodes, "edges": edges}


def _dead(node, plan) -> bool:
    return isinstance(node, TileOp) and node.name not in plan.graph.output_names() and all(
        node.name not in n.inputs for n in plan.graph.nodes)


def _why_apart(a: dict, b: dict) -> str:
    """The reason for an edge the planner recorded no decision on."""
    for end in (a, b):
        if end["extern"]:
            return f"{end['name']} ({end['op']}) runs eagerly: {end.get('reason', '')}"
    for end in (a, b):
        kind = end.get("standalone")
        if kind == "view":
            return f"{end['name']} is a standalone view (zero-copy, no kernel)"
        if kind == "op" and end["op"] in STANDALONE_OPS:
            return f"{end['name']} ({end['op']}) always runs as its own kernel"
        if kind == "op":
            return f"{end['name']} ({end['op']}) runs outside the kernels"
        if kind == "dead":
            return f"{end['name']} is never read (dropped)"
    return "a merge here was never a candidate (another merge took one side first)"


# --- the picture ---------------------------------------------------------------------
def svg(graph: dict, graph_id: str, tiles: dict) -> str:
    """The SVG of one graph's ``structure``; ``tiles``: tile name -> its report dict."""
    nodes, edges = graph["nodes"], graph["edges"]
    if not nodes:
        return ""
    unit_of, units = {}, {}
    for n in nodes:
        key = n["tile"] or n["name"]
        unit_of[n["name"]] = key
        units.setdefault(key, []).append(n)
    succ = {u: set() for u in units}
    pred = {u: set() for u in units}
    for e in edges:
        a, b = unit_of[e["producer"]], unit_of[e["consumer"]]
        if a != b:
            succ[a].add(b)
            pred[b].add(a)
    layer = _layers(units, succ, pred)
    columns: list[list[str]] = [[] for _ in range(max(layer.values()) + 1)]
    for u in units:  # graph order first: a stable start for the sweeps
        columns[layer[u]].append(u)
    _order(columns, succ, pred)
    pos, height = {}, 0  # op name -> (x, y) of its box's top left
    boxes = []
    for ci, col in enumerate(columns):
        y = PAD
        for u in col:
            ops = units[u]
            tile = ops[0]["tile"]
            h = len(ops) * ROW_H + (HEAD_H if tile else 0) + 6
            boxes.append((u, tile, ci * COL_W + PAD, y, h))
            for i, n in enumerate(ops):
                pos[n["name"]] = (ci * COL_W + PAD + 6, y + (HEAD_H if tile else 0) + 3 + i * ROW_H)
            y += h + GAP
        height = max(height, y)
    width = len(columns) * COL_W + PAD
    esc = html.escape
    out = [f"<svg xmlns='http://www.w3.org/2000/svg' class='tile-graph' id='{esc(graph_id)}' "
           f"width='{width}' height='{height}' viewBox='0 0 {width} {height}'>",
           "<defs><pattern id='hatch-" + esc(graph_id) + "' width='6' height='6' "
           "patternUnits='userSpaceOnUse' patternTransform='rotate(45)'><rect width='6' height='6'"
           " fill='#fff'/><line x1='0' y1='0' x2='0' y2='6' stroke='#c33' stroke-width='2'/>"
           "</pattern></defs>"]
    tile_index = {name: i for i, name in enumerate(tiles)}
    for u, tile, x, y, h in boxes:
        if tile:
            t = tiles.get(tile, {})
            hue = (tile_index.get(tile, 0) * 47) % 360
            ref = any(n.get("reference_executor") for n in units[u])
            fill = f"url(#hatch-{esc(graph_id)})" if ref else f"hsl({hue},70%,90%)"
            title = (f"{tile}\npredicted {t.get('predicted_us')} us, {t.get('bound')}-bound"
                     + (f"\nmeasured {t['measured_us']} us" if "measured_us" in t else "")
                     + (f"\nREFERENCE EXECUTOR: {units[u][0].get('reference_executor')}"
                        if ref else ""))
            label = tile.rsplit("_k", 1)[-1] if "_k" in tile else tile
            out.append(f"<g class='tile{' reference' if ref else ''}' data-tile='{esc(tile)}'>"
                       f"<title>{esc(title)}</title><rect x='{x}' y='{y}' width='{NODE_W + 12}' "
                       f"height='{h}' rx='6' fill='{fill}' stroke='hsl({hue},55%,45%)' "
                       f"stroke-width='1.5'/><text x='{x + 5}' y='{y + 12}' class='tl'>"
                       f"k{esc(label[:26])}{' (reference)' if ref else ''}</text></g>")
    for n in nodes:
        x, y = pos[n["name"]]
        cls = "op extern" if n["extern"] else "op"
        fill, stroke = ("#555", "#222") if n["extern"] else ("#fff", "#888")
        if n.get("standalone"):
            fill, stroke = "#eee", "#bbb"
        tip = f"{n['name']} = {n['op']}" + (f"\nruns eagerly: {n.get('reason')}" if n["extern"]
                                             else "")
        text = ("eager " if n["extern"] else "") + n["op"]
        out.append(f"<g class='{cls}' data-op='{esc(n['name'])}'><title>{esc(tip)}</title>"
                   f"<rect x='{x}' y='{y}' width='{NODE_W}' height='{ROW_H - 4}' rx='3' "
                   f"fill='{fill}' stroke='{stroke}'/><text x='{x + 4}' y='{y + 12}' "
                   f"class='{'tx' if n['extern'] else 'tn'}'>{esc(text[:24])}</text></g>")
    for e in edges:
        if e["reason"] is None:
            continue  # inside one kernel: the box says it
        (x1, y1), (x2, y2) = pos[e["producer"]], pos[e["consumer"]]
        y1, y2 = y1 + ROW_H // 2 - 2, y2 + ROW_H // 2 - 2
        if x2 > x1:
            x1 += NODE_W
        else:  # the same column (a tile's own ops never get here): loop round the right
            x1, x2 = x1 + NODE_W, x2 + NODE_W
        cx = (x1 + x2) / 2 if x2 != x1 else x1 + 40
        kind = _edge_kind(e["reason"])
        out.append(f"<path class='edge unfused {kind}' d='M{x1},{y1} C{cx},{y1} {cx},{y2} "
                   f"{x2},{y2}'><title>{esc(e['producer'])} -> {esc(e['consumer'])} not fused: "
                   f"{esc(e['reason'])}</title></path>")
    out.append("</svg>")
    return "".join(out)


def _edge_kind(reason: str) -> str:
    if "runs eagerly" in reason:
        return "eager"
    if "view" in reason or "never read" in reason or "own kernel" in reason \
            or "outside the kernels" in reason:
        return "other"
    return "rejected"


def _layers(units: dict, succ: dict, pred: dict) -> dict:
    """Columns: longest path from a source (Kahn's algorithm; the unit graph is acyclic),
    then every unit but the sinks moved right to just before its first reader, so a
    constant or a weight's reshape sits next to where it is used."""
    indeg = {u: len(pred[u]) for u in units}
    layer = {u: 0 for u in units}
    ready = [u for u in units if indeg[u] == 0]
    order = []
    while ready:
        u = ready.pop()
        order.append(u)
        for v in succ[u]:
            layer[v] = max(layer[v], layer[u] + 1)
            indeg[v] -= 1
            if indeg[v] == 0:
                ready.append(v)
    for u in reversed(order):
        if succ[u]:
            layer[u] = min(layer[v] for v in succ[u]) - 1
    return layer


def _order(columns: list[list[str]], succ: dict, pred: dict, sweeps: int = 3) -> None:
    """Barycentre ordering of each column by its neighbours' positions, in place."""
    index = {u: i for c in columns for i, u in enumerate(c)}
    for _ in range(sweeps):
        for cols, nbrs in ((columns[1:], pred), (columns[-2::-1], succ)):
            for col in cols:
                def bary(u):
                    ns = [index[n] for n in nbrs[u]]
                    return sum(ns) / len(ns) if ns else index[u]

                col.sort(key=bary)
                index.update({u: i for i, u in enumerate(col)})
