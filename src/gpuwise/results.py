"""The results every part of gpuwise reads and writes, declared once: a plan, a bench, a training run's summary.

Field names are the JSON keys that `--json`, summary.json, bench.json and the run record have always held, in
the same order, so that `dump()` gives the same JSON as before the models existed. Parts whose keys differ per
workload (its metrics, its data description) stay open mappings. Fields a record written by an older gpuwise
may lack are optional; `dump()` leaves out every key that was not given, so an old record round-trips as it
was and a key a producer leaves out (a CPU bench has no host_device) stays out.

`gpuwise schema plan|traced|train|bench` prints these models as JSON Schema (docs/schema/ holds a copy).
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, ValidationError, WrapValidator


def _keep_int(value: Any, handler: Any) -> Any:
    # JSON tells 2 from 2.0, and a round trip must not turn one into the other: an int given for a
    # float stays an int (a pre-training plan's token count is an int, a fine-tune's a float).
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return handler(value)


def _as_is(value: Any) -> Any:
    return value


# A float in the schema ("number"), kept as given: int or float, and inf or nan left for files.to_json to write
# as null (the planner's finiteness test looks at the unconverted values).
Number = Annotated[float, WrapValidator(_keep_int), PlainSerializer(_as_is, return_type=Any)]

R = TypeVar("R", bound="Result")


class Result(BaseModel):
    """The base of every result model: ignores keys it does not know (a newer gpuwise's), dumps what was given."""

    # Built on first use, not at import: every command imports these, few use more than one.
    model_config = ConfigDict(defer_build=True)

    def dump(self) -> dict[str, Any]:
        """The JSON object as gpuwise writes it: only the keys that were set, by their JSON names. Python mode,
        not "json": inf and nan reach files.to_json, which writes them as null, and the tests that look for them."""
        return self.model_dump(by_alias=True, exclude_unset=True)

    @classmethod
    def load(cls: type[R], data: R | dict[str, Any]) -> R:
        """The typed result from a parsed JSON object (a file, the record), or itself: keys it does not
        declare are ignored, so that a record a newer gpuwise wrote still loads."""
        return data if isinstance(data, cls) else cls.model_validate(data)

    @classmethod
    def build(cls: type[R], data: dict[str, Any]) -> R:
        """For the code that produces the result: like `load`, but a key no model declares is an error, since
        it would vanish from the JSON unseen. A new key is declared here first."""
        result = cls.model_validate(data)
        _refuse_undeclared(result, data, cls.__name__)
        return result


def _refuse_undeclared(model: Result, data: Any, where: str) -> None:
    if not isinstance(data, dict) or model.model_config.get("extra") == "allow":
        return
    fields = {(f.alias or name): name for name, f in type(model).model_fields.items()}
    unknown = [k for k in data if k not in fields]
    if unknown:
        raise ValueError(f"{where}: '{unknown[0]}' is not a declared field of {type(model).__name__}")
    for key, name in fields.items():
        value, given = getattr(model, name), data.get(key)
        if isinstance(value, Result):
            _refuse_undeclared(value, given, f"{where}.{key}")
        elif isinstance(value, list) and isinstance(given, list):
            for n, (item, raw) in enumerate(zip(value, given, strict=False)):
                if isinstance(item, Result):
                    _refuse_undeclared(item, raw, f"{where}.{key}[{n}]")
        elif isinstance(value, dict) and isinstance(given, dict):
            for k, item in value.items():
                if isinstance(item, Result):
                    _refuse_undeclared(item, given.get(k), f"{where}.{key}.{k}")


def problem(e: ValidationError) -> str:
    """A validation error as a few words: the first field at fault and what is wrong with it."""
    first = e.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "the object"
    if first["type"] == "missing":
        return f"no '{where}'"
    return f"'{where}': {first['msg'].lower()}"


# --- gpuwise plan -----------------------------------------------------------------------------------------


class ModelInfo(Result):
    """The model planned for."""

    name: str = Field(description="preset name, config.json's model name, or 'custom'")
    family: str | None = Field(None, description="architecture family (llama, gpt2, bert, ...)")
    params: int | None = Field(None, description="parameters counted from the dimensions")
    published_params: Number | None = Field(None, description="parameter count the model's authors publish")


class Layout(Result):
    """How the GPUs split the model: data x tensor x pipeline parallel."""

    dp: int = Field(description="data-parallel replicas")
    tp: int = Field(description="tensor-parallel degree")
    pp: int = Field(description="pipeline stages")
    zero: int = Field(description="ZeRO stage over data parallel (3 = FSDP; 0 = none)")
    text: str = Field(description="the layout in words")


class MemoryBreakdown(Result):
    """Memory per GPU, in bytes."""

    weights: int = Field(description="model weights, bytes per GPU")
    gradients: int = Field(description="gradients, bytes per GPU (0 for inference)")
    optimizer: int = Field(description="optimizer states and fp32 master weights, bytes per GPU")
    activations: int = Field(description="activations kept for backward (inference: working set), bytes per GPU")
    kv_cache: int = Field(description="KV cache for the whole batch and context, bytes per GPU")
    overhead: int = Field(description="CUDA context, workspaces and allocator slack, bytes per GPU")
    total: int = Field(description="the sum: peak bytes per GPU")


class ComputeEstimate(Result):
    """FLOPs and time of the whole job on this layout."""

    tokens: Number = Field(description="tokens trained on, or generated (processed, for an encoder)")
    tokens_origin: str = Field(description="where the token count comes from")
    flops: Number = Field(description="model FLOPs of the whole job (no recompute)")
    hardware_flops: Number = Field(description="FLOPs the GPUs execute, recompute included")
    peak_tflops: Number = Field(description="dense peak of one GPU at the plan's precision, TFLOP/s")
    efficiency: Number = Field(description="fraction of the dense peak assumed achieved")
    efficiency_origin: str = Field(description="where the efficiency comes from")
    gpu_hours: Number = Field(description="GPU-hours of the job")
    wall_hours: Number = Field(description="wall-clock hours of the job")
    tokens_per_s: Number = Field(description="tokens per second, all GPUs together")
    prefill_flops: Number | None = Field(None, description="inference: FLOPs of the job's prompt processing")
    decode_flops: Number | None = Field(None, description="inference: FLOPs of the job's generated tokens")
    prefill_s: Number | None = Field(None, description="inference: seconds to the first token of a batch")
    decode_step_s: Number | None = Field(None, description="inference: seconds per generated token of a batch")
    decode_bound: str | None = Field(None, description="inference: what bounds a decode step, memory or compute")


class CloudCost(Result):
    """The job at one cloud provider's price."""

    provider: str = Field(description="cloud provider")
    usd: Number = Field(description="cost of the job, USD")
    usd_per_gpu_hour: Number = Field(description="price, USD per GPU-hour")
    kind: str | None = Field(None, description="price kind (on-demand, spot, ...)")
    as_of: str = Field(description="date of the price, or 'undated'")
    source: str = Field(description="where the price comes from")


class OnPremCost(Result):
    """The job on owned hardware: purchase amortized over its life, plus power."""

    provider: str = Field(description="always 'on-prem'")
    usd: Number = Field(description="cost of the job, USD")
    usd_per_gpu_hour: Number = Field(description="amortized purchase + power, USD per busy GPU-hour")
    purchase_usd_per_gpu: Number = Field(description="purchase price per GPU, USD: purchase_usd / purchase_gpus")
    purchase_usd: Number | None = Field(None, description="the price as quoted, USD, for `item`")
    purchase_gpus: int | None = Field(None, description="GPUs in `item` (8 for a server of 8, 1 for a card)")
    item: str = Field(description="what the purchase price is for (a server, a card), and what kind of price")
    as_of: str = Field(description="date of the purchase price, or 'undated'")
    source: str = Field(description="where the purchase price comes from")
    power_kw_per_gpu: Number = Field(description="power at the wall per GPU (TDP x host x PUE), kW")
    breakeven_utilization: Number | None = Field(
        None, description="share of its life an owned GPU must be busy to match the cheapest rental (null: never)"
    )
    power_known: bool = Field(description="whether the catalog has the GPU's TDP")


class Assumption(Result):
    """One figure a plan rests on, and where it comes from."""

    name: str = Field(description="the assumption (efficiency, overhead_bytes, ...)")
    value: Number = Field(description="its value, in the unit its name says")
    origin: str = Field(description="the flag that gave it, or its published source")


class PlanFields(Result):
    """A model x task on N of one accelerator: what `plan` reports for the recommended option and every other."""

    model: ModelInfo = Field(description="the model planned for")
    task: str = Field(description="inference, finetune, lora, qlora or pretrain")
    gpu: str = Field(description="catalog slug of the accelerator")
    gpu_name: str = Field(description="the accelerator's name")
    gpus: int = Field(description="GPU count")
    layout: Layout = Field(description="how the GPUs split the model")
    precision: str = Field(description="weights/compute precision (fp32, bf16, fp16, fp8)")
    batch: int = Field(description="sequences per step (per micro-batch when training)")
    seq: int = Field(description="tokens per sequence")
    memory: MemoryBreakdown = Field(description="memory per GPU, bytes")
    capacity: int = Field(description="memory of one GPU, bytes")
    fits: bool = Field(description="whether the memory per GPU fits the capacity")
    why: str = Field(description="why it fits or does not, in words")
    max_batch: int = Field(description="the largest batch that fits (0: not even batch 1)")
    kv_cache_per_token: int | None = Field(None, description="KV cache per token of context, bytes")
    trainable_params: int | None = Field(None, description="parameters trained (0 for inference)")
    compute: ComputeEstimate | None = Field(None, description="FLOPs and time; null without a peak at the precision")
    cost: list[CloudCost] = Field(default_factory=list, description="the job at each cloud price, cheapest first")
    onprem: OnPremCost | None = Field(None, description="the job on owned hardware; null without a purchase price")
    warnings: list[str] = Field(default_factory=list, description="classic mistakes spotted, one line each")


class PlanOption(PlanFields):
    """One accelerator of the sweep, at the fewest GPUs that fit."""

    cheapest: bool = Field(False, description="the recommended option: the cheapest that fits")
    fastest: bool = Field(False, description="the fastest option that fits (no tensor parallel over PCIe)")
    demoted: str | None = Field(
        None,
        description="why a fitting option is listed below cheaper-looking ones: tensor parallel over PCIe (its time "
        "too optimistic to compare) or no price; null where it is in price order",
    )


class ServingPlan(Result):
    """`--task inference`: how `gpuwise serve` would serve the model on the recommended accelerator."""

    engine: str = Field(description="the engine `gpuwise serve --engine auto` picks there: vllm, llama.cpp or gpuwise")
    why: str = Field(description="the rule behind the choice (docs/serving.md)")
    vllm: list[str] | None = Field(None, description="vLLM's OpenAI-server arguments set from this plan")
    llama_cpp: list[str] | None = Field(None, description="llama.cpp's llama-server arguments, where it is picked")
    command: str | None = Field(None, description="the shell line that starts the server of that engine")
    summary: str | None = Field(None, description="that engine's knobs, as `gpuwise serve` prints them")


class PlanResult(PlanFields):
    """`gpuwise plan --json`: the recommended option's fields at the top, every option under `options`."""

    recommended: bool | None = Field(None, description="whether the top option fits (false: nothing fits)")
    assumptions: list[Assumption] = Field(default_factory=list, description="every assumption the plan used")
    options: list[PlanOption] = Field(default_factory=list, description="every accelerator planned, best first")
    serving: ServingPlan | None = Field(None, description="--task inference: the engine and vLLM's command line")
    record_id: int | None = Field(None, description="id in the run record (`gpuwise runs`); null if not recorded")


class TracedMemory(Result):
    """What was live at the traced step's peak, by part (torch MemTracker), in bytes per GPU."""

    weights: int = Field(description="parameters and buffers, bytes per GPU")
    gradients: int = Field(description="gradients, bytes per GPU")
    optimizer: int = Field(description="optimizer states, bytes per GPU")
    activations: int = Field(description="activations, temporaries, inputs and FSDP's collective buffers, bytes")
    overhead: int = Field(description="CUDA context and allocator slack (assumptions, printed), bytes per GPU")
    total: int = Field(description="peak bytes per GPU: the tensors traced plus the overhead")


class TracedCompute(Result):
    """One traced training step against the device's roofline."""

    flops_per_step: Number = Field(description="FLOPs of one step (torch's FlopCounter formulas)")
    bytes_per_step: Number = Field(description="bytes read and written by the step's ops")
    roofline_s: Number = Field(description="sum over ops of max(FLOPs / peak, bytes / bandwidth), seconds")
    efficiency: Number = Field(description="share of the roofline reached (default, bench or --efficiency)")
    efficiency_origin: str = Field(description="where the efficiency comes from")
    step_time_s: Number = Field(description="roofline / efficiency, seconds per step")


class TracedPlan(Result):
    """`gpuwise plan --traced --json`: one training step of a real model traced on fake tensors."""

    traced: bool = Field(description="always true: tells a traced plan from an analytic one in the record")
    model: ModelInfo = Field(description="the model traced: a preset, a workload or a --module factory")
    gpu: str = Field(description="catalog slug of the accelerator planned for")
    gpus: int = Field(description="processes the model is FSDP-sharded over (1: not sharded)")
    precision: str = Field(description="fp32, bf16 (autocast) or fp16 (autocast)")
    memory: TracedMemory = Field(description="the peak, by part, bytes per GPU")
    capacity: int = Field(description="the accelerator's memory, bytes")
    fits: bool = Field(description="whether the peak fits the capacity")
    compute: TracedCompute = Field(description="FLOPs, bytes and time of one step")
    method: str = Field(description="how the figures were made, in words")
    record_id: int | None = Field(None, description="id in the run record (`gpuwise runs`); null if not recorded")


# --- gpuwise bench ----------------------------------------------------------------------------------------


class DevicePeak(Result):
    """A device's physical peaks: bench reports each of its figures as a fraction of them."""

    name: str = Field(description="the device's name")
    slug: str | None = Field(None, description="catalog slug (GPUs in the catalog)")
    fp32_tflops: Number | None = Field(None, description="dense FP32 peak, TFLOP/s")
    tf32_tflops: Number | None = Field(None, description="dense TF32 peak, TFLOP/s")
    bf16_tflops: Number | None = Field(None, description="dense BF16 peak, TFLOP/s")
    fp16_tflops: Number | None = Field(None, description="dense FP16 peak, TFLOP/s")
    bandwidth_gbs: Number | None = Field(None, description="memory bandwidth peak, GB/s")
    origin: str = Field(description="where the peaks come from")
    interconnect: str | None = Field(None, description="host link, as the catalog names it (GPUs)")
    bandwidth_origin: str | None = Field(None, description="why the bandwidth peak is unknown (CPUs)")


class MatmulResult(Result):
    """An n x n matmul at one dtype, best of repeated runs."""

    tflops: Number = Field(description="achieved, TFLOP/s")
    n: int = Field(description="matrix size")
    seconds: Number = Field(description="best time of one matmul, seconds")
    fraction_of_peak: Number | None = Field(None, description="achieved / dense peak; null without a peak")


class WorkloadBench(Result):
    """One training step of a workload's model on synthetic inputs, median over repeated steps."""

    samples_per_s: Number = Field(description="training samples per second")
    step_s: Number = Field(description="median seconds per step")
    flops_per_step: Number = Field(description="FLOPs of one step, torch's FlopCounterMode")
    precision: str = Field(description="bf16-mixed or 32-true, as `gpuwise train` would pick")
    batch: int = Field(description="samples per step")
    params: int = Field(description="trainable parameters")
    tflops: Number = Field(description="achieved, TFLOP/s")
    tokens_per_s: Number | None = Field(None, description="tokens per second (language models)")
    s_per_sample: Number | None = Field(None, description="step seconds per sample (steps without counted FLOPs)")
    s_per_param: Number | None = Field(None, description="step seconds per parameter (steps without counted FLOPs)")
    s_per_step: Number | None = Field(
        None, description="step seconds whatever the batch, from a second timed batch (steps with counted FLOPs)"
    )
    flop_fraction: Number | None = Field(
        None, description="share of peak the FLOPs beyond s_per_step run at (steps with counted FLOPs)"
    )
    small_batch: int | None = Field(None, description="the second, smaller batch timed for s_per_step")
    fraction_of_peak: Number | None = Field(None, description="achieved / dense peak at the step's precision")


class Bandwidth(Result):
    """STREAM-style memory bandwidth, fp32."""

    copy_gbs: Number = Field(description="copy (read + write), GB/s")
    triad_gbs: Number = Field(description="triad a = b + s*c (two reads + one write), GB/s")
    bytes: int = Field(description="bytes per array")
    fraction_of_peak: Number | None = Field(None, description="triad / bandwidth peak; null without a peak")


class HostDevice(Result):
    """Pinned host <-> GPU copies."""

    h2d_gbs: Number = Field(description="host to device, GB/s")
    d2h_gbs: Number = Field(description="device to host, GB/s")
    bytes: int = Field(description="bytes per copy")
    fraction_of_peak: Number | None = Field(None, description="host to device / PCIe line rate")
    peak_origin: str = Field(description="where the PCIe line rate comes from")


class DeviceBench(Result):
    """Everything bench ran on one device."""

    key: str = Field(description="the device as the run record names it: cpu:<model> or cuda:<slug or name>")
    peak: DevicePeak = Field(description="the device's peaks")
    matmul: dict[str, MatmulResult] = Field(description="per dtype (fp32, tf32, bf16, fp16)")
    workloads: dict[str, WorkloadBench] = Field(description="per workload")
    bandwidth: Bandwidth = Field(description="memory bandwidth")
    host_device: HostDevice | None = Field(None, description="host <-> device copies (GPUs)")


class ProjectedRate(Result):
    """A projected matmul rate."""

    tflops: Number = Field(description="projected, TFLOP/s")
    basis: str = Field(description="what the projection rests on")


class ProjectedBandwidth(Result):
    """A projected memory bandwidth."""

    triad_gbs: Number = Field(description="projected, GB/s")
    basis: str = Field(description="what the projection rests on")


class ProjectedWorkload(Result):
    """A projected training step."""

    samples_per_s: Number = Field(description="projected training samples per second")
    basis: str = Field(description="what the projection rests on")


class GpuBenchProjection(Result):
    """What the catalog says a GPU would do on the same tests: projections, never measurements."""

    peak: DevicePeak = Field(description="the GPU as the catalog has it")
    projected: bool = Field(True, description="always true: projected from the catalog, not run")
    matmul: dict[str, ProjectedRate] = Field(default_factory=dict, description="per dtype")
    workloads: dict[str, ProjectedWorkload] = Field(default_factory=dict, description="per workload with a basis")
    bandwidth: ProjectedBandwidth = Field(description="memory bandwidth")


class BenchFiles(Result):
    """Where bench wrote its files."""

    json_path: str = Field(alias="json", description="bench.json")
    png: str = Field(description="bench.png, the bars")


class BenchResult(Result):
    """`gpuwise bench --json` and bench.json."""

    size: str = Field(description="quick or full")
    torch: str = Field(description="torch version")
    threads: int = Field(description="torch's CPU threads")
    devices: dict[str, DeviceBench] = Field(description="per device benchmarked (cpu, cuda:0, ...)")
    projections: dict[str, GpuBenchProjection] | None = Field(
        None, description="catalog GPUs projected when no GPU is here, per slug"
    )
    speedup: dict[str, dict[str, Number]] | None = Field(
        None, description="per device (or projected GPU): each test's rate over the CPU's (x)"
    )
    files: BenchFiles | None = Field(None, description="the files written")
    record_id: int | None = Field(None, description="id in the run record; null if not recorded")


# --- gpuwise train ----------------------------------------------------------------------------------------


class Baseline(Result):
    """What the run is compared against: the workload's baseline model, or the model before training. Its
    metric keys are the workload's (as in `eval`); a workload may add more under `also` (name -> metrics)."""

    model_config = ConfigDict(extra="allow")

    name: str | None = Field(None, description="what the baseline is (majority class, popularity, before training)")

    @property
    def metrics(self) -> dict[str, Any]:
        """The baseline's own metrics, by the workload's keys."""
        return {k: v for k, v in (self.model_extra or {}).items() if k != "also"}

    @property
    def also(self) -> dict[str, dict[str, Any]]:
        """Further baselines, name -> metrics (e.g. ItemKNN beside popularity)."""
        return (self.model_extra or {}).get("also") or {}


class Throughput(Result):
    """Training speed over the steady steps (the first pays for warm-up)."""

    samples_per_s: Number | None = Field(None, description="training samples per second")
    tokens_per_s: Number | None = Field(None, description="tokens per second (language models; null otherwise)")


class PeakFlops(Result):
    """The device peak the MFU is a fraction of."""

    per_device: Number | None = Field(None, description="dense peak of one device at the run's precision, FLOP/s")
    origin: str | None = Field(None, description="where the peak comes from")


class OomEvent(Result):
    """An out-of-memory step, retried at half the micro-batch (the global batch kept)."""

    step: int = Field(description="the step that ran out of memory")
    from_: int = Field(alias="from", description="micro-batch before")
    to: int = Field(description="micro-batch after")


class TrainPlan(Result):
    """What the loop estimated before training."""

    peak_bytes: int | None = Field(None, description="estimated peak memory, bytes")
    step_time_s: Number | None = Field(None, description="estimated seconds per step, data preparation included")
    efficiency: Number | None = Field(None, description="fraction of the peak assumed achieved")
    efficiency_origin: str | None = Field(None, description="where the efficiency comes from")
    time_origin: str | None = Field(None, description="the bench timing a per-sample step-time estimate rests on")
    data_s: Number | None = Field(None, description="seconds to prepare one batch, timed")
    method: str | None = Field(None, description="how the estimates were made")


class Measured(Result):
    """What the run recorded, against the plan."""

    peak_bytes: int | None = Field(None, description="the run's peak memory, bytes (tensors, as the plan counts)")
    step_time_s: Number | None = Field(None, description="median seconds per step after the first")
    method: str | None = Field(None, description="how peak memory was counted")
    process_peak_bytes: int | None = Field(
        None,
        description="CPU: the process's resident high-water growth over the steps plus the weights, which also "
        "holds allocator caching and library buffers (for sizing a machine)",
    )


class EstimateError(Result):
    """(plan - actual) / actual, where both are known."""

    peak_bytes: Number | None = Field(None, description="relative error of the memory estimate")
    step_time_s: Number | None = Field(None, description="relative error of the step-time estimate")


class GpuProjection(Result):
    """The run's counted FLOPs at the rate a catalog GPU sustains: a projection, not a measurement."""

    gpu: str = Field(description="catalog slug")
    seconds: Number = Field(description="projected training time, seconds")
    precision: str = Field(description="the precision `gpuwise train` would pick there")
    sustained_tflops: Number = Field(description="rate assumed sustained, TFLOP/s")
    basis: str = Field(description="what the rate rests on")
    usd: Number | None = Field(None, description="cost at the cheapest price, USD")
    provider: str | None = Field(None, description="the cheapest provider")
    usd_per_gpu_hour: Number | None = Field(None, description="its price, USD per GPU-hour")
    as_of: str | None = Field(None, description="date of the price")


class TrainSummary(Result):
    """summary.json and `gpuwise train --json`: a finished run, as the report, the record and the tables read it."""

    workload: str = Field(description="the workload trained")
    run_dir: str = Field(description="the run directory")
    steps: int = Field(description="optimizer steps taken")
    epochs: Number = Field(description="passes over the training set")
    final_loss: Number | None = Field(None, description="training loss of the last step")
    eval: dict[str, Any] = Field(description="held-out metrics, by the workload's own keys")
    baseline: Baseline = Field(default_factory=Baseline, description="what the run is compared against")
    throughput: Throughput = Field(default_factory=Throughput, description="training speed")
    mfu: Number | None = Field(None, description="model FLOPs utilization: counted FLOP/s over the peak")
    peak_flops: PeakFlops = Field(default_factory=PeakFlops, description="the peak the MFU is a fraction of")
    flops_per_step: Number | None = Field(None, description="FLOPs of one optimizer step, torch's FlopCounterMode")
    device: str = Field(description="accelerator x processes, e.g. 'cuda x 2'")
    precision: str = Field(description="Fabric precision (32-true, bf16-mixed, ...)")
    strategy: str | None = Field(None, description="Fabric strategy (auto, ddp, fsdp)")
    global_batch: int = Field(description="samples per optimizer step, all processes together")
    micro_batch: int = Field(description="samples per forward pass")
    accumulation: int = Field(description="micro-batches per optimizer step and process")
    oom_events: list[OomEvent] = Field(default_factory=list, description="out-of-memory steps and the retries")
    plan: TrainPlan = Field(default_factory=TrainPlan, description="the estimates made before training")
    actual: Measured = Field(default_factory=Measured, description="what the run recorded")
    estimate_error: EstimateError = Field(default_factory=EstimateError, description="(plan - actual) / actual")
    data: dict[str, Any] = Field(default_factory=dict, description="the workload's description of data and model")
    files: list[str] = Field(default_factory=list, description="files the trained model was saved to")
    wall_s: Number | None = Field(None, description="training wall-clock time, resumed parts included, seconds")
    projection: list[GpuProjection] = Field(default_factory=list, description="the same run on catalog GPUs")
    utilization: dict[str, Any] | None = Field(
        None, description="the devices' use while it trained, sampled (hardware/usage.py; docs/fleet.md)"
    )
    record_id: int | None = Field(None, description="id in the run record; null if not recorded")

    @property
    def published(self) -> dict[str, Any]:
        """The figure published for the workload's data set (metrics and their `source`), if any."""
        return self.data.get("published") or {}


SCHEMAS: dict[str, type[Result]] = {
    "plan": PlanResult,
    "traced": TracedPlan,
    "train": TrainSummary,
    "bench": BenchResult,
}


# --- gpuwise launch ---------------------------------------------------------------------------------------


class LaunchRecord(Result):
    """`gpuwise launch --submit`: a job handed to an engine, with the plan it was sized by."""

    engine: str = Field(description="slurm, ray, skypilot or k8s")
    job_id: str = Field(description="the job's id on the engine (Slurm job id, Ray submission id, name)")
    name: str = Field(description="the job's name on the engine")
    workload: str = Field(description="the workload the job trains, or the model an endpoint serves")
    run_dir: str = Field(description="the run directory, as the launching machine sees it")
    artifact: str = Field(description="the file handed to the engine")
    command: list[str] = Field(
        description="the gpuwise train command each node runs for a fresh run, or the serve command of each replica"
    )
    plan: dict[str, Any] = Field(description="the figures the job was sized by (gpuwise launch prints them)")
    engine_options: dict[str, Any] = Field(default_factory=dict, description="what the engine needs to find the job")
