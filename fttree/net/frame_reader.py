"""Reading frames off one connection: payloads straight into buffers of their exact size.

A frame is a prefix, a header and an optional payload (core/messages.py). asyncio's streams
copy every byte twice (into the stream's buffer, then out as a new bytes object) and wake a
coroutine per read; at a gradient's size that was a tenth of a step. `FrameReader` is a
buffered protocol instead: the kernel writes each payload into a buffer taken from the pool,
and prefixes and headers go through a small scratch buffer, several per read when frames are
small. An accepted connection reads with it from its first byte (tcp.py `_Inbound`, which also
runs the handshake); a connection this rank dialled switches to it once its handshake is done
(`DialledReader`), so a rank behind a NAT, whose every frame comes on connections it dialled,
reads them as cheaply as a public one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, cast

from ..core.buffers import BufferPool
from ..core.messages import PREFIX, decode_prefix
from ..errors import FrameError

PROGRESS_EVERY_S = 0.05  # how often bytes of a payload still arriving are reported as life


class FrameReader(asyncio.BufferedProtocol):
    """Splits what a connection carries into frames (`on_frame(head, payload)`). Subclasses
    say what a frame is for and what a broken one costs; this class only cuts."""

    SCRATCH_BYTES = 256 * 1024  # > prefix + the largest header, so a header always fits

    def __init__(self, pool: BufferPool, max_payload_bytes: int) -> None:
        self.pool = pool
        self.max_payload_bytes = max_payload_bytes
        self.scratch = bytearray()  # SCRATCH_BYTES once there is something to read (see begin_reading)
        self.start = self.end = 0  # unread bytes are scratch[start:end]
        self.payload: bytearray | memoryview | None = None  # the payload being read, if any
        self.payload_got = 0
        self.head = b""
        self.transport: asyncio.Transport | None = None
        self.progress_at = 0.0  # when the node was last told that bytes of a payload arrived

    def begin_reading(self) -> None:
        self.scratch = bytearray(self.SCRATCH_BYTES)

    # ---- what subclasses decide ------------------------------------------------------------------

    def on_frame(self, head: bytes, payload: bytearray | memoryview | None) -> None:
        raise NotImplementedError

    def on_progress(self) -> None:
        """Part of a payload arrived (at most every PROGRESS_EVERY_S)."""

    def on_bytes(self) -> None:
        """Bytes arrived (any)."""

    def on_frame_error(self, exc: FrameError) -> None:
        """A frame broke the protocol: the connection is aborted after this."""

    def check_prefix(self, head_len: int, payload_len: int) -> None:
        """Refuse (FrameError) a prefix this connection may not carry now."""

    def payload_begins(self, payload_len: int, have: int) -> bool:
        """A payload of `payload_len` bytes begins, `have` of them here: read it (True), or the
        connection was aborted (False)."""
        return True

    def payload_done(self) -> None:
        """The payload being read is whole."""

    # ---- the protocol ------------------------------------------------------------------------------

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.payload is not None:
            return memoryview(self.payload)[self.payload_got:]
        if self.end == len(self.scratch):  # move the unread tail to the front
            unread = self.end - self.start
            self.scratch[:unread] = self.scratch[self.start:self.end]
            self.start, self.end = 0, unread
        return memoryview(self.scratch)[self.end:]

    def buffer_updated(self, nbytes: int) -> None:
        self.on_bytes()
        try:
            if self.payload is not None:
                self.payload_got += nbytes
                if self.payload_got < len(self.payload):
                    now = time.monotonic()
                    if now - self.progress_at >= PROGRESS_EVERY_S:
                        self.progress_at = now
                        self.on_progress()
                    return
                payload, self.payload = self.payload, None
                self.payload_done()
                self.on_frame(self.head, payload)
            else:
                self.end += nbytes
            self._parse()
        except FrameError as exc:
            self.on_frame_error(exc)
            if self.transport is not None:
                self.transport.abort()

    def _parse(self) -> None:
        """Handle every whole frame in the scratch buffer; start reading a payload if one begins."""
        while self.transport is not None and self.payload is None:
            avail = self.end - self.start
            if avail < PREFIX.size:
                break
            head_len, payload_len = decode_prefix(bytes(self.scratch[self.start:self.start + PREFIX.size]),
                                                  max_payload_bytes=self.max_payload_bytes)
            self.check_prefix(head_len, payload_len)
            if avail < PREFIX.size + head_len:
                break
            head_start = self.start + PREFIX.size
            head = bytes(self.scratch[head_start:head_start + head_len])
            self.start = head_start + head_len
            if not payload_len:
                self.on_frame(head, None)
                continue
            take = min(payload_len, self.end - self.start)
            if take < payload_len and not self.payload_begins(payload_len, take):
                return
            payload = self.pool.take(payload_len)
            payload[:take] = self.scratch[self.start:self.start + take]
            self.start += take
            if take == payload_len:
                self.on_frame(head, payload)
            else:
                self.payload, self.payload_got, self.head = payload, take, head
        if self.start == self.end:
            self.start = self.end = 0


class DialledReader(FrameReader):
    """Reads a connection this rank dialled, once its handshake is done: frames from `src`
    (a peer that cannot dial us sends on it). The stream the handshake used keeps writing:
    its protocol still hears of the transport's flow control and loss, so that its drain()
    waits and fails as before. `lost(exc)` runs when the connection is gone."""

    def __init__(self, pool: BufferPool, max_payload_bytes: int, *, stream: asyncio.BaseProtocol,
                 deliver: Callable[[bytes, bytearray | memoryview | None], None], progress: Callable[[], None],
                 frame_error: Callable[[FrameError], None], lost: Callable[[Exception | None], None]) -> None:
        super().__init__(pool, max_payload_bytes)
        self.stream = stream
        self._deliver, self._progress, self._frame_error, self._lost = deliver, progress, frame_error, lost
        self.begin_reading()

    def take_over(self, transport: Any, leftover: bytes) -> None:
        """Read `transport` from now on, starting with `leftover` (what the stream had read
        beyond the handshake)."""
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it
        transport.set_protocol(self)
        if not transport.is_reading():  # the stream paused it with its buffer full: we read at once
            transport.resume_reading()
        if leftover:
            if len(leftover) > len(self.scratch):
                self.scratch = bytearray(len(leftover))
            self.scratch[:len(leftover)] = leftover
            self.buffer_updated(len(leftover))

    def on_frame(self, head: bytes, payload: bytearray | memoryview | None) -> None:
        self._deliver(head, payload)

    def on_progress(self) -> None:
        self._progress()

    def on_frame_error(self, exc: FrameError) -> None:
        self._frame_error(exc)

    # the stream's flow control and end, for its writer
    def pause_writing(self) -> None:
        self.stream.pause_writing()

    def resume_writing(self) -> None:
        self.stream.resume_writing()

    def eof_received(self) -> bool | None:
        return None  # close the transport: the peer is gone

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.stream.connection_lost(exc)
        self._lost(exc)
