"""PNG plots of bench runs: latency CDFs (one line per run) and, for a sweep over request rates,
output throughput and p99 TTFT against the rate. Agg backend: no display needed."""
from __future__ import annotations

import os

import numpy as np


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plots and HTML reports need matplotlib: pip install 'kvserve[plots]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def latency_cdfs(runs: list[dict], path: str) -> str:
    """runs: {"load": label, "samples_ms": {"ttft": [...], "tpot": [...], "itl": [...]}}."""
    return _save(latency_cdfs_figure(runs), path)


def _save(fig, path: str) -> str:
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)
    return path


def latency_cdfs_figure(runs: list[dict]):
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key, title in zip(axes, ("ttft", "tpot", "itl"), ("TTFT", "TPOT", "inter-token latency")):
        for run in runs:
            xs = np.sort(np.asarray(run["samples_ms"][key], dtype=float))
            if xs.size:
                ax.step(xs, np.arange(1, xs.size + 1) / xs.size, where="post", label=run["load"])
        ax.set(title=f"{title} CDF", xlabel="ms", ylabel="fraction of samples", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        if runs:
            ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def rate_sweep(rates: list[float], runs: list[dict], path: str) -> str:
    return _save(rate_sweep_figure(rates, runs), path)


def rate_sweep_figure(rates: list[float], runs: list[dict]):
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(rates, [r["summary"]["output_token_throughput"] for r in runs], "o-", label="output tokens/s")
    a2 = a.twinx()
    a2.plot(rates, [r["summary"]["request_throughput"] for r in runs], "s--", color="tab:orange", label="requests/s")
    a.set(title="throughput vs request rate", xlabel="request rate (req/s)", ylabel="output tokens/s")
    a2.set_ylabel("requests/s")
    b.plot(rates, [r["summary"]["ttft_ms"]["p99"] for r in runs], "o-", color="tab:red")
    b.set(title="p99 TTFT vs request rate", xlabel="request rate (req/s)", ylabel="p99 TTFT (ms)")
    for ax in (a, b):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def throughput_figure(series: dict[str, list[dict]]):
    """Output tokens/s and p99 TTFT against the load, one line per series (a result file):
    against the request rate where every run has one, else against the concurrency."""
    plt = _pyplot()
    runs = [r for rs in series.values() for r in rs]
    by = "request_rate" if runs and all(r.get("request_rate") for r in runs) else "concurrency"
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for label, rs in series.items():
        pts = sorted((r.get(by) or 0, r["summary"]) for r in rs)
        xs = [x for x, _ in pts]
        a.plot(xs, [s["output_token_throughput"] for _, s in pts], "o-", label=label)
        b.plot(xs, [s["ttft_ms"]["p99"] or np.nan for _, s in pts], "o-", label=label)
    xlabel = "request rate (req/s)" if by == "request_rate" else "concurrency (0: no cap)"
    a.set(title=f"throughput vs {by.replace('_', ' ')}", xlabel=xlabel, ylabel="output tokens/s")
    b.set(title=f"p99 TTFT vs {by.replace('_', ' ')}", xlabel=xlabel, ylabel="p99 TTFT (ms)")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def kv_usage_figure(runs: list[dict]):
    """KV blocks in use (share of the pool) over each run's time, from its kv_usage samples."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(11, 3.5))
    for run in runs:
        kv = np.asarray(run.get("kv_usage") or [], dtype=float).reshape(-1, 3)
        if kv.size:
            ax.plot(kv[:, 0], 100 * kv[:, 1] / np.maximum(kv[:, 1] + kv[:, 2], 1), label=run["load"])
    ax.set(title="KV blocks in use", xlabel="seconds since the pass started", ylabel="% of the pool", ylim=(0, 101))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def write_all(runs: list[dict], sweep_rates: list[float] | None, plot_dir: str) -> list[str]:
    os.makedirs(plot_dir, exist_ok=True)
    paths = [latency_cdfs(runs, os.path.join(plot_dir, "latency_cdf.png"))]
    if sweep_rates and len(sweep_rates) > 1:
        paths.append(rate_sweep(sweep_rates, runs, os.path.join(plot_dir, "rate_sweep.png")))
    return paths
