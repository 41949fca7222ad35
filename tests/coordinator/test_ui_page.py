"""The page at /ui and its data endpoint /ui/data, on a real cluster (coordinator, prefill and
decode workers as processes, a tiny random model) with an API key: the page is open and loads
nothing from elsewhere, the data needs the key and shows workers, KV use, transfers and recent
latencies and nothing internal; the page's own script, run in jsdom under Node.js, fills its
worker table and charts from the cluster and streams a chat; and the same in a real Chromium
(Debian's headless shell driven by Playwright, whose own browser download is not reachable
from these machines), which also enforces the page's Content-Security-Policy."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from reliability.model_factory import make_tiny_hf_model
from tests.conftest import tandem_home
from tests.helpers.api_cluster import MODEL, WORKER_ARGS
from tests.helpers.cluster import running_cluster

API_KEY = "ui-test-key-0123456789"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
JSDOM_VERSION = "26.1.0"  # npm `jsdom`, pinned
DRIVER = Path(__file__).with_name("ui_page_driver.mjs")
SVG_NAMESPACE = "http://www.w3.org/2000/svg"
PROMPT = "Name a colour, any colour at all."
CHAT = "Hello there, who are you?"  # what the page's chat box is given


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    root = tmp_path_factory.mktemp("ui")
    model_dir = make_tiny_hf_model(root / "model", "llama")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TANDEM_API_KEY", API_KEY)  # the coordinator inherits it
        # prefill_threshold 0: every prompt is prefilled on the prefill worker, so its KV moves
        with running_cluster(model_dir, root / "logs", model=MODEL, worker_args=WORKER_ARGS,
                             prefill_threshold=0) as cluster:
            yield cluster.url


def _csp_hash(html: str, kind: str) -> str:
    (block,) = re.findall(rf"<{kind}>(.*?)</{kind}>", html, re.DOTALL)
    return "'sha256-" + base64.b64encode(hashlib.sha256(block.encode()).digest()).decode() + "'"


def test_the_page_is_open_and_loads_nothing_from_elsewhere(url):
    page = httpx.get(f"{url}/ui", timeout=30)  # no key: a browser cannot send one on navigation
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    html = page.text
    assert "<title>tandem</title>" in html and 'id="workers"' in html
    # No asset from anywhere: no URL with a scheme or a network path in any attribute or
    # stylesheet; the only http:// in the page is the SVG namespace, a name never fetched.
    assert not re.search(r"""\b(?:src|href|action|srcset|poster|data)\s*=\s*["']?\s*(?:[a-z]+:)?//""",
                         html, re.IGNORECASE)
    assert "https://" not in html and "@import" not in html and "url(" not in html
    assert html.replace(SVG_NAMESPACE, "").count("http://") == 0
    assert not re.search(r"<(?:link|iframe|img|object|embed)\b", html, re.IGNORECASE)
    # The browser is told the same: only the page's own script and style, by their hashes.
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    assert f"script-src {_csp_hash(html, 'script')}" in csp
    assert f"style-src {_csp_hash(html, 'style')}" in csp
    # Clients still read / as Ollama's liveness answer.
    root = httpx.get(f"{url}/", timeout=30)
    assert root.status_code == 200 and root.text == "Ollama is running"


def test_the_data_needs_the_key(url):
    assert httpx.get(f"{url}/ui/data", timeout=30).status_code == 401
    wrong = httpx.get(f"{url}/ui/data", headers={"Authorization": "Bearer nope"}, timeout=30)
    assert wrong.status_code == 401 and "invalid API key" in wrong.text


