"""/dashboard/events from a real server with a CPU KV tier, read as plain HTTP: the map decodes
(with struct, not our decoder) to one state per block and agrees with the counts and /metrics,
the tiers are listed with their capacity, and frames come at about 2 Hz."""
from __future__ import annotations

import base64
import json
import struct
import time

import httpx
import pytest
from server_proc import ServerProcess

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--model", "dummy:tiny", "--kv-cache-memory", "2MiB", "--cpu-kv-memory", "8MiB",
                      "--served-model-name", "tiny")
    yield s
    s.stop()


def _frames(url: str, n: int) -> tuple[list[dict], float]:
    frames, t0 = [], time.monotonic()
    with httpx.stream("GET", url + "/dashboard/events", timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                frames.append(json.loads(line[6:]))
                if len(frames) == n:
                    return frames, time.monotonic() - t0
    raise AssertionError("the stream ended")


def test_frames_decode_and_list_the_tiers(server):
    prompt = [(5 * i) % 400 + 1 for i in range(40)]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200
    m = server.wait_idle()
    frames, took = _frames(server.url, 5)
    assert 1.2 < took < 15.0  # 5 frames at ~2 Hz, the first at once: never faster
    f = frames[-1]
    states = [w & 3 for (w,) in struct.iter_unpack("<I", base64.b64decode(f["map"])) for _ in range(w >> 2)]
    assert len(states) == f["num_blocks"] == m["kvserve_kv_blocks_free"]
    assert {name: states.count(i) for i, name in enumerate(("free", "cached", "used", "shared"))} == f["counts"]
    assert f["counts"]["cached"] == m["kvserve_kv_blocks_cached"] == 40 // f["block_size"] >= 1
    assert f["running"] == f["waiting"] == 0 and f["requests"] == []
    gpu, cpu = f["tiers"]
    assert (gpu["name"], gpu["capacity"], gpu["used"], gpu["cached"]) == ("gpu", f["num_blocks"], 0,
                                                                          f["counts"]["cached"])
    assert cpu["name"] == "cpu" and cpu["capacity"] == 8 << 20 and 0 <= cpu["hit_rate"] <= 1
    assert f["kv_format"].startswith(f"{f['num_blocks']} blocks x {f['block_size']} tokens")
