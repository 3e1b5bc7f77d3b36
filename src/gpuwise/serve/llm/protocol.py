"""The OpenAI API's wire objects, as the official client and the chat front-ends (Open WebUI, LibreChat)
send and parse them: requests, answers, stream chunks, errors. One module, typed, as vLLM's protocol.py.

Requests ignore fields they do not know (front-ends add their own: Open WebUI sends `metadata`, some
send `frequency_penalty` or `logit_bias`), and refuse a value they know but cannot honour (n > 1).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gpuwise.workloads.serving import Text

MAX_STOP = 4  # OpenAI's limit on stop strings
MAX_STOP_CHARS = 128  # per stop string: a longer one is not an end marker but a way to make the server scan
# Messages in one chat: each costs its template a few tokens, so 4096 of them outrun any context these serve;
# a bound on what is parsed and templated before the context check can say so.
MAX_MESSAGES = 4096
SEED_RANGE = (-(2**63), 2**64 - 1)  # what a torch.Generator takes: a 64-bit integer, signed or not


class Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(Lenient):
    include_usage: bool = False


class TextPart(Lenient):
    type: Literal["text"]
    text: Text


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


StopField = Annotated[
    Text | list[Annotated[Text, Field(min_length=1, max_length=MAX_STOP_CHARS)]] | None,
    Field(description=f"Up to {MAX_STOP} strings of up to {MAX_STOP_CHARS} characters; the answer ends before one"),
]


class Sampling(Lenient):
    """The fields both endpoints share. OpenAI's defaults: temperature 1, top_p 1."""

    model: str = Field(min_length=1)
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False, description="0: greedy")
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    stop: StopField = None
    seed: int | None = Field(
        None,
        ge=SEED_RANGE[0],
        le=SEED_RANGE[1],
        description="Same seed, same prompt, same answer (on one server); a 64-bit integer",
    )
    n: int = Field(1, description="Only 1: one answer per request")
    ignore_eos: bool = Field(False, description="vLLM's extension: generate max_tokens tokens, past end-of-text")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("n")
    @classmethod
    def _one(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported (send the request again for another answer)")
        return n

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        if any(len(s) > MAX_STOP_CHARS or not s for s in stops):
            raise ValueError(f"each stop string holds 1 to {MAX_STOP_CHARS} characters")
        return stops

    def stops(self) -> list[str]:
        return list(self.stop or [])

    def usage_wanted(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="The newer name of max_tokens; wins over it")

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(Sampling):
    prompt: Text | list[Text] = Field(description="One prompt (a list of one is accepted)")
    max_tokens: int | None = Field(16, ge=1, description="OpenAI's default for completions: 16")

    @field_validator("prompt")
    @classmethod
    def _single(cls, prompt):
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise ValueError("one prompt per request (send several requests: they are batched together)")
            prompt = prompt[0]
        if not prompt:
            raise ValueError("is empty")
        return prompt

    def limit(self) -> int | None:
        return self.max_tokens


# --- answers ---------------------------------------------------------------------------------------------


class GenerateRequest(BaseModel):
    """gpuwise's own route, kept for the clients written against it before the OpenAI API."""

    prompt: Text = Field(min_length=1)
    max_tokens: int = Field(64, ge=1)
    temperature: float = Field(0.8, ge=0, le=5, allow_inf_nan=False, description="0 (or under 0.001): greedy")
    top_p: float = Field(0.95, gt=0, le=1, allow_inf_nan=False)
    stop: list[Annotated[Text, Field(min_length=1, max_length=MAX_STOP_CHARS)]] = Field(
        default_factory=list,
        max_length=MAX_STOP,
        description=f"Up to 4 strings of up to {MAX_STOP_CHARS} characters",
    )
    stream: bool = Field(False, description='Server-sent events: data: {"text": ...} per piece, then data: [DONE]')


class GenerateResponse(BaseModel):
    text: str
    tokens: int
    finish_reason: str


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str = Field(default_factory=lambda: new_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: None = None


class Completion(BaseModel):
    """Both the whole answer and each stream chunk: OpenAI uses object "text_completion" for both."""

    id: str = Field(default_factory=lambda: new_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "gpuwise"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# --- errors ----------------------------------------------------------------------------------------------

# HTTP status -> OpenAI's error type, as its API answers (the client picks its exception class by status).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object. `detail` repeats the message for clients of gpuwise's other routes, which
    have read it there since the first release."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": ErrorDetail(message=message, type=kind, param=param, code=code).model_dump(), "detail": message}
