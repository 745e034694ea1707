"""Summaries of one bench run: percentiles of TTFT, TPOT, ITL and e2e (milliseconds), request and
token throughput over the run's wall time, and goodput: completed requests per second that met
every SLO given (TTFT <= slo_ttft_ms and TPOT <= slo_tpot_ms; a request with one output token
has no TPOT and meets that SLO). Failed requests count in `failed`, in no latency or throughput.
"""
from __future__ import annotations

import numpy as np

from kvserve.bench.client import RequestResult

PERCENTILES = (50, 90, 99)


def _stats_ms(values: list[float]) -> dict:
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    a = np.asarray(values) * 1000.0
    return {"mean": float(a.mean()), **{f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES}}


def summarize(results: list[RequestResult], duration_s: float, slo_ttft_ms: float | None,
              slo_tpot_ms: float | None) -> dict:
    ok = [r for r in results if r.ok]

    def good(r: RequestResult) -> bool:
        ttft_ok = slo_ttft_ms is None or r.ttft * 1000.0 <= slo_ttft_ms
        tpot_ok = slo_tpot_ms is None or r.tpot is None or r.tpot * 1000.0 <= slo_tpot_ms
        return ttft_ok and tpot_ok

    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens or 0 for r in ok)
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s, "output_token_throughput": out_tokens / duration_s,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s,
        "goodput": sum(good(r) for r in ok) / duration_s,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "ttft_ms": _stats_ms([r.ttft for r in ok]), "tpot_ms": _stats_ms([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": _stats_ms([x for r in ok for x in r.itl]), "e2e_ms": _stats_ms([r.e2e for r in ok]),
        "errors": sorted({r.error for r in results if r.error})[:10],
    }


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def rows(runs: list[dict]) -> list[list[str]]:
    """The header, then one row per run: load, throughput, goodput, p50/p90/p99 of each latency (ms)."""
    lat = [(k, p) for k in ("ttft_ms", "tpot_ms", "itl_ms") for p in PERCENTILES]
    head = ["load", "ok", "fail", "req/s", "out tok/s", "goodput"] + [f"{k[:-3]} p{p}" for k, p in lat]
    out = [head]
    for run in runs:
        s = run["summary"]
        out.append([run["load"], str(s["completed"]), str(s["failed"]), _fmt(s["request_throughput"]),
                    _fmt(s["output_token_throughput"]), _fmt(s["goodput"])] + [_fmt(s[k][f"p{p}"]) for k, p in lat])
    return out


def table(runs: list[dict]) -> str:
    cells = rows(runs)
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n(latencies in ms; goodput: requests/s meeting the SLOs)"
