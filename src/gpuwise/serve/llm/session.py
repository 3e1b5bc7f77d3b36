"""What one `gpuwise serve` of language models met: each finished request's lengths and latencies, summed up when
the server stops into the record `gpuwise runs` lists, beside what the plan expected at that traffic
(plan/endpoint.py: session_plan)."""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from gpuwise.plan.simulate import percentile
from gpuwise.plan.traffic import Targets
from gpuwise.serve.engines.base import Sequence

# The requests a session keeps: a day at 1 request/s; older ones drop out of the summary (its count says so).
KEEP = 100_000


@dataclass(frozen=True)
class Served:
    t_submit: float
    t_done: float
    prompt: int
    output: int
    ttft: float
    tpot: float | None  # None: fewer than two tokens out


class Session:
    """The finished requests of one server (thread-safe: every engine's thread reports here)."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.requests: deque[Served] = deque(maxlen=KEEP)
        self.total = 0
        self._lock = threading.Lock()

    def finished(self, seq: Sequence) -> None:
        """A request that generated: its figures (one that failed, or ended before its first token, is not
        served and is left out)."""
        if seq.finish not in ("stop", "length") or seq.t_first is None:
            return
        served = Served(
            seq.t_submit, seq.t_last or seq.t_first, len(seq.prompt), len(seq.out), seq.t_first - seq.t_submit, seq.tpot
        )
        with self._lock:
            self.requests.append(served)
            self.total += 1

    def summary(self, targets: Targets) -> dict[str, Any] | None:
        """The session's traffic and latencies, and its goodput: the requests that met both targets per second of
        the time requests were in flight (first arrival to last answer). None before any request."""
        with self._lock:
            done = list(self.requests)
            total = self.total
        if not done:
            return None
        span = max(r.t_done for r in done) - min(r.t_submit for r in done)
        ttft = [r.ttft for r in done]
        tpot = [r.tpot for r in done if r.tpot is not None]
        met = sum(r.ttft <= targets.ttft and (r.tpot is None or r.tpot <= targets.tpot) for r in done)
        q = targets.percentile
        rate = len(done) / span if span > 0 else 0.0
        return {
            "requests": total,
            "kept": len(done),
            "seconds_up": time.perf_counter() - self.started,
            "seconds_busy": span,
            "rate_rps": rate,
            "prompt_tokens": statistics.fmean(r.prompt for r in done),
            "output_tokens": statistics.fmean(r.output for r in done),
            "ttft_p50": percentile(ttft, 50),
            f"ttft_p{q:g}": percentile(ttft, q),
            "tpot_p50": percentile(tpot, 50) if tpot else None,
            f"tpot_p{q:g}": percentile(tpot, q) if tpot else None,
            "attainment": met / len(done),
            "goodput_rps": met / span if span > 0 else 0.0,
        }


def record_session(
    session: Session,
    name: str,
    engine: str,
    device: str,
    replica: Any,
    startup: dict[str, Any] | None,
    usage: dict[str, Any] | None = None,
) -> None:
    """The session's record (kind "serve"), once the server has stopped: what it met and, where the endpoint was
    planned, what the plan expected at the same traffic, and its devices' use. A server that served nothing is
    recorded too where its use was sampled: an endpoint held idle is what `gpuwise fleet` looks for."""
    # here, not at the top: only a server that stops records
    from gpuwise.plan.endpoint import session_plan
    from gpuwise.plan.traffic import DEFAULT_TARGETS
    from gpuwise.runs import db

    actual = session.summary(DEFAULT_TARGETS)
    if actual is None and not (usage and usage.get("samples")):
        return
    planned = None
    if replica is not None and actual is not None and actual["rate_rps"] > 0:
        planned = session_plan(replica, actual["prompt_tokens"], actual["output_tokens"], actual["rate_rps"])
    data = {
        "kind": "serve",
        "model": name,
        "engine": engine,
        "device": device,
        "targets": DEFAULT_TARGETS.as_dict(),
        "actual": actual,
        "planned": planned,
        "startup": startup,
        "utilization": usage,
    }
    db.try_record("serve", device, name, data)
