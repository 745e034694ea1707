"""`kvserve bench serve` against a real `kvserve serve --model dummy:tiny` process: every request
succeeds with exactly the output length asked, the summaries are sane, the PNGs are PNGs, and the
HTML reports (`--report`, `bench compare --report`) parse, embed their plots and carry the table."""
from __future__ import annotations

import base64
import json
from html.parser import HTMLParser

import pytest
from server_proc import ServerProcess

from kvserve.cli import main

MODEL = "tiny"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--model", "dummy:tiny", "--kv-cache-memory", "64MiB", "--served-model-name", MODEL)
    yield s
    s.stop()


def _bench(server, tmp_path, *extra: str) -> dict:
    out = tmp_path / "bench.json"
    rc = main(["bench", "serve", "--base-url", f"{server.url}/v1", "--model", MODEL, "--prompt-format", "token-ids",
               "--num-requests", "8", "--input-len-min", "4", "--input-len-max", "24", "--output-len-min", "2",
               "--output-len-max", "12", "--slo-ttft-ms", "5000", "--slo-tpot-ms", "1000",
               "--json-out", str(out), "--plot-dir", str(tmp_path / "plots"), *extra])
    assert rc == 0
    return json.loads(out.read_text())


def _check_run(run: dict, n: int) -> None:
    s = run["summary"]
    assert (s["completed"], s["failed"]) == (n, 0), s["errors"]
    for r in run["requests"]:
        assert r["ok"] and r["output_tokens"] == r["expected_output_tokens"], r
        assert r["prompt_tokens"] == r["input_len"]  # token-ids prompts: exact
        assert 0 < r["ttft_s"] <= r["e2e_s"]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        st = s[key]
        assert 0 <= st["p50"] <= st["p90"] <= st["p99"], (key, st)
    assert s["total_output_tokens"] == sum(r["expected_output_tokens"] for r in run["requests"])
    assert 0 < s["goodput"] <= s["request_throughput"] + 1e-9
    assert s["output_token_throughput"] > s["request_throughput"] > 0


def _check_png(path) -> None:
    data = path.read_bytes()
    assert len(data) > 1000 and data.startswith(PNG_SIGNATURE), path


def test_fixed_concurrency(server, tmp_path):
    out = _bench(server, tmp_path, "--concurrency", "3")
    (run,) = out["runs"]
    _check_run(run, 8)
    assert run["concurrency"] == 3 and out["config"]["dataset"] == "random"
    _check_png(tmp_path / "plots" / "latency_cdf.png")


def test_poisson_rate_sweep(server, tmp_path):
    out = _bench(server, tmp_path, "--request-rates", "4,16")
    assert [r["request_rate"] for r in out["runs"]] == [4.0, 16.0]
    for run in out["runs"]:
        _check_run(run, 8)
    _check_png(tmp_path / "plots" / "latency_cdf.png")
    _check_png(tmp_path / "plots" / "rate_sweep.png")


def test_multiturn_sessions_share_system_prompt():
    from kvserve.bench.datasets import multiturn_sessions
    ss = multiturn_sessions(7, 3, 40, (5, 10), (2, 4), seed=1)
    assert [len(s.turns) for s in ss] == [3, 3, 1]
    assert len({s.system_prompt for s in ss}) == 1 and len(ss[0].system_prompt.split()) == 40
    assert all(5 <= len(t.user_message.split()) <= 10 and 2 <= t.output_len <= 4 for s in ss for t in s.turns)


def test_bad_config_is_refused(server):
    assert main(["bench", "serve", "--base-url", f"{server.url}/v1", "--model", MODEL,
                 "--input-len-min", "9", "--input-len-max", "3"]) == 2


class _Page(HTMLParser):
    """What a report page holds, as html.parser sees it: images, table cells, external refs."""

    def __init__(self):
        super().__init__()
        self.images, self.rows, self.external = [], [], []
        self._row = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "img":
            self.images.append(a["src"])
        for key in ("src", "href"):
            if key in a and not a[key].startswith("data:"):
                self.external.append(a[key])
        if tag == "tr":
            self._row = []
        elif tag in ("td", "th") and self._row is not None:
            self._row.append("")

    def handle_endtag(self, tag):
        if tag == "tr" and self._row is not None:
            self.rows.append(self._row)
            self._row = None

    def handle_data(self, data):
        if self._row:
            self._row[-1] += data


def _parse_report(path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    page.close()
    assert page.external == []  # self-contained
    for src in page.images:
        assert src.startswith("data:image/png;base64,")
        png = base64.b64decode(src.split(",", 1)[1], validate=True)
        assert len(png) > 1000 and png.startswith(PNG_SIGNATURE)
    return page


def _row_of(run: dict) -> list[str]:
    s = run["summary"]
    return [run["load"], str(s["completed"]), str(s["failed"]), f"{s['request_throughput']:.2f}",
            f"{s['output_token_throughput']:.2f}"]


def test_html_report_and_compare(server, tmp_path):
    out = _bench(server, tmp_path, "--concurrency", "2", "--report", str(tmp_path / "report.html"))
    (run,) = out["runs"]
    assert run["kv_usage"] and all(used >= 0 and free >= 0 for _, used, free in run["kv_usage"])
    page = _parse_report(tmp_path / "report.html")
    assert len(page.images) == 3  # throughput, latency CDFs, KV usage over time
    head, *body = page.rows
    assert head[:3] == ["load", "ok", "fail"]
    assert [r[:5] for r in body] == [_row_of(run)]

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(out))
    out_b = _bench(server, tmp_path, "--concurrency", "4")
    b.write_text(json.dumps(out_b))
    assert main(["bench", "compare", str(a), str(b), "--report", str(tmp_path / "cmp.html")]) == 0
    page = _parse_report(tmp_path / "cmp.html")
    assert len(page.images) == 3
    head, *body = page.rows
    assert head[:2] == ["result", "load"]
    assert [r[:6] for r in body] == [["a.json", *_row_of(out["runs"][0])], ["b.json", *_row_of(out_b["runs"][0])]]


def test_compare_refuses_what_is_not_a_result(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"config": {}}')
    assert main(["bench", "compare", str(bad)]) == 2
    bad.write_text("not json")
    assert main(["bench", "compare", str(bad)]) == 2
