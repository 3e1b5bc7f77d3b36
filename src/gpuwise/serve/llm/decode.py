"""Request decoding: a body -> (the request, the backend and adapter it names, prompt token ids, sampling
parameters), the same for every engine (gpuwise templates and tokenizes for all of them).

It runs on a worker thread, not on the event loop, where a body of many messages would hold every other client
(docs/serving.md). Parsing holds the GIL all the same, so a chat's message count is bounded before it is parsed,
and the body's size (--max-body-mb) bounds the rest."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from gpuwise.serve.engines.base import GREEDY_BELOW, Params
from gpuwise.serve.llm import protocol as p
from gpuwise.workloads.serving import ClientError

if TYPE_CHECKING:
    from gpuwise.serve.engines.base import Backend
    from gpuwise.serve.llm.core import LLM

Target = tuple[Any, str | None]  # (the backend, the adapter) a request's model names
Decoded = tuple[Any, Target, list[int], Params]


def chat_prompt(tok, messages: list[p.ChatMessage]) -> str:
    """The model's own chat template with the assistant's turn opened; a plain "role: text" transcript
    for a model that has none (a base model, or gpuwise's scratch model)."""
    turns = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]
    if getattr(tok, "chat_template", None):
        return tok.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    return "".join(f"{t['role']}: {t['content']}\n" for t in turns) + "assistant:"


def parse(kind: type[BaseModel], body: bytes):
    """The body as `kind`, bounded: a 4xx for what is not UTF-8, not JSON, too many messages, or not valid."""
    # In JSON text a bare "role" (unescaped quotes) is a key or a whole value, never inside a string: at
    # least one per message. A count over it is a C scan (milliseconds); the parse is the bound after it.
    too_many = f"messages: at most {p.MAX_MESSAGES:,} in one request"
    if kind is p.ChatCompletionRequest and body.count(b'"role"') > p.MAX_MESSAGES:
        raise ClientError(422, too_many)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise ClientError(400, "the body is not UTF-8 text") from None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:  # a number of 5,000 digits and '[' * 100,000 included
        raise ClientError(422, f"the body is not valid JSON: {str(e)[:120] or type(e).__name__}") from None
    if isinstance(data, dict) and isinstance(data.get("messages"), list) and len(data["messages"]) > p.MAX_MESSAGES:
        raise ClientError(422, too_many)
    try:
        return kind.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False)) from None


def ids(backend: Backend, text: str, special: bool) -> list[int]:
    return backend.tok(text, add_special_tokens=special)["input_ids"]


def check_chars(llm: LLM, text: str) -> None:
    if len(text) > llm.limits.max_prompt_chars:
        raise ClientError(413, f"prompt: {len(text):,} characters; at most {llm.limits.max_prompt_chars:,}")


def params(llm: LLM, backend: Backend, max_tokens: int | None, prompt_len: int, ask) -> Params:
    """The sampling parameters of an OpenAI request, its max_tokens checked against the server's limit and the
    model's context (the serving plan's)."""
    context = backend.context
    room = context - prompt_len
    if room < 1:
        raise ClientError(400, f"the prompt holds {prompt_len} tokens; this model's context is {context} tokens")
    if max_tokens is None:
        max_tokens = min(room, llm.limits.max_tokens)
    elif max_tokens > llm.limits.max_tokens:
        raise ClientError(400, f"max_tokens: at most {llm.limits.max_tokens} on this server")
    elif prompt_len + max_tokens > context:
        raise ClientError(
            400,
            f"this model's context is {context} tokens; the prompt ({prompt_len}) plus max_tokens "
            f"({max_tokens}) asks for {prompt_len + max_tokens}",
        )
    return Params(max_tokens, ask.temperature, ask.top_p, list(ask.stops() or []), ask.seed, ask.ignore_eos)


def chat(llm: LLM, body: bytes) -> Decoded:
    ask = parse(p.ChatCompletionRequest, body)
    target = llm.model(ask.model)
    backend = target[0]
    chars = sum(len(m.text()) for m in ask.messages)
    if chars > llm.limits.max_prompt_chars:  # before the template runs over them
        raise ClientError(413, f"messages: {chars:,} characters; at most {llm.limits.max_prompt_chars:,}")
    text = chat_prompt(backend.tok, ask.messages)
    check_chars(llm, text)
    prompt = ids(backend, text, special=False)  # the template wrote the special tokens itself
    return ask, target, prompt, params(llm, backend, ask.limit(), len(prompt), ask)


def completion(llm: LLM, body: bytes) -> Decoded:
    ask = parse(p.CompletionRequest, body)
    target = llm.model(ask.model)
    assert isinstance(ask.prompt, str)  # the validator made a list of one into its string
    check_chars(llm, ask.prompt)
    prompt = ids(target[0], ask.prompt, special=True)
    return ask, target, prompt, params(llm, target[0], ask.limit(), len(prompt), ask)


def generate(llm: LLM, body: bytes) -> Decoded:
    """gpuwise's own route, from before several models: the first one serves it."""
    ask = parse(p.GenerateRequest, body)
    if ask.max_tokens > llm.limits.max_tokens:
        raise ClientError(422, f"max_tokens: at most {llm.limits.max_tokens}")
    check_chars(llm, ask.prompt)
    target = llm.model(llm.names[0])
    context = target[0].context
    prompt = ids(target[0], ask.prompt, special=True)
    if len(prompt) + ask.max_tokens > context:
        raise ClientError(
            422,
            f"prompt ({len(prompt)} tokens) + max_tokens ({ask.max_tokens}) exceeds the context of {context}",
        )
    temperature = ask.temperature if ask.temperature >= GREEDY_BELOW else 0.0
    return ask, target, prompt, Params(ask.max_tokens, temperature, ask.top_p, ask.stop)
