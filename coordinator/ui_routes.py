"""The built-in page at /ui (coordinator/ui/index.html) and the one JSON endpoint it polls,
/ui/data: the cluster as the registry and the metrics see it now.

The page is one file with its style and script inline: no build step, nothing fetched from
elsewhere. It is served without the API key (it holds no data; a browser cannot send a key
on navigation, and the page asks for one), under a Content-Security-Policy that admits only
its own script and style (by hash) and connections to this server, so neither an injected tag
nor a stray asset URL could load or run anything. /ui/data and the /api/chat the page streams
from need the key like every other API route (coordinator/access.py).

/ui/data shows what an API user may see: worker ids, roles, model names, load, KV pool use
and transfer counters, the admission queue, and recent latency percentiles. Never a worker's
address, KV endpoint, fingerprint, a death reason (which can name addresses), a prompt or a
key.
"""

from __future__ import annotations

import base64
import hashlib
import re
import time
from functools import lru_cache
from importlib import resources

from fastapi.responses import HTMLResponse, JSONResponse

from coordinator.registry import WorkerRecord
from coordinator.service import Coordinator

PAGE_PATH = "/ui"
DATA_PATH = "/ui/data"


def _hash_source(kind: str, html: str) -> str:
    """The CSP source of the page's one inline <script> or <style> block."""
    blocks = re.findall(rf"<{kind}>(.*?)</{kind}>", html, re.DOTALL)
    if len(blocks) != 1 or html.count(f"<{kind}") != 1:
        raise RuntimeError(f"coordinator/ui/index.html must hold exactly one <{kind}> block "
                           f"without attributes, found {len(blocks)}")
    digest = hashlib.sha256(blocks[0].encode()).digest()
    return f"'sha256-{base64.b64encode(digest).decode()}'"


@lru_cache(maxsize=1)
def page() -> tuple[str, str]:
    """(the page's HTML, its Content-Security-Policy), read once from the package data."""
    html = resources.files("coordinator").joinpath("ui/index.html").read_text(encoding="utf-8")
    csp = "; ".join((
        "default-src 'none'", f"script-src {_hash_source('script', html)}",
        f"style-src {_hash_source('style', html)}", "connect-src 'self'", "img-src data:",
        "base-uri 'none'", "form-action 'none'", "frame-ancestors 'none'"))
    return html, csp


def _worker_view(w: WorkerRecord, model_names: dict[str, str]) -> dict:
    load, kv = w.load, w.kv
    used = load.num_blocks - load.num_free_blocks
    return {
        "id": w.worker_id, "role": w.role, "model": model_names.get(w.model_fingerprint, "?"),
        "alive": w.alive, "resident": w.resident,
        "running": load.num_running, "waiting": load.num_waiting,
        "queued_prefill_tokens": load.queued_prefill_tokens,
        "assigned_requests": w.assigned_requests,
        # 0 blocks: not reported yet (a worker's first status comes with its registration)
        "kv_blocks": load.num_blocks, "kv_blocks_used": used,
        "kv_usage": used / load.num_blocks if load.num_blocks else None,
        "cached_blocks": len(load.cached_hashes), "kv_backend": w.kv_backend,
        # Monotonic since the worker started: the page derives the current rate from two
        # polls; bytes over transfer seconds is the rate while transfers ran.
        "kv": None if kv is None else {
            "bytes_sent": kv.bytes_sent, "bytes_received": kv.bytes_received,
            "transfers_done": kv.transfers_done, "transfers_failed": kv.transfers_failed,
            "transfer_seconds": kv.transfer_seconds, "skipped_blocks": kv.skipped_blocks},
    }


def cluster_view(c: Coordinator) -> dict:
    """What /ui/data answers (JSON-ready). `time` is the wall clock, for the page's rates."""
    model_names = {m.fingerprint: m.name for m in c.models}
    workers = c.registry.all()
    models = []
    for m in c.models:
        admission = c.pool(m).admission
        pools = [w.load for w in workers if w.alive and w.model_fingerprint == m.fingerprint
                 and w.load.num_blocks > 0]
        blocks = sum(p.num_blocks for p in pools)
        models.append({
            "name": m.name, "waiting": admission.queue_depth, "running": admission.running,
            "max_queue": admission.max_queue, "live": c.registry.live_counts(m.fingerprint),
            "kv_usage": (sum(p.num_blocks - p.num_free_blocks for p in pools) / blocks
                         if blocks else None)})
    return {
        "time": time.time(), "default_model": c.model.name,
        "queue": {"waiting": sum(m["waiting"] for m in models),
                  "running": sum(m["running"] for m in models),
                  "open_requests": c.open_requests, "max_streams": c.config.max_streams},
        "models": models,
        "workers": sorted((_worker_view(w, model_names) for w in workers),
                          key=lambda w: (not w["alive"], w["model"], w["role"], w["id"])),
        "latency": c.metrics.recent.report(),
    }


class UiRoutes:
    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator

    async def page(self) -> HTMLResponse:
        html, csp = page()
        return HTMLResponse(html, headers={
            "Content-Security-Policy": csp, "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"})

    async def data(self) -> JSONResponse:
        return JSONResponse(cluster_view(self.coordinator),
                            headers={"Cache-Control": "no-store"})
