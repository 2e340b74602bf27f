"""The HTML fusion report: one self-contained page (inline CSS, JS and SVG; nothing
fetched at view time).

From the top: a summary of the model, charts (:mod:`.charts`), one section per
graph with the picture of its tile graph (:mod:`.graph`) and its kernels, every
fusion decision in one sortable, filterable table (ROI fields and any other
field a decision carries as columns), then the kernels' sources and PTO-like
listings the tables link to. The report's dict is embedded as JSON
(``<script id="report-data">``) for tools and for the browser test.
"""
from __future__ import annotations

import html
import json
from pathlib import Path

from . import charts
from .graph import svg as graph_svg

esc = html.escape

_SUMMARY = [  # (key in to_dict()["summary"], label, formatter)
    ("kernels_unfused", "kernels, one per op", str),
    ("kernels_fused", "kernels after fusion", str),
    ("gm_bytes_unfused", "GM bytes, one kernel per op", lambda v: _bytes(v)),
    ("gm_bytes_fused", "GM bytes after fusion", lambda v: _bytes(v)),
    ("predicted_speedup", "predicted speedup", lambda v: f"{v}x"),
    ("measured_speedup", "measured speedup", lambda v: f"{v}x"),
    ("measured_us_fused", "measured time, fused", lambda v: f"{v} us"),
    ("measured_us_unfused", "measured time, unfused", lambda v: f"{v} us"),
    ("simulated_speedup", "simulated speedup", lambda v: f"{v}x" if v is not None else "n/a"),
    ("simulated_cycles_fused", "simulated cycles, fused", str),
    ("simulated_cycles_unfused", "simulated cycles, unfused", str),
    ("simulation_failures", "tiles not simulated", str),
    ("fallback_op_count", "eager (extern) ops", str),
    ("eager_graphs", "graphs run eagerly", str),
]


