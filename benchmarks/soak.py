"""Soak: a real ``kvserve serve`` under mixed traffic and injected tier faults, on the CPU.

For ``--minutes`` (30 by default) workers send a mix of requests to a server with all three KV
tiers on (CPU memory, a disk directory, Redis) and a KV pool small enough that prefixes keep
moving between them:

    streamed and whole chat/completions, greedy or seeded, over prompts that share prefixes
    streams the client drops after a few chunks
    bad requests (out of range, huge integers, NaN, null, wrong types, oversized), ~5%

while a fault injector, in turn, kills Redis and restarts it empty, fills the disk tier's file
system (a small tmpfs when run as root) and frees it, and damages chunk files on disk.

Checked, and the run fails (exit 1) if any does not hold:
- no 5xx and no lost answer: every request that was not dropped on purpose gets its whole
  answer (a stream ends with ``[DONE]``); every bad request gets a 4xx;
- nothing corrupted: a greedy or seeded request's text is the same every time it is asked;
- no KV block leaked: at each quiet point (workers paused) the pool has no used block;
- memory flat: the server's resident memory in the last fifth of the run is within
  ``--rss-growth`` of its level after the first fifth;
- the engine healthy: ``/health`` is 200 at every probe.

    python benchmarks/soak.py --minutes 30 --out benchmarks/results/soak
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "soak-key"

# Bodies the server must refuse with a 4xx (merged into a valid request).
BAD = [
    {"top_k": 99999999999999999999}, {"seed": 2**64}, {"seed": -2**63 - 1}, {"temperature": float("inf")},
    {"temperature": 2.5}, {"top_p": 0}, {"max_tokens": -1}, {"max_tokens": 2**63}, {"n": 0},
    {"n": "two"}, {"presence_penalty": 3}, {"stop": [""]}, {"logprobs": 1000}, {"min_p": -1},
    {"repetition_penalty": 0}, {"messages": []}, {"messages": None}, {"messages": [{"role": "robot"}]},
    {"model": None}, {"session_id": "x" * 10_000}, {"unknown_field": 1},
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class Redis:
    def __init__(self, port: int):
        self.port, self.proc = port, None

    def start(self) -> None:
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--save", "", "--appendonly", "no"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.3)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class DiskFill:
    """The disk tier on a small tmpfs (root only), so it can really fill up."""

    def __init__(self, size_mib: int):
        self.dir = tempfile.mkdtemp(prefix="kvserve-soak-disk-")
        self.mounted = os.geteuid() == 0 and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", self.dir],
            capture_output=True).returncode == 0
        self.filler = os.path.join(self.dir, "filler")

    def fill(self) -> bool:
        if not self.mounted:
            return False
        with open(self.filler, "wb") as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * (1 << 20))
        return True

    def free(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.filler)

    def damage(self, rng: random.Random, k: int) -> int:
        chunks = [os.path.join(d, f) for d, _, fs in os.walk(self.dir) for f in fs if f != "filler"]
        for path in rng.sample(chunks, min(k, len(chunks))):
            with contextlib.suppress(OSError), open(path, "r+b") as f:
                size = os.path.getsize(path)
                f.seek(rng.randrange(max(1, size)))
                f.write(bytes([rng.randrange(256)]))
        return min(k, len(chunks))

    def close(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", self.dir], capture_output=True)
        with contextlib.suppress(OSError):
            os.rmdir(self.dir)


class Soak:
    def __init__(self, args, url: str, server: subprocess.Popen):
        self.args, self.url, self.server = args, url, server
        self.headers = {"Authorization": f"Bearer {KEY}"}
        self.counts: Counter = Counter()
        self.failures: list[str] = []
        self.answers: dict[str, str] = {}
        self.rss: list[tuple[float, float]] = []
        self.quiet_points: list[dict] = []
        self.faults: Counter = Counter()
        self.paused = asyncio.Event()
        self.paused.set()
        self.in_flight = 0
        rng = random.Random(args.seed)
        words = ("memory bandwidth decides decode speed while capacity decides how many users fit "
                 "on one card and fragmentation wastes both of them every single step").split()
        systems = [" ".join(rng.choices(words, k=rng.randrange(40, 120))) for _ in range(4)]
        self.prompts = [(s, " ".join(rng.choices(words, k=rng.randrange(3, 30)))) for s in systems for _ in range(3)]

    def fail(self, what: str) -> None:
        self.counts["failures"] += 1
        if len(self.failures) < 50:
            self.failures.append(what)

    def body(self, rng: random.Random, chat: bool, stream: bool) -> tuple[str, dict, str | None]:
        system, user = rng.choice(self.prompts)
        seeded = rng.random() < 0.3
        body = {"model": "soak", "max_tokens": 24, "stream": stream}
        body |= {"temperature": 0.8, "seed": rng.randrange(2)} if seeded else {"temperature": 0}
        if chat:
            body["messages"] = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        else:
            body["prompt"] = system + "\n" + user
        key = json.dumps({k: v for k, v in body.items() if k != "stream"}, sort_keys=True)
        return ("/v1/chat/completions" if chat else "/v1/completions"), body, key

    def check_answer(self, key: str, text: str) -> None:
        seen = self.answers.setdefault(key, text)
        if seen != text:
            self.fail(f"answer changed for {key[:80]}: {seen[:40]!r} != {text[:40]!r}")

    async def one(self, client: httpx.AsyncClient, rng: random.Random) -> None:
        r = rng.random()
        chat = rng.random() < 0.5
        if r < 0.05:
            path, body, _ = self.body(rng, chat, stream=rng.random() < 0.5)
            body |= rng.choice(BAD)
            resp = await client.post(self.url + path, content=json.dumps(body, allow_nan=True), headers=self.headers)
            self.counts[f"bad_{resp.status_code // 100}xx"] += 1
            if not 400 <= resp.status_code < 500:
                self.fail(f"bad request {body} got {resp.status_code}: {resp.text[:200]}")
            return
        stream = r < 0.65
        drop = stream and r < 0.20
        path, body, key = self.body(rng, chat, stream)
        if not stream:
            resp = await client.post(self.url + path, json=body, headers=self.headers)
            self.counts[f"whole_{resp.status_code}"] += 1
            if resp.status_code != 200:
                self.fail(f"{path} got {resp.status_code}: {resp.text[:200]}")
                return
            c = resp.json()["choices"][0]
            self.check_answer(key, c["message"]["content"] if chat else c["text"])
            return
        text, done, chunks = [], False, 0
        async with client.stream("POST", self.url + path, json=body, headers=self.headers) as resp:
            if resp.status_code != 200:
                self.counts[f"stream_{resp.status_code}"] += 1
                self.fail(f"stream {path} got {resp.status_code}")
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                d = json.loads(line[6:])
                if "error" in d:
                    self.fail(f"stream error event: {d['error']}")
                    return
                chunks += 1
                if d.get("choices"):
                    c = d["choices"][0]
                    text.append((c.get("delta") or {}).get("content") or "" if chat else c.get("text") or "")
                if drop and chunks >= 2:
                    self.counts["dropped"] += 1
                    return  # closing the response drops the connection mid-stream
        self.counts["stream_200"] += 1
        if not done:
            self.fail(f"stream {path} ended without [DONE]")
        else:
            self.check_answer(key, "".join(text))

    async def worker(self, i: int, deadline: float) -> None:
        rng = random.Random(self.args.seed * 1000 + i)
        async with httpx.AsyncClient(timeout=self.args.timeout) as client:
            while time.monotonic() < deadline:
                await self.paused.wait()
                self.in_flight += 1
                try:
                    await self.one(client, rng)
                except (httpx.HTTPError, json.JSONDecodeError) as e:
                    self.fail(f"{type(e).__name__}: {e}")
                finally:
                    self.in_flight -= 1

    async def metrics(self, client: httpx.AsyncClient) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families
        text = (await client.get(self.url + "/metrics", headers=self.headers)).text
        return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                if not s.labels}

    async def monitor(self, deadline: float, redis: Redis, disk: DiskFill) -> None:
        rng = random.Random(self.args.seed + 7)
        start = time.monotonic()
        next_fault, next_quiet, k = start + 20, start + 60, 0
        async with httpx.AsyncClient(timeout=30) as client:
            while time.monotonic() < deadline:
                await asyncio.sleep(2)
                now = time.monotonic()
                self.rss.append((round(now - start, 1), rss_mib(self.server.pid)))
                h = await client.get(self.url + "/health")
                if h.status_code != 200:
                    self.fail(f"/health {h.status_code}: {h.text[:200]}")
                if now >= next_fault:
                    fault = ("redis_killed", "disk_filled", "chunks_damaged")[k % 3]
                    k += 1
                    if fault == "redis_killed":
                        redis.kill()
                        await asyncio.sleep(20)
                        redis.start()
                    elif fault == "disk_filled":
                        if disk.fill():
                            await asyncio.sleep(30)
                            disk.free()
                        else:
                            fault = "disk_fill_skipped"
                    else:
                        self.faults["chunk_files_damaged"] += disk.damage(rng, 8)
                    self.faults[fault] += 1
                    next_fault = time.monotonic() + self.args.fault_every
                if now >= next_quiet:
                    self.paused.clear()
                    t = time.monotonic()
                    while self.in_flight and time.monotonic() - t < 300:
                        await asyncio.sleep(0.1)
                    m, t = {}, time.monotonic()
                    while True:  # at least one read, then until idle or 60 s
                        m = await self.metrics(client)
                        if (m.get("kvserve_num_requests_running") == 0 and m.get("kvserve_num_requests_waiting") == 0
                                and m.get("kvserve_kv_blocks_used") == 0):
                            break
                        if time.monotonic() - t > 60:
                            break
                        await asyncio.sleep(0.2)
                    used = m.get("kvserve_kv_blocks_used")
                    self.quiet_points.append({"t": round(now - start), "kv_blocks_used": used,
                                              "rss_mib": round(rss_mib(self.server.pid), 1)})
                    if used != 0:
                        self.fail(f"quiet point: {used} KV blocks still used")
                    self.paused.set()
                    next_quiet = time.monotonic() + self.args.quiet_every

    async def run(self, redis: Redis, disk: DiskFill) -> None:
        deadline = time.monotonic() + self.args.minutes * 60
        await asyncio.gather(self.monitor(deadline, redis, disk),
                             *(self.worker(i, deadline) for i in range(self.args.workers)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--model", default=None, help="default: kvserve's default model")
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--kv-cache-memory", default="128MiB", help="small, so prefixes move to the tiers")
    ap.add_argument("--cpu-kv-memory", default="64MiB")
    ap.add_argument("--disk-mib", type=int, default=64, help="tmpfs size for the disk tier (root only)")
    ap.add_argument("--fault-every", type=float, default=60.0, help="seconds between injected faults")
    ap.add_argument("--quiet-every", type=float, default=150.0, help="seconds between block-leak checks")
    ap.add_argument("--rss-growth", type=float, default=1.15, help="allowed end/start resident-memory ratio")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="directory for soak.json")
    args = ap.parse_args()

    redis = Redis(free_port())
    redis.start()
    disk = DiskFill(args.disk_mib)
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="kvserve-soak-", suffix=".log", delete=False)
    model = ["--model", args.model] if args.model else []
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", *model, "--port", str(port),
           "--served-model-name", "soak", "--api-key", KEY, "--kv-cache-memory", args.kv_cache_memory,
           "--cpu-kv-memory", args.cpu_kv_memory, "--disk-kv-dir", disk.dir,
           "--disk-kv-size", f"{args.disk_mib}MiB", "--redis-url", f"redis://127.0.0.1:{redis.port}/0",
           "--idle-offload-seconds", "5"]
    server = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={
        **os.environ, "PYTHONPATH": REPO})
    url = f"http://127.0.0.1:{port}"
    soak = Soak(args, url, server)
    t0 = time.monotonic()
    try:
        while True:
            if server.poll() is not None:
                raise SystemExit(f"server exited {server.returncode}; log: {log.name}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.3)
        asyncio.run(soak.run(redis, disk))
    finally:
        server.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(60)
        if server.poll() is None:
            server.kill()
            soak.fail("server did not exit within 60 s of SIGTERM")
        redis.kill()
        disk.close()
    log.seek(0)
    server_log = log.read()
    if "Traceback" in server_log:
        soak.fail("a traceback in the server log: " + log.name)
    if server.returncode not in (0, None):
        soak.fail(f"server exit status {server.returncode}")
    rss = [v for _, v in soak.rss]
    fifth = max(1, len(rss) // 5)
    early, late = sorted(rss[fifth:2 * fifth])[len(rss[fifth:2 * fifth]) // 2], sorted(rss[-fifth:])[fifth // 2]
    growth = late / early if early else float("nan")
    if not growth <= args.rss_growth:
        soak.fail(f"resident memory grew {growth:.2f}x ({early:.0f} -> {late:.0f} MiB)")
    result = {
        "benchmark": "soak", "model": args.model or "default", "minutes": args.minutes, "workers": args.workers,
        "wall_s": round(time.monotonic() - t0, 1), "requests": dict(soak.counts),
        "distinct_answers_checked": len(soak.answers), "faults": dict(soak.faults),
        "disk_tier_on_tmpfs": disk.mounted, "quiet_points": soak.quiet_points,
        "rss_mib": {"after_first_fifth": round(early, 1), "last_fifth": round(late, 1), "growth": round(growth, 3)},
        "failures": soak.failures, "passed": not soak.failures,
        "host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "quiet_points"}, indent=1))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "soak.json"), "w") as f:
            json.dump(result | {"rss_series": soak.rss}, f, indent=1)
    os.unlink(log.name) if not soak.failures else print(f"server log kept: {log.name}", file=sys.stderr)
    return 0 if not soak.failures else 1


if __name__ == "__main__":
    sys.exit(main())
