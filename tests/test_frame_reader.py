"""The frame reader of a dialled connection (fttree/net/frame_reader.py): it takes over from
the stream the handshake read with, starting with what that stream had read already, cuts
frames of every size across reads, keeps the stream's writer working, names a broken frame and
says when the connection is gone. On asyncio's loop and on uvloop's."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
import pytest
import uvloop

from fttree.core.buffers import BufferPool
from fttree.core.messages import Kind, Message, decode_header
from fttree.errors import FrameError
from fttree.net.frame_reader import DialledReader

from .rawpeer import message_frame

LOOPS: dict[str, Callable[[Coroutine[Any, Any, None]], None]] = {
    "asyncio": asyncio.run, "uvloop": uvloop.run}


def data_frame(step: int, numel: int) -> bytes:
    payload = np.arange(numel, dtype=np.float32) + step
    return message_frame(Message(kind=Kind.DATA_REDUCE, src=1, step=step, chunk=0, chunks=1, origin=1, target=0,
                                 dtype="<f4", numel=numel, payload=payload.data.cast("B")))


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_frames_before_and_after_the_take_over_arrive_whole_and_the_writer_still_writes(loop: str) -> None:
    sizes = [0, 3, 70_000, 1, 2_000_000, 16]  # no payload, small, larger than the scratch buffer, a gradient's
    frames = [data_frame(step, n) if n else message_frame(Message(kind=Kind.META_REDUCE_SENT, src=1, step=step,
                                                                  chunk=0, chunks=1, origin=1, target=0))
              for step, n in enumerate(sizes)]
    got: list[tuple[int, int, float]] = []
    ended: list[Exception | None] = []

    async def run() -> None:
        echoed = asyncio.get_running_loop().create_future()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            # the client's stream reads past the handshake, maybe more than its buffer's limit (it
            # pauses reading then), maybe less: every split of the bytes must come out the same
            writer.write(b"HANDSHAKE" + frames[0] + frames[1][:5])
            for f in [frames[1][5:], *frames[2:]]:
                writer.write(f)
            await writer.drain()
            echoed.set_result(await reader.readexactly(5))  # what the client writes after the take-over
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await reader.readexactly(9) == b"HANDSHAKE"
        done = asyncio.get_running_loop().create_future()

        def deliver(head: bytes, payload: bytearray | memoryview | None) -> None:
            msg = decode_header(head, payload)
            data = np.frombuffer(payload, np.float32) if payload is not None else np.zeros(0, np.float32)
            assert np.array_equal(data, np.arange(data.size, dtype=np.float32) + msg.step)
            got.append((msg.step, data.size, float(data.sum())))

        def lost(exc: Exception | None) -> None:
            ended.append(exc)
            done.set_result(None)

        def frame_error(exc: FrameError) -> None:
            raise AssertionError(exc)

        frames_in = DialledReader(BufferPool(), 64 << 20, stream=writer.transport.get_protocol(), deliver=deliver,
                                  progress=lambda: None, frame_error=frame_error, lost=lost)
        buffered: bytearray = vars(reader)["_buffer"]
        leftover = bytes(buffered)
        buffered.clear()
        frames_in.take_over(writer.transport, leftover)
        writer.write(b"after")
        await writer.drain()
        assert await asyncio.wait_for(echoed, 20) == b"after"
        await asyncio.wait_for(done, 20)
        server.close()
        await server.wait_closed()

    LOOPS[loop](run())
    assert [(s, n) for s, n, _ in got] == list(enumerate(sizes))
    assert len(ended) == 1  # the server's close: the connection is gone, said once


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_a_broken_frame_is_named_and_the_connection_aborted(loop: str) -> None:
    errors: list[str] = []

    async def run() -> None:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(data_frame(0, 4) + b"XX" + bytes(30))  # a good frame, then bad magic
            await writer.drain()
            await reader.read()  # until the client aborts

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)
        done = asyncio.get_running_loop().create_future()
        delivered: list[int] = []
        frames_in = DialledReader(BufferPool(), 64 << 20, stream=writer.transport.get_protocol(),
                                  deliver=lambda head, payload: delivered.append(decode_header(head, payload).step),
                                  progress=lambda: None, frame_error=lambda exc: errors.append(str(exc)),
                                  lost=lambda exc: done.set_result(None))
        frames_in.take_over(writer.transport, b"")
        await asyncio.wait_for(done, 20)
        assert delivered == [0]
        with pytest.raises(ConnectionError):  # the writer hears of the abort too
            await writer.drain()
        server.close()
        await server.wait_closed()

    LOOPS[loop](run())
    assert len(errors) == 1
    assert "magic" in errors[0]
