"""Streaming: a decoded request submitted to its engine, and the engine's events read back on the event loop,
whole or as they come, for any engine. A client that leaves cancels its sequence (its slot is freed at the
engine's next step)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from gpuwise.serve.engines.base import EngineClient, Params, QueueFull, Sequence, ShuttingDown
from gpuwise.workloads.serving import ClientError, Limits

RETRY_AFTER_S = 1  # what a 429 tells the client: the queue moves every decode step (tens of ms)


@dataclass(frozen=True)
class Stream:
    """One submitted request: its sequence, the queue its events arrive on, and the engine running it."""

    seq: Sequence
    queue: asyncio.Queue
    engine: EngineClient


def submit(target: tuple[Any, str | None], ids: list[int], params: Params, limits: Limits) -> Stream:
    """Hand the request to its backend's engine; its events come back on this event loop's queue."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[dict] = asyncio.Queue()

    def sink(event: dict) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed (server shut down): nobody listens
            loop.call_soon_threadsafe(queue.put_nowait, event)

    backend, adapter = target
    seq = Sequence(ids, params, sink, deadline=time.monotonic() + limits.timeout_s, adapter=adapter)
    try:
        backend.engine.submit(seq)
    except QueueFull as e:
        raise ClientError(
            429, f"server busy: {e}; retry in {RETRY_AFTER_S} s", {"Retry-After": str(RETRY_AFTER_S)}
        ) from None
    except ShuttingDown as e:
        raise ClientError(503, str(e)) from None
    return Stream(seq, queue, backend.engine)


async def events(stream: Stream, request: Request | None) -> AsyncIterator[dict]:
    """The engine's events for the stream; a client that leaves cancels it (its slot is freed)."""
    watcher = asyncio.create_task(_watch(request, stream)) if request is not None else None
    try:
        while True:
            event = await stream.queue.get()
            yield event
            if "finish" in event:
                return
    finally:
        stream.engine.cancel(stream.seq)
        if watcher is not None:
            watcher.cancel()


async def _watch(request: Request, stream: Stream) -> None:
    """Wait for the client to leave: one task per request blocked on the ASGI channel, rather than a poll of
    `is_disconnected()` per stream (32 streams polling every 50 ms were ~640 wake-ups a second on the event
    loop that also writes every token). The body has been read by now, so `receive()` returns only
    `http.disconnect`: when the client goes, or when the response is complete."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    stream.engine.cancel(stream.seq)
    stream.queue.put_nowait({"finish": "cancelled"})  # end the stream now; the engine frees the slot


async def whole(stream: Stream, request: Request, limits: Limits) -> tuple[str, dict]:
    """The whole answer's text and its finish event; a 4xx or 5xx for one that did not finish."""
    text, end = "", dict[str, Any]()
    async for event in events(stream, request):
        text += event.get("text", "")
        end = event if "finish" in event else end
    if not end:
        raise ClientError(499, "client closed the request")
    raise_for(end, limits)
    return text, end


def raise_for(end: dict, limits: Limits) -> None:
    if end["finish"] == "timeout":
        raise ClientError(504, f"no answer within the {limits.timeout_s:g} s request timeout")
    if end["finish"] == "error":
        raise RuntimeError(f"generation failed: {end.get('error')}")
    if end["finish"] == "cancelled":
        raise ClientError(499, "client closed the request")
