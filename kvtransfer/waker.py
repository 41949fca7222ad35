"""A self-pipe that wakes an I/O thread: any thread calls wake(), the I/O thread blocks in
select/zmq.Poller on `fd` (or in wait()) and drains it. Senders and the zmq receiver use one
each, so a message posted from the engine thread is handled without waiting for a timeout."""

from __future__ import annotations

import os
import select


class Waker:
    """A self-pipe: any thread writes a byte, the I/O thread's select/zmq.Poller wakes on `fd`."""

    def __init__(self) -> None:
        self.fd, self._wfd = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._wfd, False)

    def wake(self) -> None:
        try:
            os.write(self._wfd, b"\0")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (already awake) or closed (shutting down)

    def drain(self) -> None:
        try:
            while os.read(self.fd, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def wait(self, timeout: float) -> None:
        select.select([self.fd], [], [], max(timeout, 0.0))
        self.drain()

    def close(self) -> None:
        for fd in (self.fd, self._wfd):
            try:
                os.close(fd)
            except OSError:
                pass

