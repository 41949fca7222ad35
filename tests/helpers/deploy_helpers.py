"""Helpers shared by the deploy tests: a child's output read with deadlines, and a block of
free ports for topologies that name their ports."""

from __future__ import annotations

import queue
import socket
import subprocess
import threading
import time


class LineReader:
    """A child's merged stdout/stderr, read on a thread so waits can have deadlines."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, args=(process.stdout,), daemon=True).start()

    def _pump(self, stream) -> None:
        for line in stream:
            self.lines.put(line)

    def wait_for(self, text: str, process: subprocess.Popen, deadline: float) -> None:
        while not any(text in line for line in self.seen):
            if time.monotonic() > deadline:
                raise AssertionError(f"no {text!r} within the deadline:\n{''.join(self.seen)}")
            try:
                self.seen.append(self.lines.get(timeout=0.5))
            except queue.Empty:
                if process.poll() is not None and self.lines.empty():
                    raise AssertionError(f"the launcher exited ({process.returncode}) "
                                         f"before {text!r}:\n{''.join(self.seen)}")


def free_port_block() -> int:
    """A base with five free ports above it on 127.0.0.1 (checked, then released)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + 5 < 65536 and all(_free(base + i) for i in range(5)):
            return base


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
