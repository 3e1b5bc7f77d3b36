"""How much of the devices a run holds it really uses, sampled while it runs (issue #53).

On CUDA through NVML (nvidia-ml-py, NVIDIA's own bindings): SM utilization, memory used and power, per GPU
the process holds. On a CPU: the process's CPU share (its threads and its children's, over the cores it may
run on) and its resident memory. A background thread samples every `interval` seconds into a bounded
reservoir; `summary()` gives what a record keeps (mean, p50, the share of time idle, peak memory against what
was allocated), and `latest` what /metrics exports.

Why by hand and not DCGM: DCGM exporter reports per GPU for a whole node; a run's record needs its own
devices over its own lifetime, and a CPU run has no DCGM at all.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

USAGE_FILE = "usage.json"  # a run's figures so far, rewritten while it runs: what `gpuwise fleet` reads of it
INTERVAL_VAR, FLUSH_VAR = "GPUWISE_USAGE_INTERVAL_S", "GPUWISE_USAGE_FLUSH_S"  # a site's own cadence (and tests')
INTERVAL_S = 2.0  # a sample every 2 s: NVML's utilization is itself a busy share over its last 1/6 to 1 s
FLUSH_S = 30.0  # usage.json rewritten every 30 s
IDLE_BELOW = 0.05  # a sample under 5 % utilization counts as idle (DCGM's and Cast AI's GPU-idle rule of thumb)
MAX_SAMPLES = 4096  # a reservoir: a month-long endpoint keeps a fixed memory; thinned evenly when full


@dataclass
class Sample:
    t: float  # seconds since the sampler started
    utilization: float  # 0..1: SM busy (CUDA) or CPU share of the cores the process may use
    memory_bytes: int
    power_w: float | None = None


@dataclass
class Probe:
    """One way of reading the devices: `read()` gives the mean over them, `allocated_bytes` their memory."""

    kind: str  # "cuda (NVML)" or "cpu (process)"
    devices: list[str]
    allocated_bytes: int
    source: str
    _read: Any = field(repr=False, default=None)
    cores: int | None = None  # a CPU probe's cores: the devices a CPU run holds

    def read(self) -> tuple[float, int, float | None]:
        return self._read()


def nvml_probe(indices: list[int] | None = None) -> Probe | None:
    """The GPUs this process holds, through NVML; None where there is no NVML (no driver, no GPU)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except Exception:  # noqa: BLE001 - NVMLError_LibraryNotFound, _DriverNotLoaded...: no GPU here
        return None
    if count == 0:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if indices is None:
        if visible:
            try:
                indices = [int(v) for v in visible.split(",") if v.strip()]
            except ValueError:  # UUIDs: by handle below
                indices = list(range(count))
        else:
            indices = list(range(count))
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in indices if i < count]
    if not handles:
        return None
    total = sum(int(pynvml.nvmlDeviceGetMemoryInfo(h).total) for h in handles)
    names = [str(pynvml.nvmlDeviceGetName(h)) for h in handles]

    def read() -> tuple[float, int, float | None]:
        util = [pynvml.nvmlDeviceGetUtilizationRates(h).gpu / 100 for h in handles]
        mem = sum(int(pynvml.nvmlDeviceGetMemoryInfo(h).used) for h in handles)
        try:
            power = sum(pynvml.nvmlDeviceGetPowerUsage(h) for h in handles) / 1000
        except Exception:  # noqa: BLE001 - NVMLError_NotSupported on some boards
            power = None
        return sum(util) / len(util), mem, power

    return Probe("cuda (NVML)", names, total, "NVML: nvmlDeviceGetUtilizationRates, GetMemoryInfo, GetPowerUsage",
                 read)  # fmt: skip