def _data(url: str) -> dict:
    answer = httpx.get(f"{url}/ui/data", headers=AUTH, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_the_data_shows_workers_kv_and_latencies_after_a_request(url):
    chat = httpx.post(f"{url}/api/chat", headers=AUTH, timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "stream": False,
        "options": {"temperature": 0, "num_predict": 8}})
    assert chat.status_code == 200, chat.text
    # The transfer reaches the coordinator with the workers' next heartbeats.
    deadline = time.monotonic() + 30
    while True:
        data = _data(url)
        roles = {w["role"]: w for w in data["workers"]}
        # Each worker's counters arrive with its own heartbeat: wait for both sides.
        sent = roles.get("prefill", {}).get("kv") or {}
        received = roles.get("decode", {}).get("kv") or {}
        if (sent.get("transfers_done", 0) >= 1 and received.get("bytes_received", 0) > 0) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert set(roles) == {"prefill", "decode"}
    prefill, decode = roles["prefill"], roles["decode"]
    for w in (prefill, decode):
        assert w["alive"] and w["model"] == MODEL
        assert w["kv_blocks"] > 0 and 0 <= w["kv_blocks_used"] <= w["kv_blocks"]
        assert w["kv_usage"] == w["kv_blocks_used"] / w["kv_blocks"]
        assert w["kv_backend"] == "zmq"
    assert prefill["kv"]["transfers_done"] >= 1 and prefill["kv"]["bytes_sent"] > 0
    assert decode["kv"]["bytes_received"] > 0 and prefill["kv"]["transfer_seconds"] > 0
    assert decode["cached_blocks"] >= 0
    (model,) = data["models"]
    assert model["name"] == MODEL and model["live"]["prefill"] == 1 and model["live"]["decode"] == 1
    assert 0 <= model["kv_usage"] <= 1
    assert data["queue"]["waiting"] == 0 and data["queue"]["max_streams"] > 0
    overall = data["latency"]["overall"]
    assert overall["requests"] >= 1 and overall["output_tokens"] >= chat.json()["eval_count"]
    assert 0 < overall["ttft"]["p50"] <= overall["ttft"]["p90"] <= overall["ttft"]["p99"]
    assert overall["itl_count"] >= 1 and overall["itl"]["p50"] >= 0
    assert overall["tpot"] is not None and overall["tpot_count"] >= 1
    series = data["latency"]["series"]
    assert len(series) == data["latency"]["window_s"] / data["latency"]["bucket_s"]
    assert sum(b["requests"] for b in series) == overall["requests"]
    assert any(b["ttft"] is not None for b in series)
    # Nothing internal: no address, endpoint, fingerprint or death reason; no prompt, no key.
    text = json.dumps(data)
    for internal in ("address", "kv_endpoint", "fingerprint", "dead_reason", "127.0.0.1"):
        assert internal not in text
    assert PROMPT not in text and API_KEY not in text


def _api_answer(url: str, prompt: str) -> str:
    """The API's own greedy answer to what the page sends (max tokens 16, temperature 0)."""
    answer = httpx.post(f"{url}/api/chat", headers=AUTH, timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": prompt}], "stream": False,
        "options": {"temperature": 0, "num_predict": 16}})
    assert answer.status_code == 200, answer.text
    return answer.json()["message"]["content"]


def _jsdom() -> str:
    """npm's `jsdom` at JSDOM_VERSION, installed once into $TANDEM_HOME/npm (outside the repo,
    kept between runs); its node_modules folder."""
    prefix = tandem_home() / "npm" / f"jsdom-{JSDOM_VERSION}"
    modules = prefix / "node_modules"
    if not (modules / "jsdom" / "package.json").exists():
        prefix.mkdir(parents=True, exist_ok=True)
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", str(prefix),
                        f"jsdom@{JSDOM_VERSION}"], check=True, timeout=300, capture_output=True)
    return str(modules)


@pytest.mark.skipif(shutil.which("node") is None or shutil.which("npm") is None,
                    reason="Node.js (node and npm) is not installed on this machine, so the "
                           "page's script cannot run; CI machines have it")
