"""A userspace TCP proxy that injects link faults, for the chaos suite (reliability/chaos.py) and its
tests. This host's kernel has no netem, so delay, loss and stalls are made here, in the path:

    client --tcp--> FaultProxy(listen) --tcp--> upstream        (one pair of pumps per connection)

    faults (LinkFaults, changed at run time from any thread; each read applies the current set):
      delay_s        every chunk is delivered this long after it arrived (order kept)
      loss           a chunk is "lost" with this probability: TCP retransmits it, so it arrives
                     `rto_s` late and so does everything behind it (what loss does to a stream)
      rate_bps       bandwidth cap per direction (bytes/s; 0 = none)
      stalled        bytes are held, not forwarded, until stalled is cleared (a receiver that
                     stops reading; the sender's kernel buffers fill)
      down           the link is cut: open connections are reset, new ones are reset at once

    one-shot faults on the next message (zmtp=True: the stream is split into ZMTP messages, so
    a fault hits exactly one whole kvtransfer message; else on the next read chunk):
      corrupt(kind)    flip one byte in the middle of the next message whose first frame is `kind`
      replay(kind, s)  deliver a copy of the next such message again `s` seconds later
                       (0 = a duplicate right behind it; more = a late frame after the transfer)
      stall_after(n)   forward n more bytes client->upstream, then stall

ZMTP 3 framing (libzmq 4, NULL mechanism: plain text): a 64-byte greeting each way, then frames
of [flags][size: 1 byte, or 8 if flags & 2][body]; flags & 1 = more frames follow in this
message, flags & 4 = a command (READY, PING), always one frame. The splitter only finds message
boundaries; it never changes bytes it does not mean to.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

CHUNK = 64 * 1024
# The proxy reads at most this far ahead of what it has written: the rest waits in the sender's
# socket buffers, as on a real slow or stalled path (and dies with the sender if it is killed).
PENDING_MAX = 1 << 20
ZMTP_GREETING = 64


@dataclass
class LinkFaults:
    """The faults in force; the pumps read these fields on every chunk (plain attributes: a
    torn read of one float between threads is harmless)."""

    delay_s: float = 0.0
    loss: float = 0.0
    rto_s: float = 0.2  # Linux's minimum retransmission timeout
    rate_bps: float = 0.0
    stalled: bool = False
    down: bool = False


@dataclass
class DirectionStats:
    bytes_in: int = 0
    bytes_out: int = 0
    arrived: Counter = field(default_factory=Counter)  # ZMTP first-frame kind -> count read
    messages: Counter = field(default_factory=Counter)  # ZMTP first-frame kind -> count forwarded


@dataclass
class _Backlog:
    n: int = 0  # bytes one connection's pump has read and its writer not yet written


class ZmtpSplitter:
    """Feeds bytes, yields whole units: the greeting, then each complete ZMTP message."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.greeting_left = ZMTP_GREETING

    def feed(self, data: bytes) -> list[bytes]:
        self.buf += data
        out = []
        if self.greeting_left:  # passed on as it comes: each side sends 10 bytes, then waits
            part = bytes(self.buf[:self.greeting_left])
            del self.buf[:len(part)]
            self.greeting_left -= len(part)
            out.append(part)
            if self.greeting_left:
                return out
        while (end := self._message_end()) is not None:
            out.append(bytes(self.buf[:end]))
            del self.buf[:end]
        return out

    def _message_end(self) -> int | None:
        pos = 0
        while True:
            if len(self.buf) < pos + 2:
                return None
            flags = self.buf[pos]
            if flags & 2:
                if len(self.buf) < pos + 9:
                    return None
                size = struct.unpack_from(">Q", self.buf, pos + 1)[0]
                pos += 9 + size
            else:
                pos += 2 + self.buf[pos + 1]
            if len(self.buf) < pos:
                return None
            if flags & 4 or not flags & 1:  # a command, or the last frame of a message
                return pos


