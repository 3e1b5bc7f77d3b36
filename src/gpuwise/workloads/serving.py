"""What a served workload is given and what it gives back: the server's limits, its client errors, a
request's off switch, the context its routes are added with, and the `Served` protocol itself.

The server (`gpuwise.serve.app`) owns what is the same for every workload (the API key, body limits,
/health, /v1/info, /metrics, the dynamic batcher); a workload's `Served` adds only its own routes.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Protocol

import numpy as np
from pydantic import AfterValidator

from gpuwise.errors import GpuwiseError, first_line

if TYPE_CHECKING:
    import torch
    from fastapi import FastAPI, Request


class ClientError(Exception):
    """A request the client got wrong: a 4xx with one clear line, never a 5xx."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


@dataclass
class Limits:
    max_body_bytes: int = 16 << 20
    max_pixels: int = 4096 * 4096  # per image, checked from the header before decoding
    # per request: four images at the per-image limit (an RGBA one decodes to 64 MiB)
    max_request_pixels: int = 4 * 4096 * 4096
    max_images: int = 64  # per request
    max_k: int = 100
    max_tokens: int = 512
    max_prompt_chars: int = 8000
    timeout_s: float = 30.0
    read_timeout_s: float = 30.0  # a client's time to send its headers, and again its body
    max_connections: int = 256  # open at once; a 503 beyond
    max_seqs: int = 32  # language models: sequences in the running batch at most
    max_queue: int = 256  # language models: requests waiting for a slot at most; a 429 beyond
    prefix_cache_tokens: int = 4096  # language models: prompt tokens whose keys and values are kept for reuse
    max_model_len: int = 0  # language models: the longest prompt + answer, in tokens; 0: the model's context

    def context(self, model_context: int) -> int:
        """The context a served model gets: its own, or --max-model-len where that is shorter."""
        return min(model_context, self.max_model_len) if self.max_model_len else model_context


def _utf8(text: str) -> str:
    """JSON can carry lone surrogates (\\udc80) that no UTF-8 answer can echo back: a 422, not a 500."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("is not valid Unicode text (a lone surrogate)") from None
    return text


Text = Annotated[str, AfterValidator(_utf8)]  # every free-text field of a request


class Job:
    """One generation's off switch: thrown when its client leaves, when its time is up, or when a stop
    string has been sent. The model checks it at every token (a transformers stopping criterion) and
    before it starts, so abandoned work stops at the next token and never holds the model after."""

    def __init__(self, timeout_s: float):
        self.deadline = time.monotonic() + timeout_s
        self._off = threading.Event()
        self.expired = False
        self.error: BaseException | None = None

    def cancel(self) -> None:
        self._off.set()

    def stopped(self) -> bool:
        if not self.expired and time.monotonic() > self.deadline:
            self.expired = True
        return self.expired or self._off.is_set()

    def __call__(self, input_ids: torch.Tensor, scores: Any, **_: Any) -> torch.Tensor:
        import torch

        return torch.full((input_ids.shape[0],), self.stopped(), dtype=torch.bool, device=input_ids.device)

    def acquire(self, lock: threading.Lock) -> bool:
        """Wait for the model, giving up as soon as the job is stopped."""
        while not lock.acquire(timeout=0.05):
            if self.stopped():
                return False
        if self.stopped():
            lock.release()
            return False
        return True


async def until_done(request: Request, work: asyncio.Future, job: Job, timeout_s: float) -> Any:
    """The result of `work`, watching meanwhile for the client leaving (every 50 ms) and the deadline;
    either stops the job, so the model drops it at its next token."""
    try:
        while True:
            done, _ = await asyncio.wait({work}, timeout=0.05)
            if done:
                return work.result()
            if job.stopped():
                raise ClientError(504, f"no answer within the {timeout_s:g} s request timeout")
            if await request.is_disconnected():
                raise ClientError(499, "client closed the request")
    finally:
        job.cancel()


@dataclass
class ServeContext:
    """What the server hands a workload's routes."""

    app: FastAPI
    limits: Limits
    answer: Callable[[list], Awaitable[list]]  # items -> results through the dynamic batcher, with the timeout
    decoder: Executor  # for decoding requests off the event loop (images take seconds)
    internal_errors: Any  # a prometheus Counter: failures the server logged and answered with a 500
    log: logging.Logger
    registry: Any = None  # the server's prometheus CollectorRegistry, for a workload's own series


class Served(Protocol):
    """A finished run loaded for serving. `batched`: the server runs a dynamic batcher that calls the
    object with the items of concurrent requests (one forward pass for all); otherwise it is never
    called and its routes run the model themselves (generation, one request at a time)."""

    workload: str
    model_name: str
    device: str
    batched: bool

    # Positional-only: the batcher passes the items positionally, and each workload names them its own way.
    def __call__(self, items: list, /) -> list: ...

    def routes(self, ctx: ServeContext) -> None: ...


@dataclass
class CausalLM:
    """What a language-model workload hands the server instead of a `Served`: the model and tokenizer,
    served through the continuous-batching engine behind the OpenAI API (`gpuwise.serve.llm.core`)."""

    model: Any
    tok: Any
    name: str  # the model id clients send in "model"
    description: str = ""


def device_here() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def torch_forward(model: torch.nn.Module, device: str, dtype: torch.dtype) -> Callable[[np.ndarray], np.ndarray]:
    import torch

    model = model.to(device).eval()

    def forward(x: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return model(torch.from_numpy(x).to(device, dtype=dtype)).float().cpu().numpy()

    return forward


_DTYPES = {"tensor(float)": np.float32, "tensor(int64)": np.int64}


def onnx_forward(path: Path) -> Callable[[np.ndarray], np.ndarray]:
    """The model's one input (float32 images or int64 ids) -> its one output, through onnxruntime."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 4  # its errors come back as exceptions; logging them too would print twice
    try:
        session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - onnxruntime raises its own pybind error types
        run = path.parent
        raise GpuwiseError(
            f"{path}: not a readable ONNX model ({first_line(e)}) — run `gpuwise export {run} --format onnx`"
        ) from None
    (inp,), (out,) = session.get_inputs(), session.get_outputs()
    dtype = _DTYPES.get(inp.type, np.float32)

    def forward(x: np.ndarray) -> np.ndarray:
        return session.run([out.name], {inp.name: np.ascontiguousarray(x, dtype=dtype)})[0]

    return forward


def run_forward(run_dir: Path, runtime: str, model: torch.nn.Module, dtype: torch.dtype):
    """(forward, device): the torch model on the best device here, or RUN/model.onnx on onnxruntime."""
    if runtime == "onnx":
        path = run_dir / "model.onnx"
        if not path.exists():
            raise GpuwiseError(f"{run_dir}: no model.onnx; run `gpuwise export {run_dir} --format onnx` first")
        return onnx_forward(path), "cpu"
    device = device_here()
    return torch_forward(model, device, dtype), device
