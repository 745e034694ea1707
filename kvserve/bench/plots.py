"""PNG plots of bench runs: latency CDFs (one line per run) and, for a sweep over request rates,
output throughput and p99 TTFT against the rate. Agg backend: no display needed."""
from __future__ import annotations

import os

import numpy as np


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def latency_cdfs(runs: list[dict], path: str) -> str:
    """runs: {"load": label, "samples_ms": {"ttft": [...], "tpot": [...], "itl": [...]}}."""
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
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def rate_sweep(rates: list[float], runs: list[dict], path: str) -> str:
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
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_all(runs: list[dict], sweep_rates: list[float] | None, plot_dir: str) -> list[str]:
    os.makedirs(plot_dir, exist_ok=True)
    paths = [latency_cdfs(runs, os.path.join(plot_dir, "latency_cdf.png"))]
    if sweep_rates and len(sweep_rates) > 1:
        paths.append(rate_sweep(sweep_rates, runs, os.path.join(plot_dir, "rate_sweep.png")))
    return paths