def _bytes(v: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if v >= size:
            return f"{v / size:.2f} {unit}"
    return f"{v} B"


def render(report) -> str:
    d = report.to_dict()
    artifacts = {}
    for g in report.graphs:
        artifacts.update(g.artifacts() if hasattr(g, "artifacts") else {})
    title = report.model or (d["graphs"][0]["name"].rsplit("_", 1)[0] if d["graphs"] else "model")
    parts = ["<!doctype html><html lang='en'><head><meta charset='utf-8'>",
             f"<title>pypto fusion report: {esc(title)}</title><style>{_CSS}</style></head><body>",
             f"<h1>pypto fusion report: <span id='model'>{esc(title)}</span></h1>",
             _summary(d, report), _charts(d)]
    for i, g in enumerate(d["graphs"]):
        parts.append(_graph_section(i, g, artifacts))
    parts.append(_decisions(d))
    parts.append(_artifact_section(d, artifacts))
    data = json.dumps(d, default=str).replace("</", "<\\/")
    parts.append(f"<script type='application/json' id='report-data'>{data}</script>")
    parts.append(f"<script>{_JS}</script></body></html>")
    return "\n".join(parts)


def _summary(d: dict, report) -> str:
    s, hw = d["summary"], d["hardware"]
    graphs = d["graphs"]
    ops = sum(g["num_ops"] for g in graphs)
    head = (f"<p class='meta'>target <b>{esc(str(d['target']))}</b>, hardware model "
            f"<b>{esc(str(hw.get('name')))}</b> (on-chip buffer {hw.get('capacity_bytes')} B, "
            f"GM {hw.get('gm_bandwidth_GBps')} GB/s); {len(graphs)} graph(s), {ops} ops</p>")
    cards = []
    for key, label, fmt in _SUMMARY:
        if key not in s:
            continue
        v = s[key]
        cards.append(f"<div class='card'><div class='v' data-key='{key}' "
                     f"data-value='{esc(json.dumps(v))}' title='{esc(str(v))}'>{esc(fmt(v))}"
                     f"</div><div class='l'>{esc(label)}</div></div>")
    hints = []
    if "measured_speedup" not in s:
        hints.append("measured times: add <code>--options profile=true</code>")
    if "simulated_speedup" not in s:
        hints.append("pypto simulator cycles: <code>--options simulate=true</code> (pypto installed)")
    eager = {}
    for g in graphs:
        for name, why in g.get("extern_reasons", {}).items():
            op, _, reason = why.partition(": ")
            eager.setdefault((op, reason), []).append(name)
    eager_rows = "".join(f"<tr><td>{esc(op)}</td><td>{len(names)}</td><td>{esc(reason)}</td></tr>"
                         for (op, reason), names in sorted(eager.items()))
    failed = [(g["name"], t["name"], t["kernel_fallback"]) for g in graphs
              for t in g["fusion_tiles"] if t.get("kernel_fallback")]
    not_native = [(g["name"], t["name"], (t.get("native") or {}).get("reason"))
                  for g in graphs for t in g["fusion_tiles"]
                  if (t.get("native") or {}).get("native") is False]
    eager_graphs = [(g["name"], g["eager_reason"]) for g in graphs if g.get("eager_reason")]
    out = [f"<section id='summary'><h2>Summary</h2>{head}<div class='cards'>{''.join(cards)}</div>"]
    if hints:
        out.append("<p class='hint'>" + "; ".join(hints) + "</p>")
    if eager_graphs:
        out.append("<p class='bad'>graphs run eagerly: " + "; ".join(
            f"{esc(n)} ({esc(str(r))})" for n, r in eager_graphs) + "</p>")
    out.append("<h3>Eager ops and why</h3>" + (
        f"<table class='small' id='eager-ops'><tr><th>op</th><th>count</th><th>why</th></tr>"
        f"{eager_rows}</table>" if eager_rows else "<p>none: every op runs in a kernel</p>"))
    natives = {}  # extern ops with a native kernel on the target: which ran, why
    for g in graphs:
        for name, e in g.get("extern_native", {}).items():
            key = ("native" if e["native"] else "ATen", e["reason"])
            natives[key] = natives.get(key, 0) + 1
    if natives:
        out.append("<h3>Extern ops with a native kernel</h3><table class='small' "
                   "id='extern-native'><tr><th>ran</th><th>count</th><th>why</th></tr>" + "".join(
                       f"<tr><td>{esc(ran)}</td><td>{n}</td><td>{esc(why)}</td></tr>"
                       for (ran, why), n in sorted(natives.items())) + "</table>")
    out.append("<h3>Kernels that did not build</h3>" + (
        "<ul id='failed-kernels'>" + "".join(f"<li>{esc(t)}: {esc(str(w))}</li>"
                                             for _, t, w in failed) + "</ul>"
        if failed else "<p id='failed-kernels'>none</p>"))
    if not_native:
        out.append(f"<details><summary>{len(not_native)} kernel(s) run on the reference "
                   "executor (outside the native code generator)</summary><ul>" + "".join(
                       f"<li>{esc(t)}: {esc(str(w))}</li>" for _, t, w in not_native)
                   + "</ul></details>")
    out.append("</section>")
    return "\n".join(out)


def _charts(d: dict) -> str:
    figs = [charts.times(d), charts.roofline(d), charts.top_tiles(d)]
    figs = [f for f in figs if f]
    if not figs:
        return "<section id='charts'><h2>Charts</h2><p>no kernels to chart</p></section>"
    return ("<section id='charts'><h2>Charts</h2><div class='charts'>"
            + "".join(f"<figure>{f}</figure>" for f in figs) + "</div></section>")


def _graph_section(i: int, g: dict, artifacts: dict) -> str:
    gid = f"graph-{i}"
    out = [f"<section class='graph' id='{gid}-section'><h2>Graph {esc(g['name'])}</h2>"]
    if g.get("eager_reason"):
        out.append(f"<p class='bad'>runs eagerly: {esc(str(g['eager_reason']))}</p></section>")
        return "".join(out)
    out.append(f"<p>{g['num_ops']} ops -&gt; {g['kernels_fused']} kernels (one per op: "
               f"{g['kernels_unfused']}); GM bytes {_bytes(g.get('gm_bytes_unfused', 0))} -&gt; "
               f"{_bytes(g.get('gm_bytes_fused', 0))}; predicted {g.get('predicted_us_unfused')} "
               f"-&gt; {g.get('predicted_us_fused')} us</p>")
    tiles = {t["name"]: t for t in g["fusion_tiles"]}
    out.append("<p class='legend'>Each coloured box is one FusionTile (one kernel) holding its "
               "ops; <span class='k eager'>dark</span> ops run eagerly (extern); "
               "<span class='k ref'>hatched</span> boxes run on the reference executor; "
               "<span class='k grey'>grey</span> ops are standalone views. Lines are edges "
               "left unfused: <span class='k rej'>red dashed</span> a merge the planner "
               "rejected, <span class='k eag'>orange</span> an edge to an eager op, "
               "<span class='k oth'>grey</span> other. Hover a line or box for the reason; "
               "edges inside a kernel are not drawn. Columns follow the dependencies (each box just "
               "before its first reader); click a box for its row in the table.</p>")
    out.append(f"<div class='scroll'>{graph_svg(g, gid, tiles)}</div>")
    unfused = [e for e in g.get("edges", []) if e["reason"]]
    if unfused:
        rows = "".join(f"<tr><td>{esc(e['producer'])}</td><td>{esc(e['consumer'])}</td>"
                       f"<td>{esc(e['reason'])}</td></tr>" for e in unfused)
        out.append(f"<details><summary>{len(unfused)} unfused edge(s) and their reasons"
                   f"</summary><table class='small sortable'><thead><tr><th>producer</th>"
                   f"<th>consumer</th><th>reason</th></tr></thead><tbody>{rows}</tbody></table>"
                   "</details>")
    out.append(_tile_table(g, artifacts))
    out.append("</section>")
    return "\n".join(out)


def _tile_table(g: dict, artifacts: dict) -> str:
    sim = any("simulated_cycles_fused" in t for t in g["fusion_tiles"])
    head = ["kernel", "ops", "dtype", "tile", "footprint B", "capacity B", "GM bytes", "flops",
            "bound", "predicted us", "measured us"]
    head += ["simulated cycles", "unfused cycles", "split ops"] if sim else []
    head += ["links"]
    rows = []
    for t in g["fusion_tiles"]:
        cells = [t["name"], " ".join(t.get("op_kinds", [])), t["dtype"],
                 "x".join(map(str, t["tile_shape"])), t["footprint_bytes"], t["capacity_bytes"],
                 t.get("gm_bytes"), t.get("flops"), t.get("bound"), t["predicted_us"],
                 t.get("measured_us")]
        if sim:
            cells += [t.get("simulated_cycles_fused"), t.get("simulated_cycles_unfused"),
                      " ".join(t.get("split_ops") or [])]
        tds = "".join(_td(c) for c in cells)
        cls = " class='bad'" if t.get("kernel_fallback") else ""
        rows.append(f"<tr{cls} id='tile-{esc(t['name'])}'>{tds}<td>{_links(t, artifacts)}</td></tr>")
    return (f"<table class='sortable tiles'><thead><tr>{''.join(f'<th>{esc(h)}</th>' for h in head)}"
            f"</tr></thead><tbody>{''.join(rows)}</tbody></table>")


def _links(t: dict, artifacts: dict) -> str:
    name, art, links = t["name"], artifacts.get(t["name"], {}), []
    if "cpp_source" in art:
        links.append(f"<a href='#src-{esc(name)}'>C++ source</a>")
    if t.get("pypto_source"):
        links.append(f"<a href='#pypto-{esc(name)}'>pypto source</a>")
    if "pto_ir" in art:
        links.append(f"<a href='#ir-{esc(name)}'>PTO-like IR</a>")
    for key, label in (("pto_ir_path", "PTO IR file"), ("perfetto_trace_path", "perfetto trace")):
        path = t.get(key)
        if path:
            links.append(f"<a href='{esc(Path(path).resolve().as_uri())}' title='a local file; "
                         f"open traces in ui.perfetto.dev'>{label}</a>")
    if t.get("simulation_error"):
        links.append(f"<span class='bad' title='{esc(t['simulation_error'])}'>sim error</span>")
    return " ".join(links)


def _td(v) -> str:
    if v is None:
        return "<td></td>"
    if isinstance(v, bool):
        return f"<td data-v='{int(v)}'>{'yes' if v else 'no'}</td>"
    if isinstance(v, (int, float)):
        return f"<td class='num' data-v='{v}'>{v}</td>"
    if isinstance(v, (list, tuple)):
        v = ", ".join(map(str, v))
    elif isinstance(v, dict):
        v = json.dumps(v)
    return f"<td>{esc(str(v))}</td>"


def _flatten(x: dict) -> dict:
    """A decision as flat columns: ``roi`` fields by their own names, any other nested
    dict as ``key.sub`` (fields added to decisions later show up without a change here)."""
    out = {}
    for k, v in x.items():
        if isinstance(v, dict):
            for k2, v2 in v.items():
                out[k2 if k == "roi" else f"{k}.{k2}"] = v2
        elif k != "roi":
            out[k] = v
    return out


def _decisions(d: dict) -> str:
    rows = [{"graph": g["name"], **_flatten(x)} for g in d["graphs"] for x in g["decisions"]]
    first = ["graph", "producer", "consumer", "fused", "reason", "roi_score",
             "bandwidth_saving_pct", "launch_overhead_reduction_pct", "l1_pressure_increase_pct"]
    cols = [c for c in first if any(c in r for r in rows)]
    cols += [c for c in dict.fromkeys(k for r in rows for k in r) if c not in cols]
    body = "".join("<tr data-fused='" + ("yes" if r.get("fused") else "no") + "'>"
                   + "".join(_td(r.get(c)) for c in cols) + "</tr>" for r in rows)
    fused = sum(1 for r in rows if r.get("fused"))
    return (f"<section id='decisions'><h2>Fusion decisions ({len(rows)}: {fused} fused, "
            f"{len(rows) - fused} not)</h2><p class='controls'><input id='filter' "
            "type='search' placeholder='filter rows (any text)'> <select id='fused-filter'>"
            "<option value=''>all</option><option value='yes'>fused</option>"
            "<option value='no'>not fused</option></select> <span id='shown'></span> "
            "<span class='hint'>click a column heading to sort</span></p>"
            f"<table class='sortable' id='decisions-table'><thead><tr>"
            + "".join(f"<th>{esc(c)}</th>" for c in cols)
            + f"</tr></thead><tbody>{body}</tbody></table></section>")


def _artifact_section(d: dict, artifacts: dict) -> str:
    out = ["<section id='kernels'><h2>Kernel sources and PTO-like listings</h2>"]
    for g in d["graphs"]:
        for t in g["fusion_tiles"]:
            art = artifacts.get(t["name"], {})
            for key, prefix, label in (("cpp_source", "src", "C++ source"),
                                       ("pypto_source", "pypto", "pypto source"),
                                       ("pto_ir", "ir", "PTO-like IR")):
                text = art.get(key) or (t.get(key) if key == "pypto_source" else None)
                if text:
                    out.append(f"<details id='{prefix}-{esc(t['name'])}'><summary>"
                               f"{esc(t['name'])}: {label}</summary><pre>{esc(text)}</pre>"
                               "</details>")
    out.append("</section>")
    return "\n".join(out)


_CSS = """
body{font-family:system-ui,sans-serif;margin:16px 24px;color:#222;font-size:14px}
h1{font-size:22px}h2{font-size:18px;border-bottom:1px solid #ddd;padding-top:8px}
h3{font-size:15px}.meta{color:#444}.hint{color:#777;font-size:12px}.bad{color:#a33}
.cards{display:flex;flex-wrap:wrap;gap:8px}.card{border:1px solid #ddd;border-radius:6px;
padding:6px 12px;min-width:120px;background:#fafafa}.card .v{font-size:20px;font-weight:600}
.card .l{font-size:11px;color:#666}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ccc;padding:2px 6px;
font-size:12px;vertical-align:top}th{background:#f0f0f0;position:sticky;top:0}
table.sortable th{cursor:pointer;user-select:none}th[aria-sort=ascending]::after{content:' \\25B2'}
th[aria-sort=descending]::after{content:' \\25BC'}td.num{text-align:right}
tr[data-fused=yes] td:nth-child(4){color:#262}tr[data-fused=no] td:nth-child(4){color:#a33}
.scroll{overflow:auto;max-height:640px;border:1px solid #ddd;background:#fdfdfd}
.charts{display:flex;flex-wrap:wrap;gap:12px;align-items:flex-start}figure{margin:0;flex:1 1 440px;
max-width:640px}svg.chart{width:100%;height:auto}
.tile-graph text{font-family:monospace;font-size:10px}.tile-graph .tl{font-size:9px;fill:#333}
.tile-graph .tx{fill:#fff}.edge{fill:none;stroke-width:1.2}.edge.rejected{stroke:#c33;
stroke-dasharray:4 2}.edge.eager{stroke:#e08a1e}.edge.other{stroke:#aaa}
.edge:hover{stroke-width:3}.k{padding:0 4px;border-radius:3px}.k.eager{background:#555;color:#fff}
.k.ref{background:repeating-linear-gradient(45deg,#fff,#fff 3px,#c33 3px,#c33 5px)}
.k.grey{background:#eee}.k.rej{color:#c33}.k.eag{color:#e08a1e}.k.oth{color:#999}
pre{background:#f6f6f6;padding:6px;overflow:auto;max-height:400px;font-size:11px}
"""

_JS = r"""
(function(){
function key(td){if(!td)return '';var v=td.getAttribute('data-v');
  if(v!==null&&v!==''&&!isNaN(+v))return +v;return td.textContent.trim().toLowerCase();}
function cmp(a,b){if(typeof a==='number'&&typeof b==='number')return a-b;
  if(typeof a==='number')return -1;if(typeof b==='number')return 1;return a<b?-1:a>b?1:0;}
document.querySelectorAll('table.sortable').forEach(function(table){
  var heads=table.querySelectorAll('thead th');
  heads.forEach(function(th,i){th.addEventListener('click',function(){
    var dir=th.getAttribute('aria-sort')==='ascending'?'descending':'ascending';
    heads.forEach(function(h){h.removeAttribute('aria-sort');});
    th.setAttribute('aria-sort',dir);var body=table.tBodies[0];
    var rows=Array.prototype.slice.call(body.rows);
    rows.sort(function(r1,r2){var c=cmp(key(r1.cells[i]),key(r2.cells[i]));
      return dir==='ascending'?c:-c;});
    rows.forEach(function(r){body.appendChild(r);});});});});
var table=document.getElementById('decisions-table');
var text=document.getElementById('filter'),fused=document.getElementById('fused-filter');
function filter(){if(!table)return;var q=text.value.toLowerCase(),f=fused.value,n=0;
  Array.prototype.forEach.call(table.tBodies[0].rows,function(r){
    var ok=(!f||r.getAttribute('data-fused')===f)&&(!q||r.textContent.toLowerCase().indexOf(q)>=0);
    r.style.display=ok?'':'none';if(ok)n++;});
  document.getElementById('shown').textContent=n+' shown';}
if(text){text.addEventListener('input',filter);fused.addEventListener('change',filter);filter();}
document.querySelectorAll('.tile-graph .tile').forEach(function(g){
  g.addEventListener('click',function(){var row=document.getElementById('tile-'+g.getAttribute('data-tile'));
    if(row){row.scrollIntoView({block:'center'});row.style.background='#ffd';}});});
document.querySelectorAll('a[href^="#"]').forEach(function(a){a.addEventListener('click',function(){
  var el=document.getElementById(a.getAttribute('href').slice(1));if(el&&el.tagName==='DETAILS')el.open=true;});});
})();
"""
