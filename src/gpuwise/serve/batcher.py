"""Dynamic batching: items of concurrent requests gathered into one forward pass.

Written here rather than taken from a serving framework (Triton, Ray Serve, TorchServe) because
the whole of it is a queue and one loop, and those bring a process model of their own.

The loop takes the first waiting item, then waits at most `max_wait_ms` for more, up to `max_batch`
items (under light load, when the last pass had one item and nothing else waits, it does not wait),
and runs the model on them in one worker thread (the model is never called twice at once,
and torch releases the GIL, so the event loop keeps accepting requests meanwhile). While one batch
runs, the next one fills. `max_batch=1` is batch-1 serving: the baseline the benchmark compares to.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ServeMetrics:
    """Prometheus series of one server (its own registry: two servers in one process do not mix)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "gpuwise_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=self.registry
        )
        self.latency = Histogram(
            "gpuwise_request_latency_seconds",
            "Time from request to response",
            ["endpoint"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=self.registry,
        )
        self.batch_size = Histogram(
            "gpuwise_batch_size",
            "Items per forward pass",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=self.registry,
        )
        self.internal_errors = Counter(
            "gpuwise_internal_errors", "Server faults (a 500, or a stream ended by an error)", registry=self.registry
        )
        self.queue_depth = Gauge("gpuwise_queue_depth", "Items waiting for a forward pass", registry=self.registry)


class DynamicBatcher:
    def __init__(self, fn: Callable[[list], list], max_batch: int, max_wait_ms: float, metrics: ServeMetrics):
        self.fn, self.max_batch, self.max_wait = fn, max_batch, max_wait_ms / 1000
        self.metrics = metrics
        self.queue: asyncio.Queue | None = None
        self.task: asyncio.Task | None = None
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpuwise-model")
        self.last_size = 0

    async def start(self) -> None:
        self.queue = asyncio.Queue()
        self.metrics.queue_depth.set_function(self.queue.qsize)
        self.task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self.task:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        self.executor.shutdown(wait=True)

    async def submit(self, items: list) -> list:
        """The model's answers for `items`, in order; they may share a pass with other requests'."""
        assert self.queue is not None, "start() first"
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in items]
        for item, future in zip(items, futures, strict=True):
            self.queue.put_nowait((item, future))
        return await asyncio.gather(*futures)

    async def _gather(self) -> list:
        assert self.queue is not None  # only _loop calls this, and start() creates the queue before it
        batch = [await self.queue.get()]
        loop = asyncio.get_running_loop()
        # Light load (the last pass had one item, nothing else waits): waiting would only add latency.
        deadline = loop.time() + (self.max_wait if self.last_size > 1 or not self.queue.empty() else 0)
        while len(batch) < self.max_batch:
            if not self.queue.empty():
                batch.append(self.queue.get_nowait())
                continue
            left = deadline - loop.time()
            if left <= 0:
                break
            try:
                batch.append(await asyncio.wait_for(self.queue.get(), left))
            except TimeoutError:
                break
        return [(item, future) for item, future in batch if not future.done()]  # a timed-out request is gone

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._gather()
            if not batch:
                continue
            self.metrics.batch_size.observe(len(batch))
            self.last_size = len(batch)
            try:
                results = await loop.run_in_executor(self.executor, self.fn, [item for item, _ in batch])
            except Exception as e:  # noqa: BLE001 - the requests in this batch get the error, the server goes on
                for _, future in batch:
                    if not future.done():
                        future.set_exception(e)
                continue
            for (_, future), result in zip(batch, results, strict=True):
                if not future.done():
                    future.set_result(result)