def message_kind(unit: bytes) -> bytes:
    """The first frame's first byte of a ZMTP message (kvtransfer's kind), b"" otherwise."""
    if len(unit) < 3 or unit[0] & 4:
        return b""
    return unit[9:10] if unit[0] & 2 else unit[2:3]


class FaultProxy:
    """Listens on (host, port), forwards to (upstream_host, upstream_port). start() runs it on
    its own thread and event loop; every control method may be called from any thread."""

    def __init__(self, upstream_host: str, upstream_port: int, host: str = "127.0.0.1",
                 port: int = 0, zmtp: bool = False, seed: int = 0) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.host, self.port = host, port
        self.zmtp = zmtp
        self.faults = LinkFaults()
        self.c2s, self.s2c = DirectionStats(), DirectionStats()
        self.connections = 0
        self.injected: Counter = Counter()  # fault kind -> times it hit
        self._rng = random.Random(seed)
        self._one_shot: list[tuple[str, bytes, float]] = []  # (what, kind, seconds), c2s
        self._allowance: int | None = None  # bytes c2s left before stalling
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # -- control (any thread) ------------------------------------------------------------

    def start(self) -> FaultProxy:
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True,
                                        name=f"fault-proxy-{self.port}")
        self._thread.start()
        if not ready.wait(10) or self._server is None:
            raise RuntimeError(f"fault proxy on {self.host}:{self.port} did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)

    def set(self, **faults) -> None:
        for name, value in faults.items():
            if not hasattr(self.faults, name):
                raise ValueError(f"no link fault named {name!r}")
            setattr(self.faults, name, value)
        if faults.get("down"):
            self.injected["cut"] += 1
            self._loop.call_soon_threadsafe(self._reset_all)
        if not faults.get("stalled", True):
            self._allowance = None

    def clear(self) -> None:
        self.set(delay_s=0.0, loss=0.0, rate_bps=0.0, stalled=False, down=False)
        with self._lock:
            self._one_shot.clear()

    def corrupt(self, kind: bytes = b"D") -> None:
        with self._lock:
            self._one_shot.append(("corrupt", kind, 0.0))

    def replay(self, kind: bytes = b"D", after_s: float = 0.0) -> None:
        with self._lock:
            self._one_shot.append(("replay", kind, after_s))

    def stall_after(self, n_bytes: int) -> None:
        self._allowance = n_bytes

    def pending_one_shots(self) -> int:
        with self._lock:
            return len(self._one_shot)

    # -- the loop ----------------------------------------------------------------------------

    def _run(self, ready: threading.Event) -> None:
        loop = self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            self._server = loop.run_until_complete(
                asyncio.start_server(self._accept, self.host, self.port, reuse_address=True))
            self.port = self._server.sockets[0].getsockname()[1]
        except OSError:
            log.exception("fault proxy cannot listen on %s:%d", self.host, self.port)
            loop.close()
            return
        finally:
            ready.set()
        loop.run_forever()
        self._reset_all()
        self._server.close()
        tasks = asyncio.all_tasks(loop)
        for task in tasks:
            task.cancel()
        if tasks:
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        loop.close()

    def _reset_all(self) -> None:
        for writer in list(self._writers):
            _reset(writer)
        self._writers.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.faults.down:
            _reset(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            _reset(writer)
            return
        self.connections += 1
        self._writers |= {writer, up_writer}
        pumps = [asyncio.create_task(self._pump(reader, up_writer, self.c2s, True)),
                 asyncio.create_task(self._pump(up_reader, writer, self.s2c, False))]
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for task in pumps:
            task.cancel()
        for w in (writer, up_writer):
            self._writers.discard(w)
            w.close()

    async def _pump(self, reader, writer, stats: DirectionStats, c2s: bool) -> None:
        """Reads chunks, stamps each with its delivery time; a second task writes them in order,
        so a delay shifts the stream in time without stopping the reads."""
        queue: asyncio.Queue = asyncio.Queue()
        backlog = _Backlog()  # this connection's own: a dead one must not hold up the next
        deliver = asyncio.create_task(self._deliver(queue, writer, stats, c2s, backlog))
        splitter = ZmtpSplitter() if self.zmtp else None
        late_until = 0.0
        try:
            while data := await reader.read(CHUNK):
                stats.bytes_in += len(data)
                now = time.monotonic()
                f = self.faults
                due = max(now + f.delay_s, late_until)
                if f.loss and self._rng.random() < f.loss:
                    self.injected["loss"] += 1
                    due = late_until = due + f.rto_s
                for unit in (splitter.feed(data) if splitter else [data]):
                    if splitter:
                        stats.arrived[message_kind(unit)] += 1
                    for item in self._one_shots(unit, c2s, due):
                        backlog.n += len(item[1])
                        queue.put_nowait(item)
                while backlog.n > PENDING_MAX and not deliver.done():
                    await asyncio.sleep(0.005)
        finally:
            queue.put_nowait(None)
            await deliver

    def _one_shots(self, unit: bytes, c2s: bool, due: float) -> list[tuple[float, bytes, bool]]:
        """(delivery time, bytes, is a replayed copy) for one unit, one-shot faults applied."""
        out = [(due, unit, False)]
        if not c2s or not self._one_shot:
            return out
        kind = message_kind(unit) if self.zmtp else b""
        with self._lock:
            for i, (what, want, after_s) in enumerate(self._one_shot):
                if self.zmtp and kind != want:
                    continue
                del self._one_shot[i]
                self.injected[what] += 1
                if what == "corrupt":
                    data = bytearray(unit)
                    data[len(data) // 2] ^= 0xFF
                    out[0] = (due, bytes(data), False)
                else:
                    out.append((due + after_s, unit, True))
                break
        return out

    async def _deliver(self, queue: asyncio.Queue, writer, stats: DirectionStats, c2s: bool,
                       backlog: _Backlog) -> None:
        late: list[asyncio.Task] = []
        lock = asyncio.Lock()  # a late copy goes out between whole units, never inside one
        try:
            while (item := await queue.get()) is not None:
                at, unit, replayed = item
                if replayed:  # on its own task: the stream behind a late copy is not held up
                    late.append(asyncio.create_task(self._write_late(writer, unit, at, stats, lock, backlog)))
                    continue
                await asyncio.sleep(max(0.0, at - time.monotonic()))
                async with lock:
                    await self._write(writer, unit, stats, c2s, backlog)
            if late:  # the connection stays open until the late copies have gone out
                await asyncio.wait(late)
        except (ConnectionError, OSError):
            pass
        finally:
            for task in late:
                task.cancel()

    async def _write_late(self, writer, unit: bytes, at: float, stats: DirectionStats,
                          lock: asyncio.Lock, backlog: _Backlog) -> None:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        async with lock:
            if writer.is_closing():
                return
            writer.write(unit)
            stats.bytes_out += len(unit)
            backlog.n -= len(unit)
            stats.messages[b"replay-" + message_kind(unit)] += 1

    async def _write(self, writer, unit: bytes, stats: DirectionStats, c2s: bool,
                     backlog: _Backlog) -> None:
        pos = 0
        while pos < len(unit):
            f = self.faults
            if f.stalled:
                if writer.is_closing():
                    raise ConnectionError("closed while stalled")
                await asyncio.sleep(0.01)
                continue
            piece = unit[pos:pos + CHUNK]
            if c2s and self._allowance is not None:
                if self._allowance <= 0:
                    self.faults.stalled, self._allowance = True, None
                    self.injected["stall"] += 1
                    continue
                piece = piece[:self._allowance]
                self._allowance -= len(piece)
            if f.rate_bps:
                await asyncio.sleep(len(piece) / f.rate_bps)
            writer.write(piece)
            await writer.drain()
            stats.bytes_out += len(piece)
            backlog.n -= len(piece)
            pos += len(piece)
        if self.zmtp:
            stats.messages[message_kind(unit)] += 1


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with RST (SO_LINGER 0), as a cut link or a crashed peer looks to the other end."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.close()
