"""`kvserve serve --min-replicas 0 --max-replicas 1`: no replica until a request comes; that
request waits for the first one and is answered; idle, the deployment scales back to zero, and
the next request brings a new replica up again."""
from __future__ import annotations

import time

import openai
import pytest
from ray_proc import ray_server, replica_pids

pytest.importorskip("ray", reason="the ray extra is not installed (pip install kvserve[ray])")

pytestmark = pytest.mark.slow


def test_scale_to_zero_and_back_with_a_request_waiting():
    # A small random model: what is tested is the replicas coming and going, not the model.
    with ray_server("--min-replicas", "0", "--max-replicas", "1", "--scale-down-delay", "2",
                    "--cpus-per-replica", "0.5", "--model", "dummy:tiny", "--served-model-name", "smol",
                    "--kv-cache-memory", "16MiB", "--max-model-len", "2048", wait_healthy=False) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=240)
        assert replica_pids() == []
        ids = []
        for turn in range(2):
            r = client.completions.with_raw_response.create(model="smol", prompt=[5, 6, 7], max_tokens=4)
            assert r.parse().usage.completion_tokens == 4  # answered by a replica started for it
            ids.append(r.headers["x-kvserve-replica"])
            if turn == 0:
                deadline = time.monotonic() + 120
                while replica_pids():  # idle past --scale-down-delay: back to zero
                    assert time.monotonic() < deadline, "the idle replica was not removed"
                    time.sleep(1)
        assert ids[0] != ids[1]