def cpu_probe() -> Probe:
    """This process and its children (DataLoader workers, an engine's server), over the cores it may use."""
    import psutil

    me = psutil.Process()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    allocated = _memory_limit() or psutil.virtual_memory().total
    last: dict[int, float] = {}  # CPU seconds of each process at the previous read
    last_t = [time.monotonic()]

    def busy() -> tuple[float, int]:
        cpu, rss = 0.0, 0
        for p in [me, *me.children(recursive=True)]:
            try:
                t = p.cpu_times()
                cpu_s = t.user + t.system
                rss += p.memory_info().rss
            except psutil.Error:  # a child that just left
                continue
            # a child new since the last read spent all its CPU time within this interval
            cpu += cpu_s - last.get(p.pid, 0.0)
            last[p.pid] = cpu_s
        return cpu, rss

    busy()  # the baseline: what the process spent before sampling began is not counted

    def read() -> tuple[float, int, float | None]:
        now = time.monotonic()
        cpu, rss = busy()
        wall = max(now - last_t[0], 1e-6)
        last_t[0] = now
        return min(1.0, cpu / wall / cores), rss, None

    return Probe("cpu (process)", [f"{cores} cores"], int(allocated), "the process and its children's CPU time "
                 "(psutil) over the cores it may run on; resident memory", read, cores)  # fmt: skip


def _memory_limit() -> int | None:
    """The cgroup's memory limit (a Slurm job's or a pod's), if one is set."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:
            return int(text)
    return None


def probe_for(accelerator: str, indices: list[int] | None = None) -> tuple[Probe, str | None]:
    """The probe for a run on `accelerator`, and a one-line note when NVML is missing for a CUDA run."""
    if accelerator.startswith("cuda"):
        found = nvml_probe(indices)
        if found is not None:
            return found, None
        return cpu_probe(), "NVML is not available (nvidia-ml-py or the driver): GPU use not sampled, CPU use instead"
    return cpu_probe(), None


def _env_seconds(var: str, default: float) -> float:
    try:
        value = float(os.environ.get(var, default))
    except ValueError:
        return default
    return value if 0.05 <= value <= 3600 else default


class Sampler:
    """Samples a probe every `interval` seconds on a daemon thread until `stop()`."""

    def __init__(self, probe: Probe, interval: float | None = None, on_flush: Any = None, flush_s: float | None = None):
        self.probe, self.interval = probe, interval or _env_seconds(INTERVAL_VAR, INTERVAL_S)
        self.on_flush, self.flush_s = on_flush, flush_s or _env_seconds(FLUSH_VAR, FLUSH_S)
        self._flushed = time.monotonic()
        self.samples: list[Sample] = []
        self.every = 1  # keep one sample in `every`: doubled each time the reservoir fills
        self._n = 0
        self._t0 = time.monotonic()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.latest: Sample | None = None
        self._thread = threading.Thread(target=self._run, name="gpuwise-usage", daemon=True)

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()
            if self.on_flush is not None and time.monotonic() - self._flushed >= self.flush_s:
                self._flushed = time.monotonic()
                self._flush(self.summary())

    def sample(self) -> Sample | None:
        try:
            util, mem, power = self.probe.read()
        except Exception:  # noqa: BLE001 - a device that went away: the run goes on unsampled
            return None
        s = Sample(time.monotonic() - self._t0, util, mem, power)
        with self._lock:
            self.latest = s
            self._n += 1
            if self._n % self.every == 0:
                self.samples.append(s)
                if len(self.samples) >= MAX_SAMPLES:
                    self.samples = self.samples[::2]
                    self.every *= 2
        return s

    def stop(self) -> dict[str, Any]:
        if not self._stop.is_set():
            self._stop.set()
            if self._thread.is_alive():
                self._thread.join(timeout=5)
            self.sample()  # the last moment, so a run shorter than one interval has a sample
            if self.on_flush is not None:
                self._flush(self.summary())
        return self.summary()

    def _flush(self, summary: dict[str, Any]) -> None:
        try:
            self.on_flush(summary)
        except Exception:  # noqa: BLE001 - a full disk must not stop the run: its summary still comes at the end
            return

    def idle_seconds(self) -> float:
        with self._lock:
            samples = list(self.samples[-256:]) + ([self.latest] if self.latest and self.every > 1 else [])
        return _idle_tail(samples)

    def summary(self) -> dict[str, Any]:
        with self._lock:
            samples = list(self.samples)
        return summarize(samples, self.probe, self.interval * self.every) | {"running": not self._stop.is_set()}


def summarize(samples: list[Sample], probe: Probe, interval: float) -> dict[str, Any]:
    """What a run's record keeps of its use: see docs/fleet.md for each figure."""
    out: dict[str, Any] = {
        "kind": probe.kind,
        "devices": probe.devices,
        "source": probe.source,
        "interval_s": interval,
        "samples": len(samples),
        "allocated_memory_bytes": probe.allocated_bytes,
        "cores": probe.cores,
        "count": probe.cores if probe.cores is not None else len(probe.devices),  # devices held: GPUs, or cores
        "updated": time.time(),
        "job": engine_job(),
    }
    if not samples:
        return out | {"mean": None, "p50": None, "idle_share": None, "peak_memory_bytes": None}
    utils = sorted(s.utilization for s in samples)
    mid = len(utils) // 2
    p50 = utils[mid] if len(utils) % 2 else (utils[mid - 1] + utils[mid]) / 2
    peak = max(s.memory_bytes for s in samples)
    powers = [s.power_w for s in samples if s.power_w is not None]
    return out | {
        "mean": sum(utils) / len(utils),
        "p50": p50,
        "idle_share": sum(u < IDLE_BELOW for u in utils) / len(utils),
        "peak_memory_bytes": peak,
        "peak_memory_share": peak / probe.allocated_bytes if probe.allocated_bytes else None,
        "mean_power_w": sum(powers) / len(powers) if powers else None,
        "idle_tail_s": _idle_tail(samples),
        "seconds": samples[-1].t,  # from the sampler's start to its last sample: the devices' time held
    }


