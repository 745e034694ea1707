"""`kvserve serve` with replicas on a local Ray instance, in a subprocess, for the Ray tests."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx
from server_proc import REPO, free_port

from kvserve.cluster.launch import PROBE_DEADLINES

REPLICA_PROCESS = "ray::ServeReplica:kvserve:EngineReplica"  # Ray's title for a replica's process


_SERVERS: list[int] = []  # the pids of the servers ``ray_server`` has running in this process


def _parents() -> dict[int, int]:
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):  # gone meanwhile
                pass
    return parents


def replica_pids() -> list[int]:
    """The replica processes of the Ray instance this process's server started: its descendants
    (Ray's processes are children of the driver, replicas their children). Another test file's
    Ray instance, beside this one on another worker, has replicas of the same title."""
    out = subprocess.run(["pgrep", "-f", REPLICA_PROCESS], capture_output=True, text=True).stdout
    parents, roots, mine = _parents(), set(_SERVERS), []
    for pid in map(int, out.split()):
        p = pid
        while p > 1 and p not in roots:
            p = parents.get(p, 0)
        if p in roots:
            mine.append(pid)
    return mine


@contextlib.contextmanager
def ray_server(*args: str, wait_healthy: bool = True, timeout: float = 240):
    """Yields the base URL once the application is up (and, with ``wait_healthy``, once /health
    is 200 with every one of ``--replicas N`` healthy: replicas start one after another, and a
    router that sees one of two sends everything there; a probe goes to a replica, so at zero
    replicas it would start one). On exit: SIGTERM, which deletes the application and stops the
    local Ray instance."""
    replicas = int(args[args.index("--replicas") + 1]) if "--replicas" in args else 1
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)  # a pipe could fill and block Ray
    # Twice the time kvserve gives a replica to answer the router's queue-length probe: other test
    # files run beside these on a loaded 2-core machine, and a replica passed over would show the
    # fallback instead of the ranking the tests check.
    env = {**os.environ, **{k: str(2 * float(v)) for k, v in PROBE_DEADLINES.items()}}
    proc = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", "--port", str(port), *args],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    _SERVERS.append(proc.pid)
    try:
        while True:
            assert proc.poll() is None, f"the server exited {proc.returncode}:\n{open(log.name).read()}"
            assert time.monotonic() < deadline, f"not ready in time:\n{open(log.name).read()}"
            if not wait_healthy:
                if "kvserve: listening" in open(log.name).read():
                    break
            else:
                try:
                    r = httpx.get(f"{url}/health", timeout=2)
                    if r.status_code == 200 and r.json()["healthy_replicas"] >= replicas:
                        break
                except httpx.HTTPError:
                    pass
            time.sleep(0.5)
        yield url
    finally:
        _SERVERS.remove(proc.pid)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        os.unlink(log.name)
