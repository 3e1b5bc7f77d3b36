"""`gpuwise chat`: a terminal chat that streams replies, from a model loaded here or from a server."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer

from gpuwise.errors import GpuwiseError, first_line


def _remote(url: str, key: str | None, model: str | None):
    """(model id, reply function) for a server speaking the OpenAI API (gpuwise serve, vLLM, ...)."""
    import httpx

    base = url.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        listed = httpx.get(f"{base}/models", headers=headers, timeout=10)
    except httpx.HTTPError as e:
        raise GpuwiseError(f"{url}: cannot reach the server ({first_line(e)})") from None
    if listed.status_code != 200:
        raise GpuwiseError(f"{url}: GET /v1/models answered {listed.status_code} ({_message(listed)})")
    ids = [m["id"] for m in listed.json().get("data", [])]
    if model is None:
        if not ids:
            raise GpuwiseError(f"{url}: the server lists no model")
        model = ids[0]

    def reply(messages: list[dict], max_tokens: int, temperature: float) -> Iterator[str]:
        body = {
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "stream": True,
        }
        with httpx.stream("POST", f"{base}/chat/completions", json=body, headers=headers, timeout=None) as r:
            if r.status_code != 200:
                r.read()
                raise GpuwiseError(f"the server answered {r.status_code} ({_message(r)})")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise GpuwiseError(f"the server stopped the reply ({chunk['error'].get('message')})")
                for choice in chunk.get("choices", []):
                    yield choice.get("delta", {}).get("content") or ""

    return model, reply


def _message(r) -> str:
    try:
        return r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return r.text[:200]


def _local(target: str):
    """(model id, reply function) for a run or model loaded in this process, through the same engine."""
    import queue
    import time

    # here, not at the top: `gpuwise --help` and the other commands start without it
    from gpuwise.serve.engines.base import Params, Sequence
    from gpuwise.serve.llm.core import LLM
    from gpuwise.serve.llm.decode import chat_prompt
    from gpuwise.serve.llm.protocol import ChatMessage
    from gpuwise.serve.models import is_run, load_model, load_served
    from gpuwise.workloads.serving import Limits

    limits = Limits(max_tokens=4096, timeout_s=3600)
    path = Path(target).expanduser()
    served = load_served(path, "torch", limits)[0] if is_run(path) else load_model(target, limits)
    if not isinstance(served, LLM):
        raise GpuwiseError(f"{target}: a {served.workload} run is not a language model")

    def reply(messages: list[dict], max_tokens: int, temperature: float) -> Iterator[str]:
        ids = served.tok(chat_prompt(served.tok, [ChatMessage(**m) for m in messages]), add_special_tokens=False)
        ids = ids["input_ids"]
        context = served.backends[0].context
        room = context - len(ids)
        if room < 1:
            raise GpuwiseError(f"the conversation holds {len(ids)} tokens, the model's context {context}")
        events: queue.Queue[dict] = queue.Queue()
        seq = Sequence(ids, Params(min(max_tokens, room), temperature), events.put, time.monotonic() + 3600)
        served.engine.submit(seq)
        try:
            while "finish" not in (event := events.get()):
                yield event.get("text", "")
        finally:
            seq.cancel()  # Ctrl-C mid-reply stops the generation
        if event["finish"] == "error":
            raise GpuwiseError(f"generation failed ({event.get('error')})")

    return served.names[0], reply


def chat(
    target: Annotated[
        str,
        typer.Argument(
            metavar="MODEL_OR_URL",
            help="A trained language-model run, a named base, a .gguf file, a model directory, the URL of a server "
            "that speaks the OpenAI API (http://127.0.0.1:8000), or the record id of an endpoint `gpuwise launch` "
            "started (gpuwise runs lists them).",
        ),
    ],
    system: Annotated[str | None, typer.Option(help="A system message that opens the conversation.")] = None,
    max_tokens: Annotated[int, typer.Option(min=1, max=1_000_000, help="Longest reply, in tokens.")] = 512,
    temperature: Annotated[float, typer.Option(min=0, max=2, help="0: greedy.")] = 0.7,
    model: Annotated[str | None, typer.Option(help="With a URL: the model id [the first the server lists].")] = None,
    api_key: Annotated[str | None, typer.Option(envvar="GPUWISE_API_KEY", help="With a URL: the server's key.")] = None,
):
    """Chat with a language model in the terminal; replies stream as they are generated. An empty line or
    Ctrl-D ends the chat; Ctrl-C stops a reply.

    Example: gpuwise chat smollm2-135m-instruct"""
    remote = target.startswith(("http://", "https://"))
    if target.isdigit() and not Path(target).exists():  # a launched endpoint, by its record id
        # here, not at the top: `gpuwise --help` and the other commands start without it
        from gpuwise.launch.status import endpoint_of

        target, found_key = endpoint_of(int(target))
        api_key, remote = api_key or found_key, True
    name, reply = _remote(target, api_key, model) if remote else _local(target)
    messages: list[dict] = [{"role": "system", "content": system}] if system else []
    interactive = sys.stdin.isatty()
    print(f"chatting with {name} (empty line or Ctrl-D to quit)", file=sys.stderr)
    while True:
        try:
            line = input("you> " if interactive else "")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        sys.stdout.write("model> " if interactive else "")
        answer = ""
        try:
            for piece in reply(messages, max_tokens, temperature):
                answer += piece
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:
            sys.stdout.write(" [stopped]")
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": answer})
