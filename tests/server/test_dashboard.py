"""/dashboard in a real headless Chromium (Playwright) against a real `kvserve serve` process:
requests that share a prefix show shared blocks on the page map while they run, and their
blocks return to free or cached-free once they end (their clients leave); behind a key, the page, its script and
its event stream are 401 without it. Screenshot: $KVSERVE_DASHBOARD_SCREENSHOT, else tmp_path."""
from __future__ import annotations

import os
import shutil
import threading

import httpx
import pytest
from server_proc import ServerProcess

pytestmark = pytest.mark.e2e

KEY = "dashboard-test-key"
CHROMIUM = next((p for p in (os.environ.get("KVSERVE_CHROMIUM"), shutil.which("chromium"),
                             shutil.which("chromium-browser")) if p), None)
if CHROMIUM is None:
    pytest.skip("needs a Chromium binary (apt-get install chromium, or KVSERVE_CHROMIUM=path)", allow_module_level=True)
from playwright import sync_api as playwright  # noqa: E402 - the test extra has it; only the browser may be absent


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--model", "dummy:tiny", "--kv-cache-memory", "4MiB", "--served-model-name", "tiny",
                      "--api-key", KEY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


def _map(page) -> dict:
    return page.eval_on_selector("#kvmap", "e => ({...e.dataset})")


def _frames(page) -> int:
    return int(page.get_attribute("#status", "data-frames"))


def test_without_the_key_everything_is_401(server):
    for path in ("/dashboard", "/dashboard/dashboard.js", "/dashboard/events"):
        r = httpx.get(server.url + path, timeout=10)
        assert r.status_code == 401, path
        assert r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.get(server.url + path, headers={"Authorization": "Bearer not-the-key"}, timeout=10)
        assert r.status_code == 401, path


def test_page_shows_shared_blocks_then_frees_them(server, browser, tmp_path):
    # bypass_csp: the page's policy forbids eval, which Playwright's wait_for_function uses.
    ctx = browser.new_context(extra_http_headers={"Authorization": f"Bearer {KEY}"},
                              viewport={"width": 1100, "height": 900}, bypass_csp=True)
    page = ctx.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server.url + "/dashboard")
    page.wait_for_function("Number(document.querySelector('#status').dataset.frames) >= 1", timeout=20_000)
    m = _map(page)
    n = int(m["numBlocks"])
    assert int(m["free"]) + int(m["cached"]) == n and int(m["used"]) == int(m["shared"]) == 0

    # Two streamed requests whose prompts share 64 tokens (4 full blocks of 16), long enough to
    # outlast any check; the client leaves once the page has shown them, which frees their blocks.
    prefix = [(7 * i) % 400 + 1 for i in range(64)]
    leave, outcomes = threading.Event(), []

    def run(tail):
        body = {"model": "tiny", "prompt": prefix + tail, "max_tokens": 1900, "ignore_eos": True, "temperature": 0,
                "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
            outcomes.append(r.status_code)
            for _ in r.iter_lines():
                if leave.is_set():
                    return

    threads = [threading.Thread(target=run, args=([11, 12, 13],)), threading.Thread(target=run, args=([21, 22],))]
    for t in threads:
        t.start()
    page.wait_for_function("Number(document.querySelector('#kvmap').dataset.shared) >= 4", timeout=60_000)
    m = _map(page)
    shared = [int(b) for b in m["sharedIds"].split()]
    assert len(shared) == int(m["shared"]) >= 4
    assert all(m["states"][b] == "3" for b in shared)  # the digits agree with the ids
    assert int(m["used"]) >= 2  # each request's own tail blocks
    rows = page.eval_on_selector_all("#requests tbody tr", "rs => rs.map(r => r.dataset.request)")
    assert len(rows) == 2
    assert page.text_content("#running") == "2"
    shot = os.environ.get("KVSERVE_DASHBOARD_SCREENSHOT") or str(tmp_path / "dashboard.png")
    page.screenshot(path=shot, full_page=True)
    assert os.path.getsize(shot) > 1000

    leave.set()
    for t in threads:
        t.join(60)
    assert outcomes == [200, 200]
    before = _frames(page)
    page.wait_for_function(f"Number(document.querySelector('#status').dataset.frames) >= {before + 2}"
                           " && Number(document.querySelector('#kvmap').dataset.used) === 0"
                           " && Number(document.querySelector('#kvmap').dataset.shared) === 0", timeout=30_000)
    m = _map(page)
    assert m["sharedIds"] == ""
    assert int(m["free"]) + int(m["cached"]) == n
    assert int(m["cached"]) >= 4  # the shared prefix stays as evictable prefix-cache blocks
    assert all(m["states"][b] in "01" for b in shared)
    assert page.eval_on_selector_all("#requests tbody tr", "rs => rs.length") == 0
    assert errors == []
    ctx.close()