def test_the_page_fills_from_the_cluster_and_streams_a_chat(url):
    run = subprocess.run(["node", str(DRIVER), url, API_KEY, _jsdom(), CHAT],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr + run.stdout
    out = json.loads(run.stdout.strip().splitlines()[-1])
    print(json.dumps(out, indent=1))  # shown when an assertion fails
    assert out["pageErrors"] == [], out["pageErrors"]
    # Refused first, with the server's reason, and nothing shown.
    assert "needs an API key" in out["refused"] and "missing API key" in out["refused"]
    assert out["rowsBeforeKey"] == 0 and out["storedKey"] is True
    # The worker table: both workers, their roles, model, KV pool and transfers.
    rows = {r["role"]: r for r in out["rows"]}
    assert set(rows) == {"prefill", "decode"}
    for r in rows.values():
        assert r["model"] == MODEL and r["state"] == "live"
        used, total = map(int, re.search(r"(\d+) / (\d+) \(", r["kv"]).groups())
        assert total > 0 and r["meter"] == pytest.approx(used / total)
        assert r["kv-rate"].endswith("B/s")  # a rate from the last two polls (0 when idle)
    assert re.fullmatch(r"[1-9]\d* / 0", rows["prefill"]["transfers"])
    assert rows["prefill"]["kv-link"].endswith("B/s")
    # The chat: typed, streamed in more than one piece, finished with its figures.
    chat = out["chat"]
    assert chat["done"] == "true" and chat["chunks"] > 1
    assert chat["text"] == _api_answer(url, CHAT)  # the stream, put together, is the answer
    assert chat["model"] == MODEL and chat["messages"] == 2 and "TTFT" in chat["stats"]
    assert out["models"] == [MODEL]
    # The charts: the request's TTFT and tokens drawn, with the window's percentiles.
    charts = out["charts"]
    assert charts["ttft"]["points"] >= 1 and charts["ttft"]["paths"] == 3
    assert "p50" in charts["ttft"]["legend"] and "p99" in charts["ttft"]["legend"]
    assert charts["itl"]["points"] >= 1 and charts["tpot"]["points"] >= 1
    assert charts["tokens"]["points"] >= 1 and charts["tokens"]["rects"] >= 1
    assert int(out["cards"]["requests"]) >= 1 and out["status"] == "ok"


def _chromium() -> str | None:
    """A Chromium for Playwright to drive: Debian's headless shell (.ci/run installs it;
    Playwright's own browser download is not reachable from these machines) or Chromium."""
    return shutil.which("chromium-headless-shell") or shutil.which("chromium")


@pytest.mark.skipif(_chromium() is None,
                    reason="no Chromium on this machine (apt-get install chromium-headless-shell; "
                           ".ci/run installs it)")
def test_the_page_works_in_a_real_browser_under_its_csp(url):
    """Chromium enforces the page's Content-Security-Policy, which jsdom ignores: the page's
    script runs at all only if its hash is right, and any asset from elsewhere would be refused
    (and logged). Driven by selectors only: Playwright's function waits evaluate strings, which
    the policy rightly refuses."""
    sync_api = pytest.importorskip("playwright.sync_api")
    logged: list[str] = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium())
        try:
            page = browser.new_page()
            page.on("console", lambda m: logged.append(f"{m.type}: {m.text}")
                    if m.type in ("error", "warning") else None)
            page.on("pageerror", lambda e: logged.append(f"pageerror: {e}"))
            page.on("request", lambda r: None if r.url.startswith(url)
                    else logged.append(f"request elsewhere: {r.url}"))
            page.goto(f"{url}/ui")
            page.wait_for_selector('#status[data-kind="auth"]', timeout=30_000)
            page.fill("#api-key", API_KEY)
            page.click("#save-key")
            page.wait_for_selector("#workers tbody tr:nth-child(2)", timeout=30_000)
            roles = sorted(page.locator('#workers td[data-col="role"]').all_text_contents())
            page.fill("#chat-max", "16")
            page.fill("#chat-temp", "0")
            page.fill("#chat-input", CHAT)
            page.press("#chat-input", "Enter")  # Enter sends
            answer = page.wait_for_selector('.msg.assistant:not([data-done="false"])',
                                            timeout=120_000)
            done, chunks = answer.get_attribute("data-done"), answer.get_attribute("data-chunks")
            text = answer.text_content()
            page.wait_for_selector('#chart-ttft svg[data-points]:not([data-points="0"])',
                                   timeout=30_000)
            legend = page.text_content("#chart-ttft .legend")
            status = page.get_attribute("#status", "data-kind")
        finally:
            browser.close()
    # No CSP refusal, no script error, nothing fetched from elsewhere; Chromium logs the first
    # poll's 401 (before the key was given) as a failed load, which is what it was.
    refused_poll = "Failed to load resource: the server responded with a status of 401"
    assert [line for line in logged if refused_poll not in line] == []
    assert any(refused_poll in line for line in logged)
    assert roles == ["decode", "prefill"]
    assert done == "true" and int(chunks) > 1 and text == _api_answer(url, CHAT)
    assert "p50" in legend and status == "ok"


@pytest.mark.skipif(_chromium() is None,
                    reason="no Chromium on this machine (apt-get install chromium-headless-shell; "
                           ".ci/run installs it)")
def test_the_api_docs_render_in_a_real_browser_from_the_server_alone(url):
    """/docs: Swagger UI, its script and style from the coordinator (no CDN), renders every
    route of /openapi.json. The browser sends the key on each request, as a user behind an
    authenticating proxy would (the docs sit behind the API key)."""
    sync_api = pytest.importorskip("playwright.sync_api")
    logged: list[str] = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium())
        try:
            page = browser.new_context(extra_http_headers=AUTH).new_page()
            page.on("console", lambda m: logged.append(f"{m.type}: {m.text}")
                    if m.type == "error" else None)
            page.on("pageerror", lambda e: logged.append(f"pageerror: {e}"))
            page.on("request", lambda r: None if r.url.startswith(url)
                    else logged.append(f"request elsewhere: {r.url}"))
            page.goto(f"{url}/docs")
            page.wait_for_selector(".opblock", timeout=60_000)
            paths = set(page.locator(".opblock-summary-path").all_text_contents())
            title = page.text_content(".info .title")
        finally:
            browser.close()
    assert logged == []
    schema = httpx.get(f"{url}/openapi.json", headers=AUTH, timeout=30).json()
    assert {"/api/chat", "/v1/chat/completions", "/health"} <= {p.replace("\u200b", "")
                                                               for p in paths}
    assert len(paths) == len(schema["paths"]) and "tandem" in title
