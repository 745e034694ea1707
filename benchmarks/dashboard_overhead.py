"""The dashboard's cost to the engine: step period with 0 and with 5 dashboards open.

One process: an LLMEngine on a tiny random model (so a step is mostly host work, where the
snapshot costs) with a KV pool of ~100k blocks, first filled with cached prefix blocks; the app
served by uvicorn on loopback; a load of --concurrency streaming requests kept in flight (a
shared prefix, so some blocks are shared); and 0 or --dashboards clients reading
/dashboard/events. Phases alternate (0, N, 0, N, ..., 0), short, so that drift in the machine's
load hits both alike; each phase reports the engine's step period (wall time over steps taken)
and the time inside step(). Each N phase is compared with the mean of the two 0 phases around it,
which cancels a drift that is linear over the three; the result is the median of those ratios
with a bootstrap 95% interval. Writes JSON with --out (a file, or a directory to write into).

    PYTHONPATH=$PWD python benchmarks/dashboard_overhead.py --kv-cache-memory 800MiB --phases 30 \
        --phase-seconds 2 --warmup-seconds 0.5
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fill(eng, blocks: int, prompt_len: int, rng: random.Random) -> None:
    """Leave about ``blocks`` cached-free blocks: distinct prompts, one output token each."""
    from kvserve.sampling_params import SamplingParams
    n = max(1, blocks * eng.kv.block_size // prompt_len)
    for i in range(n):
        eng.add_request(f"fill-{i}", [rng.randrange(1, 500) for _ in range(prompt_len)], SamplingParams(max_tokens=1))
    while eng.has_unfinished_requests():
        eng.step()


def _timed(fn, spent: dict, key: str):
    def timed(*a):
        t0 = time.perf_counter()
        try:
            return fn(*a)
        finally:
            spent[key] += time.perf_counter() - t0
    return timed


class Load:
    """The request load, on an asyncio loop of its own thread, and the dashboard readers, each a
    process of its own (as browsers are: their decoding does not compete for this process's GIL)."""

    def __init__(self, url: str, concurrency: int, prompt_len: int, max_tokens: int, seed: int):
        self.url, self.loop = url, asyncio.new_event_loop()
        self._readers: list[subprocess.Popen] = []
        rng = random.Random(seed)
        prefix = [rng.randrange(1, 500) for _ in range(prompt_len // 2)]
        self._prompts = [prefix + [rng.randrange(1, 500) for _ in range(prompt_len - len(prefix))] for _ in range(64)]
        self._body = {"model": "m", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        for i in range(concurrency):
            asyncio.run_coroutine_threadsafe(self._client(i), self.loop)

    async def _client(self, i: int) -> None:
        async with httpx.AsyncClient(timeout=600) as c:
            while True:
                body = {**self._body, "prompt": self._prompts[i % len(self._prompts)]}
                r = await c.post(self.url + "/v1/completions", json=body)
                r.raise_for_status()
                i += 7

    def start_readers(self, n: int) -> None:
        """Start the reader processes now, closed, so their start-up falls in no phase."""
        env = {**os.environ, "PYTHONPATH": ""}
        self._readers = [subprocess.Popen([sys.executable, __file__, "--read-dashboard", self.url], env=env,
                                          stdin=subprocess.PIPE, text=True) for _ in range(n)]

    def set_pages(self, n: int) -> None:
        for i, p in enumerate(self._readers):
            p.stdin.write("open\n" if i < n else "close\n")
            p.stdin.flush()

    def stop_readers(self) -> None:
        for p in self._readers:
            p.stdin.close()
        for p in self._readers:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def read_dashboard(url: str) -> None:
    """One dashboard page's share of the work: on "open" (stdin), read every event and decode it,
    until "close"."""
    stop, reader = threading.Event(), None

    def read():
        with httpx.stream("GET", url + "/dashboard/events", timeout=None) as r:
            for line in r.iter_lines():
                if stop.is_set():
                    return
                if line.startswith("data: "):
                    base64.b64decode(json.loads(line[6:]).get("map", ""))

    for cmd in sys.stdin:
        if cmd.strip() == "open" and reader is None:
            stop.clear()
            reader = threading.Thread(target=read, daemon=True)
            reader.start()
        elif cmd.strip() == "close" and reader is not None:
            stop.set()
            reader.join()
            reader = None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:tiny")
    ap.add_argument("--kv-cache-memory", default="800MiB", help="dummy:tiny: 8 KiB per 16-token block")
    ap.add_argument("--fill-fraction", type=float, default=0.5, help="of the pool, left as cached-free blocks")
    ap.add_argument("--dashboards", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--phases", type=int, default=6, help="pairs of phases (without, with)")
    ap.add_argument("--phase-seconds", type=float, default=8.0)
    ap.add_argument("--warmup-seconds", type=float, default=2.0)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--read-dashboard", default=None, help=argparse.SUPPRESS)  # a reader process's server URL
    args = ap.parse_args()
    if args.read_dashboard:
        return read_dashboard(args.read_dashboard)

    # kvserve (and torch) only here: the reader processes above need neither.
    import uvicorn

    from kvserve.config import CacheConfig, EngineConfig, parse_size
    from kvserve.engine.async_engine import AsyncEngine
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.server.app import build_app
    eng = LLMEngine(EngineConfig(model=args.model, show_progress=False,
                                 cache=CacheConfig(kv_cache_memory=parse_size(args.kv_cache_memory))))
    pool = eng.kv.pool
    t0 = time.perf_counter()
    _fill(eng, int(pool.num_blocks * args.fill_fraction), 2000 if eng.max_model_len > 2000 else eng.max_model_len - 1,
          random.Random(0))
    print(f"pool: {pool.num_blocks} blocks, {pool.num_cached_blocks} cached after filling "
          f"({time.perf_counter() - t0:.1f}s)", flush=True)

    port = _free_port()
    ae = AsyncEngine(eng)
    # Time the dashboard's two halves where they run: the copy on the engine thread, and the
    # encoding on a worker thread (which holds the GIL for part of it).
    from kvserve.server import dashboard
    spent = {"take": 0.0, "build": 0.0}
    dashboard._take, dashboard.build_frame = _timed(dashboard._take, spent, "take"), _timed(
        dashboard.build_frame, spent, "build")
    app = build_app(ae, served_model_name="m")
    hub = app.state.dashboard
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    server_thread = threading.Thread(target=server.run, daemon=True)
    server_thread.start()
    url = f"http://127.0.0.1:{port}"
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    load = Load(url, args.concurrency, args.prompt_len, args.max_tokens, seed=1)
    load.start_readers(args.dashboards)

    # The load's clients start on their own thread: begin once the engine is stepping under it.
    s0, deadline = eng.stats.num_steps, time.monotonic() + 300
    while eng.stats.num_steps - s0 < 100 or ae.snapshot.num_running < args.concurrency // 2:
        if time.monotonic() > deadline:
            sys.exit("the load did not start within 300 s")
        time.sleep(0.1)
    rows = []
    for phase in range(2 * args.phases + 1):
        pages = 0 if phase % 2 == 0 else args.dashboards
        load.set_pages(pages)
        time.sleep(args.warmup_seconds)
        s0, b0, w0, k0, e0 = (eng.stats.num_steps, eng.stats.busy_time, time.perf_counter(), spent["take"],
                              spent["build"])
        time.sleep(args.phase_seconds)
        while eng.stats.num_steps - s0 < 20:  # a phase is at least 20 steps, however slow the machine
            time.sleep(0.05)
        s1, b1, w1, k1, e1 = (eng.stats.num_steps, eng.stats.busy_time, time.perf_counter(), spent["take"],
                              spent["build"])
        steps = s1 - s0
        row = {"dashboards": pages, "steps": steps, "step_period_ms": 1e3 * (w1 - w0) / steps,
               "in_step_ms": 1e3 * (b1 - b0) / steps, "pages_open": hub.num_pages,
               "take_share": (k1 - k0) / (w1 - w0), "build_share": (e1 - e0) / (w1 - w0),
               "running": ae.snapshot.num_running,
               "cached_blocks": pool.num_cached_blocks, "used_blocks": pool.num_used_blocks}
        rows.append(row)
        print(f"{pages} dashboards: {steps} steps, step period {row['step_period_ms']:.3f} ms "
              f"(in step {row['in_step_ms']:.3f} ms), {row['pages_open']} pages open, engine thread in take "
              f"{100 * row['take_share']:.3f}%, encoding {100 * row['build_share']:.3f}%, {row['running']} running, "
              f"{row['used_blocks']} used / {row['cached_blocks']} cached blocks", flush=True)
    load.stop_readers()

    def med(n, key):
        return statistics.median(r[key] for r in rows if r["dashboards"] == n)

    def bracketed(key):
        """Each N phase over the mean of its two neighbouring 0 phases: median, bootstrap 95%."""
        ratios = [rows[i][key] / ((rows[i - 1][key] + rows[i + 1][key]) / 2) for i in range(1, len(rows) - 1, 2)]
        rng = random.Random(0)
        boots = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
        return statistics.median(ratios), boots[50], boots[1949], ratios
    off, on = med(0, "step_period_ms"), med(args.dashboards, "step_period_ms")
    ratio, lo, hi, ratios = bracketed("step_period_ms")
    in_ratio, in_lo, in_hi, _ = bracketed("in_step_ms")
    summary = {"num_blocks": pool.num_blocks, "step_period_ms_0": off, f"step_period_ms_{args.dashboards}": on,
               "ratio": ratio, "ratio_95": [lo, hi], "pair_ratios": ratios,
               "in_step_ratio": in_ratio, "in_step_ratio_95": [in_lo, in_hi],
               "in_step_ms_0": med(0, "in_step_ms"),
               f"in_step_ms_{args.dashboards}": med(args.dashboards, "in_step_ms"),
               "take_share_max": max(r["take_share"] for r in rows),
               "build_share_max": max(r["build_share"] for r in rows),
               "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"}
    print(f"\nmedian step period: {off:.3f} ms with 0 dashboards, {on:.3f} ms with {args.dashboards}; "
          f"bracketed ratio {ratio:.4f} (95% {lo:.4f}-{hi:.4f}), inside step() {in_ratio:.4f} "
          f"({in_lo:.4f}-{in_hi:.4f}); engine thread in the snapshot copy <= {100 * summary['take_share_max']:.3f}% "
          f"of the time, encoding on a worker <= {100 * summary['build_share_max']:.3f}%")
    if args.out:
        if os.path.isdir(args.out):
            args.out = os.path.join(args.out, "dashboard_overhead.json")
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "summary": summary, "phases": rows}, f, indent=1)
        print(f"wrote {args.out}")
    # Let the app's shutdown stop the engine: a daemon thread killed inside a torch op at
    # interpreter exit aborts the process.
    server.should_exit = True
    server_thread.join(60)


if __name__ == "__main__":
    main()
