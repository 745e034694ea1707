"""Bench results as one self-contained HTML page: the plots as inline PNGs (matplotlib, Agg), the
table as HTML, nothing fetched from elsewhere, so the file can be mailed or attached as it is.

    serve_page(result)              one `kvserve bench serve` result (its --json-out)
    compare_page({label: result})   several results side by side (`kvserve bench compare`)
"""
from __future__ import annotations

import base64
import html
import io
import json
import time

from kvserve.bench import plots, report

_STYLE = """body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222}
table{border-collapse:collapse;margin:8px 0 16px}td,th{padding:3px 10px;border-bottom:1px solid #ddd;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}img{max-width:100%;display:block;margin:8px 0}
pre{background:#f6f6f6;padding:8px;overflow:auto;font-size:12px}"""


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plots._pyplot().close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _img(fig, alt: str) -> str:
    return f'<figure><img alt="{html.escape(alt)}" src="data:image/png;base64,{_png(fig)}"></figure>'


def _table(runs: list[dict], labels: list[str] | None = None) -> str:
    cells = report.rows(runs)
    head = (["result"] if labels else []) + cells[0]
    out = ['<table class="runs"><thead><tr>' + "".join(f"<th>{html.escape(h)}</th>" for h in head)
           + "</tr></thead><tbody>"]
    for i, row in enumerate(cells[1:]):
        row = ([labels[i]] if labels else []) + row
        out.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>")
    out.append("</tbody></table><p><small>latencies in ms; goodput: requests/s meeting the SLOs</small></p>")
    return "".join(out)


def _page(title: str, body: list[str]) -> str:
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
            f"<p><small>written {time.strftime('%Y-%m-%d %H:%M:%S %Z')}</small></p>"
            + "".join(body) + "</body></html>\n")


def _plots(series: dict[str, list[dict]], labelled: list[dict]) -> list[str]:
    """The throughput, latency CDF and (where recorded) KV usage plots of runs whose "load"
    already names them uniquely (``labelled``), grouped by result for the throughput plot."""
    body = ["<h2>Throughput and tail latency against the load</h2>",
            _img(plots.throughput_figure(series), "throughput vs load"),
            "<h2>Latency distributions</h2>", _img(plots.latency_cdfs_figure(labelled), "latency CDFs")]
    if any(r.get("kv_usage") for r in labelled):
        body += ["<h2>KV cache usage over time</h2>", _img(plots.kv_usage_figure(labelled), "KV usage over time")]
    return body


def serve_page(result: dict) -> str:
    runs, cfg = result["runs"], result.get("config", {})
    title = f"kvserve bench serve: {cfg.get('model', '?')} at {cfg.get('base_url', '?')}"
    body = ["<h2>Results</h2>", _table(runs)] + _plots({cfg.get("model", "run"): runs}, runs)
    body += ["<h2>Configuration</h2>", f"<pre>{html.escape(json.dumps(cfg, indent=1))}</pre>"]
    return _page(title, body)


def compare_page(results: dict[str, dict]) -> str:
    """``results``: label (a file name) -> a bench serve result."""
    labelled, labels = [], []
    for label, res in results.items():
        for run in res["runs"]:
            labelled.append({**run, "load": f"{label}: {run['load']}"})
            labels.append(label)
    body = ["<h2>Results</h2>", _table([r for res in results.values() for r in res["runs"]], labels)]
    body += _plots({label: res["runs"] for label, res in results.items()}, labelled)
    body.append("<h2>Configurations</h2>")
    for label, res in results.items():
        conf = json.dumps(res.get("config", {}), indent=1)
        body.append(f"<h3>{html.escape(label)}</h3><pre>{html.escape(conf)}</pre>")
    return _page(f"kvserve bench compare: {len(results)} results", body)


def write(path: str, page: str) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
    return path