def _idle_tail(samples: list[Sample]) -> float:
    """Seconds the devices have been idle at the end: what the idle alarm reads of a run still going."""
    if not samples or samples[-1].utilization >= IDLE_BELOW:
        return 0.0
    start = samples[-1].t
    for s in reversed(samples):
        if s.utilization >= IDLE_BELOW:
            break
        start = s.t
    return samples[-1].t - start


# Ray gives a job's entrypoint no submission id: a Ray job gpuwise launched is joined by its launch record instead
ENGINE_JOB_VARS = (("slurm", "SLURM_JOB_ID"), ("skypilot", "SKYPILOT_TASK_ID"))


def engine_job() -> dict[str, str] | None:
    """The engine and id of the job this process runs in (Slurm's job id, SkyPilot's task, a pod's name):
    what `gpuwise fleet` joins a run's measured use to, whoever submitted the job and however."""
    for engine, var in ENGINE_JOB_VARS:
        if os.environ.get(var):
            return {"engine": engine, "id": os.environ[var]}
    if os.environ.get("KUBERNETES_SERVICE_HOST") and os.environ.get("HOSTNAME"):
        return {"engine": "k8s", "id": os.environ["HOSTNAME"]}
    return None


def job_label() -> str:
    found = engine_job()
    return found["id"] if found else ""


def usage_gauges(registry: Any, sampler: Sampler, run: str) -> None:
    """The sampler's latest figures as Prometheus gauges, labelled with the run and the engine's job: what
    Prometheus scrapes from /metrics and `gpuwise fleet` can join to Slurm jobs or pods. The job's label is
    `hpc_job`, as DCGM exporter names it: Prometheus keeps `job` for its own scrape job (and would rename ours)."""
    from prometheus_client import Gauge

    labels = {"run": run, "hpc_job": job_label(), "device": sampler.probe.kind}

    def gauge(name: str, doc: str, read) -> None:
        g = Gauge(name, doc, list(labels), registry=registry)
        g.labels(**labels).set_function(lambda: read(sampler.latest) if sampler.latest is not None else float("nan"))

    gauge("gpuwise_device_utilization_ratio", "Utilization of the devices this server holds, 0-1 (NVML SM busy, or "
          "the process's CPU share)", lambda s: s.utilization)  # fmt: skip
    gauge("gpuwise_device_memory_used_bytes", "Memory used on the devices this server holds (GPU, or resident)",
          lambda s: s.memory_bytes)  # fmt: skip
    gauge("gpuwise_device_power_watts", "Power drawn by the GPUs this server holds (NVML; NaN on a CPU)",
          lambda s: s.power_w if s.power_w is not None else float("nan"))  # fmt: skip
    gauge("gpuwise_device_idle_seconds", "Seconds the devices have been idle (< 5 % busy) up to now",
          lambda s: sampler.idle_seconds())  # fmt: skip
