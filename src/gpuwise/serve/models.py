"""What the server runs: a finished run's model, loaded once, behind one call per workload.

defects and recommender take a list of items and answer for all of them in one forward pass (the
dynamic batcher gathers that list from concurrent requests); product-lm generates one request at a
time. `--runtime onnx` swaps the torch forward of defects/recommender for onnxruntime's; everything
around it (decoding, limits, top-k) is the same code.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gpuwise.errors import GpuwiseError
from gpuwise.workloads.recommender import top_k


class ClientError(Exception):
    """A request the client got wrong: a 4xx with one clear line, never a 5xx."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


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


# A temperature below this samples as greedy: logits / temperature would overflow to inf, sampling to nan.
GREEDY_BELOW = 1e-3


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

    def __call__(self, input_ids, scores, **_) -> torch.Tensor:
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


def device_here() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _torch_forward(model: torch.nn.Module, device: str, dtype: torch.dtype) -> Callable[[np.ndarray], np.ndarray]:
    model = model.to(device).eval()

    def forward(x: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return model(torch.from_numpy(x).to(device, dtype=dtype)).float().cpu().numpy()

    return forward


def _onnx_forward(run_dir: Path) -> Callable[[np.ndarray], np.ndarray]:
    from gpuwise.serve.export import onnx_forward

    path = run_dir / "model.onnx"
    if not path.exists():
        raise GpuwiseError(f"{run_dir}: no model.onnx; run `gpuwise export {run_dir} --format onnx` first")
    return onnx_forward(path)


class Defects:
    workload = "defects"

    def __init__(self, run_dir: Path, cfg, runtime: str, limits: Limits):
        from gpuwise.workloads.defects import load_trained

        model, meta = load_trained(run_dir, cfg)
        self.size, self.classes, self.threshold = meta["image_size"], meta["classes"], meta["threshold"]
        self.limits = limits
        self.device = "cpu" if runtime == "onnx" else device_here()
        self.model_name = meta.get("base") or type(model).__name__
        self.forward = (
            _onnx_forward(run_dir) if runtime == "onnx" else _torch_forward(model, self.device, torch.float32)
        )

    def _open(self, data: bytes, name: str):
        """The image's header only (no pixels decoded): format and size checked against the limits."""
        from PIL import Image, UnidentifiedImageError

        try:
            im = Image.open(io.BytesIO(data))
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
            raise ClientError(422, f"{name}: not a readable PNG or JPEG image ({type(e).__name__})") from None
        if im.format not in ("PNG", "JPEG"):
            raise ClientError(415, f"{name}: {im.format} image; send PNG or JPEG")
        if im.width * im.height > self.limits.max_pixels:
            raise ClientError(
                413, f"{name}: {im.width}x{im.height} pixels is over the limit of {self.limits.max_pixels:,}"
            )
        return im

    def pixels(self, data: bytes, name: str) -> int:
        """Pixels the image will decode to, read from its header: cheap enough for the event loop."""
        with self._open(data, name) as im:
            return im.width * im.height

    def decode(self, data: bytes, name: str) -> np.ndarray:
        """PNG/JPEG bytes -> the grey, resized array the model was trained on. Seconds for a large image:
        the server calls it off the event loop."""
        from PIL import Image

        from gpuwise.workloads.defects import to_grey

        with self._open(data, name) as im:
            try:
                im.load()
                return to_grey(im, self.size)
            except (OSError, ValueError, Image.DecompressionBombError) as e:
                raise ClientError(422, f"{name}: not a readable PNG or JPEG image ({type(e).__name__})") from None

    def __call__(self, images: list[np.ndarray]) -> list[dict]:
        from gpuwise.workloads.defects import to_tensor

        logits = self.forward(to_tensor(np.stack(images)).numpy())
        probs = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
        return [{"probability": float(p), "label": self.classes[int(p >= self.threshold)]} for p in probs]


class Recommender:
    workload = "recommender"

    def __init__(self, run_dir: Path, cfg, runtime: str, limits: Limits):
        from gpuwise.workloads.recommender import AllScores, load_trained

        model, meta = load_trained(run_dir)
        self.items, self.titles, self.popular = meta["items"], meta["titles"], meta["popular"]
        self.user_index = {u: n for n, u in enumerate(meta["users"])}
        inter = np.load(run_dir / "train_interactions.npz")
        order = np.argsort(inter["user"], kind="stable")
        bounds = np.searchsorted(inter["user"][order], np.arange(len(meta["users"]) + 1))
        self.seen = [np.unique(inter["item"][order][a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        self.limits = limits
        self.device = "cpu" if runtime == "onnx" else device_here()
        self.model_name = f"matrix factorization, {len(self.user_index)} users x {len(self.items)} items"
        if runtime == "onnx":
            self.forward = _onnx_forward(run_dir)
        else:
            self.forward = _torch_forward(AllScores(model), self.device, torch.long)

    def item(self, i: int, score: float | None) -> dict:
        return {"item": self.items[i], "title": self.titles.get(self.items[i]), "score": score}

    def popular_items(self, k: int) -> list[dict]:
        return [self.item(i, None) for i in self.popular[:k]]

    def __call__(self, asks: list[tuple[int, int, bool]]) -> list[list[dict]]:
        """(user index, k, exclude_seen) for each ask: the top k items by score."""
        scores = self.forward(np.array([u for u, _, _ in asks], dtype=np.int64))
        out = []
        for row, (u, k, exclude) in zip(scores, asks, strict=True):
            hide = self.seen[u] if exclude else self.seen[u][:0]
            [top] = top_k(torch.from_numpy(row[None]), [hide], min(k, len(row) - len(hide)))
            out.append([self.item(i, float(row[i])) for i in top])
        return out


class ProductLM:
    workload = "product-lm"

    def __init__(self, run_dir: Path, cfg, runtime: str, limits: Limits):
        from gpuwise.workloads.product_lm import load_trained

        if runtime == "onnx":
            raise GpuwiseError("--runtime onnx serves defects and recommender; product-lm serves through torch")
        model, self.tok = load_trained(run_dir, cfg)
        self.device = device_here()
        self.model = model.to(self.device).eval()
        self.model_name = f"{cfg.base or 'small Llama (gpuwise default)'}, {cfg.method}"
        self.limits = limits
        self.lock = threading.Lock()  # one generation at a time: each already uses every core
        self.context = getattr(self.model.config, "max_position_embeddings", 2048)

    def _inputs(self, prompt: str, max_tokens: int):
        ids = self.tok(prompt, return_tensors="pt")["input_ids"].to(self.device)
        if ids.shape[1] + max_tokens > self.context:
            raise ClientError(
                422, f"prompt ({ids.shape[1]} tokens) + max_tokens ({max_tokens}) exceeds the context of {self.context}"
            )
        return ids

    def _kwargs(self, ids, max_tokens: int, temperature: float, top_p: float, stop: list[str], job: Job) -> dict:
        from transformers import StoppingCriteriaList

        kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens)
        sample = temperature >= GREEDY_BELOW
        kw |= dict(pad_token_id=self.tok.eos_token_id, do_sample=sample, stopping_criteria=StoppingCriteriaList([job]))
        if sample:
            kw |= dict(temperature=temperature, top_p=top_p)
        if stop:
            kw |= dict(stop_strings=stop, tokenizer=self.tok)
        return kw

    @staticmethod
    def cut(text: str, stop: list[str]) -> tuple[str, bool]:
        cuts = [text.index(s) for s in stop if s in text]
        return (text[: min(cuts)], True) if cuts else (text, False)

    def generate(
        self, prompt: str, max_tokens: int, temperature: float, top_p: float, stop: list[str], job: Job
    ) -> dict | None:
        """The whole answer, or None when the job was stopped before the model was free."""
        ids = self._inputs(prompt, max_tokens)
        if not job.acquire(self.lock):
            return None
        try:
            with torch.inference_mode():
                out = self.model.generate(**self._kwargs(ids, max_tokens, temperature, top_p, stop, job))
        finally:
            self.lock.release()
        new = out[0, ids.shape[1] :]
        text, stopped = self.cut(self.tok.decode(new, skip_special_tokens=True), stop)
        eos = len(new) and int(new[-1]) == self.tok.eos_token_id
        finish = "stop" if stopped or eos else "length"
        return {"text": text, "tokens": int(len(new)), "finish_reason": finish}

    def stream(
        self, prompt: str, max_tokens: int, temperature: float, top_p: float, stop: list[str], job: Job
    ) -> asyncio.Queue:
        """Text pieces as they are generated, on an asyncio queue that ends with None. Generation runs in
        its own thread and hands each piece to the event loop, so a waiting stream holds no thread. The
        prompt is checked now, so a bad one is a 4xx before the stream starts."""
        from transformers import TextStreamer

        ids = self._inputs(prompt, max_tokens)
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()

        def put(item) -> None:
            with contextlib.suppress(RuntimeError):  # the loop has closed (server shut down): nobody listens
                loop.call_soon_threadsafe(queue.put_nowait, item)

        class Pieces(TextStreamer):
            def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
                if text:
                    put(text)

        streamer = Pieces(self.tok, skip_prompt=True, skip_special_tokens=True)
        kwargs = self._kwargs(ids, max_tokens, temperature, top_p, stop, job) | {"streamer": streamer}

        def run():
            try:
                if job.acquire(self.lock):
                    try:
                        with torch.inference_mode():
                            self.model.generate(**kwargs)
                    finally:
                        self.lock.release()
            except Exception as e:  # noqa: BLE001 - reported on the stream; the server goes on
                job.error = e
            finally:
                put(None)

        threading.Thread(target=run, daemon=True, name="gpuwise-generate").start()
        return queue


SERVED = {"defects": Defects, "recommender": Recommender, "product-lm": ProductLM}


def load_served(run_dir: Path, runtime: str, limits: Limits):
    from gpuwise.train.records import loading_model, open_finished

    cfg = open_finished(run_dir)
    with loading_model(run_dir):
        return SERVED[cfg.workload](run_dir, cfg, runtime, limits), cfg
