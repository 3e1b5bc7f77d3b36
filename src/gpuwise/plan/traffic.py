"""What a serving plan is asked: the traffic at the busy hour and the latency targets, checked once here.

The traffic is a request rate (or users x requests per user an hour) and the mean prompt and output lengths,
given or taken from a named profile with its source. The targets are DistServe's (Zhong et al., OSDI 2024):
time to first token and time per output token, met by a share of the requests (the percentile)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpuwise.errors import GpuwiseError, closest


@dataclass(frozen=True)
class Profile:
    prompt_tokens: int
    output_tokens: int
    source: str


# Request lengths of public traces and datasets: the whole context a server prefills, not one user turn
# (docs/plan.md lists them with the excerpts). Medians except rag, which its source gives only as a cluster.
PROFILES: dict[str, Profile] = {
    "chat": Profile(1020, 129, "Azure LLM inference trace 2023, conversation, medians (Splitwise, arXiv 2311.18677)"),
    "code": Profile(1500, 13, "Azure LLM inference trace 2023, coding, medians (Splitwise, arXiv 2311.18677)"),
    "summarize": Profile(7059, 208, "arxiv_summarization, medians (Sarathi-Serve, arXiv 2403.02310, Table 2)"),
    "rag": Profile(
        3500,
        500,
        "RAGPulse university Q&A trace: inputs 'cluster around 3500', outputs 'around 500' (arXiv 2511.12979)",
    ),
}


@dataclass(frozen=True)
class Traffic:
    rps: float  # requests per second at the busy hour
    prompt_tokens: int
    output_tokens: int
    source: str  # how the rate and the lengths were given

    def as_dict(self) -> dict:
        return {
            "rps": self.rps,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "source": self.source,
        }


@dataclass(frozen=True)
class Targets:
    ttft: float  # seconds to the first token
    tpot: float  # seconds per output token after the first
    percentile: float  # the share of requests (in %) that must meet both

    @property
    def share(self) -> float:
        return self.percentile / 100

    def as_dict(self) -> dict:
        return {"ttft": self.ttft, "tpot": self.tpot, "percentile": self.percentile}


# The targets a plan is stated at when none are given (`gpuwise plan --task serve`, the ui, `gpuwise serve`'s
# start-up line): a reply that starts within 2 s and streams faster than people read (5 tokens/s), for 95 %.
DEFAULT_TARGETS = Targets(ttft=2.0, tpot=0.2, percentile=95)
DEFAULT_HOURS_PER_DAY = 24.0


# The ranges of the serving flags: far beyond any real deployment, yet they refuse a slip of the keyboard.
MAX_RPS = 1e6  # a million requests a second: beyond the largest public chat services' peaks
MAX_USERS = 1e10  # more than people on Earth
MAX_TOKENS = 10_000_000  # the longest published context window (request.py's MAX_CONTEXT)


def _positive(flag: str, value: float | None, high: float, why: str) -> None:
    if value is None:
        return
    if not math.isfinite(value) or not 0 < value <= high:
        raise GpuwiseError(f"{flag} must be above 0 and at most {high:g} ({why}), not {value:g}")


def traffic(
    rps: float | None = None,
    users: float | None = None,
    requests_per_user_hour: float | None = None,
    prompt_tokens: int | None = None,
    output_tokens: int | None = None,
    profile: str | None = None,
) -> Traffic:
    """The traffic from the flags, each refused in one line when it cannot mean anything."""
    _positive("--rps", rps, MAX_RPS, "requests per second at the busy hour")
    _positive("--users", users, MAX_USERS, "people using the endpoint")
    _positive("--requests-per-user-hour", requests_per_user_hour, 3600, "requests one person sends an hour")
    _positive("--prompt-tokens", prompt_tokens, MAX_TOKENS, "mean tokens of a prompt")
    _positive("--output-tokens", output_tokens, MAX_TOKENS, "mean tokens of an answer")
    if rps is not None and (users is not None or requests_per_user_hour is not None):
        raise GpuwiseError("give either --rps, or --users with --requests-per-user-hour, not both")
    if rps is None:
        if users is None or requests_per_user_hour is None:
            raise GpuwiseError(
                "a serving plan needs the traffic: --rps R, or --users N with --requests-per-user-hour K"
            )
        rps = users * requests_per_user_hour / 3600
        rate = f"{users:g} users x {requests_per_user_hour:g} requests an hour"
    else:
        rate = f"--rps {rps:g}"
    if profile is not None:
        if profile not in PROFILES:
            raise GpuwiseError(
                f"unknown profile '{profile}'{closest(profile, PROFILES)} (one of: {', '.join(PROFILES)})"
            )
        p = PROFILES[profile]
        lengths = f"profile {profile}: {p.source}"
        prompt_tokens = prompt_tokens or p.prompt_tokens
        output_tokens = output_tokens or p.output_tokens
    elif prompt_tokens is None or output_tokens is None:
        raise GpuwiseError(
            "a serving plan needs the request lengths: --prompt-tokens and --output-tokens, or --profile "
            f"({', '.join(PROFILES) or 'none'})"
        )
    else:
        lengths = "--prompt-tokens, --output-tokens"
    return Traffic(rps, int(prompt_tokens), int(output_tokens), f"{rate}; {lengths}")


def targets(ttft: float, tpot: float, percentile: float) -> Targets:
    _positive("--ttft", ttft, 3600, "seconds to the first token")
    _positive("--tpot", tpot, 60, "seconds per output token")
    if not math.isfinite(percentile) or not 1 <= percentile < 100:
        raise GpuwiseError(f"--percentile must be at least 1 and below 100 (the share of requests), not {percentile:g}")
    return Targets(ttft, tpot, percentile)


def check_hours(hours_per_day: float) -> float:
    if not math.isfinite(hours_per_day) or not 0 < hours_per_day <= 24:
        raise GpuwiseError(f"--hours-per-day must be above 0 and at most 24, not {hours_per_day:g}")
    return hours_per_day
