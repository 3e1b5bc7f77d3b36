"""`gpuwise serve`: a finished run behind an HTTP API."""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import sys
from pathlib import Path
from typing import Annotated

import typer

from gpuwise.cli.options import WorkloadOpt, console, emit
from gpuwise.errors import GpuwiseError
from gpuwise.files import read_key_file
from gpuwise.serve.hosts import is_loopback_name

# serve and ui alike: a client's time to send its headers, and again its body
ReadTimeoutOpt = Annotated[
    float, typer.Option(min=0.1, max=3600, help="Seconds a client may take to send its headers, and its body.")
]


def check_key(host: str, api_key: str | None, exposes: str, cookie: bool = False) -> None:
    """The rule of every gpuwise server: off loopback a key is required, and a key must be one an HTTP header
    (and, where the page sends it as a cookie, a cookie: no spaces) can carry."""
    if not is_loopback_name(host) and not api_key:
        raise GpuwiseError(f"--host {host} exposes {exposes} beyond this machine: set --api-key or GPUWISE_API_KEY")
    lowest = 33 if cookie else 32  # a cookie value holds no space
    if api_key is not None and (not api_key.strip() or any(ord(c) < lowest or ord(c) == 127 for c in api_key)):
        kinds = (
            "spaces or control characters that no header or cookie"
            if cookie
            else "control characters that no HTTP header"
        )
        raise GpuwiseError(f"--api-key: empty, or holds {kinds} can carry")


HOST_HELP = (
    "Address to bind; anything but loopback needs an API key. Requests are answered only when their Host names "
    "this server: localhost, a loopback address, this address, or an --allowed-host (DNS rebinding: a web page "
    "cannot reach the server through a name of its own). Bound to 0.0.0.0 or ::, where a key is required, any "
    "Host is answered: the machine's names are not knowable there, and the key stops a page that is not yours."
)
ALLOWED_HOST_HELP = (
    "Another name this server answers to in the Host header (repeatable; any port), e.g. the name a reverse "
    "proxy passes on or a LAN name; '*' is refused: it would let any web page in."
)


def _check_port_free(host: str, port: int) -> None:
    """uvicorn logs a failed bind and exits; one line here instead."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise GpuwiseError(f"cannot listen on {host}:{port} ({e.strerror})") from None


# `gpuwise serve`'s arguments and options, each with its help
RunDirArg = Annotated[
    Path | None,
    typer.Argument(
        metavar="RUN_OR_MODEL",
        help="A finished `gpuwise train` run, or a language model: a named base (smollm2-135m-instruct), "
        "a .gguf file, a model directory or a hub id, served behind the OpenAI API.",
    ),
]

ModelOpt = Annotated[
    list[str] | None,
    typer.Option(
        help="Language models: NAME=RUN_OR_MODEL, repeatable; clients pick one by its NAME. LoRA runs of one "
        "base share it in memory."
    ),
]

MaxBatchOpt = Annotated[int, typer.Option(min=1, max=65536, help="Items per forward pass at most (1: no batching).")]

ApiKeyOpt = Annotated[
    str | None,
    typer.Option(
        envvar="GPUWISE_API_KEY",
        help="Required on every request when set. The flag shows in the process list; GPUWISE_API_KEY does not.",
    ),
]

MaxConnectionsOpt = Annotated[int, typer.Option(min=1, max=100_000, help="Connections open at once; a 503 beyond.")]

MaxSeqsOpt = Annotated[
    int, typer.Option(min=1, max=4096, help="Language models: sequences generated together at most.")
]

MaxQueueOpt = Annotated[
    int, typer.Option(min=0, max=1_000_000, help="Language models: requests waiting at most; a 429 beyond.")
]

PrefixCacheOpt = Annotated[
    int,
    typer.Option(
        min=0,
        max=10_000_000,
        help="Language models: prompt tokens whose keys and values are kept, so that prompts which start "
        "alike (a chat template, a system prompt, earlier turns) run only what differs; 0: off.",
    ),
]

MaxModelLenOpt = Annotated[
    int,
    typer.Option(
        min=0,
        max=10_000_000,
        help="Language models: the longest prompt + answer, in tokens; it bounds the KV cache each "
        "sequence may take (vLLM preallocates it). 0: the model's own context.",
    ),
]

DtypeOpt = Annotated[
    str,
    typer.Option(
        help="Language models: auto (bf16 where the GPU or CPU computes it, else fp32; on llama.cpp a GGUF as "
        "it ships), fp32, bf16, fp16; q8_0 on llama.cpp (converted once by llama.cpp's converter, cached)."
    ),
]

WEIGHTS = ("auto", "bf16", "int8", "int4")
WeightsOpt = Annotated[
    str,
    typer.Option(
        help="Language models on gpuwise's engine: the weights it holds. auto: for a quantized GGUF on a CPU (the "
        "named bases ship Q4_1), its own Q8_0/Q4_1 blocks or bf16, whichever was measured least behind the "
        "faster from 1 to --max-seqs streams; else as --dtype; bf16; int8 (llama.cpp's "
        "Q8_0 blocks, 8.5 bits a weight) or int4 (Q4_1 layers, 5 bits, the output layer Q8_0), quantized at load "
        "from the model's weights and read by the CPU kernels as they are stored (docs/serving.md, \"Fewer bytes per "
        "token\")."
    ),
]

EngineOpt = Annotated[
    str,
    typer.Option(
        help="Language models: the engine that generates: auto, gpuwise, vllm, llama.cpp. auto: vLLM on CUDA "
        "where it is installed; on a CPU, for a quantized GGUF (the named bases), gpuwise's engine on its blocks, "
        "on them in bf16, or llama.cpp where it is installed, whichever was measured least behind the fastest "
        "from 1 to --max-seqs streams; else gpuwise's own. The rule and its measurements: docs/serving.md.",
    ),
]

VllmPythonOpt = Annotated[
    str | None,
    typer.Option(
        help="--engine vllm: the Python of an environment with vLLM (e.g. .venv-vllm/bin/python; "
        "or set GPUWISE_VLLM_PYTHON) [this environment's]. vLLM runs as a child process gpuwise supervises."
    ),
]

LlamaServerOpt = Annotated[
    str | None,
    typer.Option(
        help="--engine llama.cpp: the llama-server to run (or set GPUWISE_LLAMA_SERVER) [the one `make "
        "llama.cpp` built, else PATH's]. It runs as a child process gpuwise supervises."
    ),
]

VllmTimeoutOpt = Annotated[
    float,
    typer.Option(
        "--engine-timeout",
        "--vllm-timeout",
        min=1,
        max=86400,
        help="--engine vllm or llama.cpp: seconds the engine may take to start.",
    ),
]

CorsOriginOpt = Annotated[
    list[str] | None,
    typer.Option(
        help="A browser origin allowed to call the API (repeatable; * for any). A request from any other "
        "web page's origin (its Origin header) is a 403."
    ),
]

ApiKeyFileOpt = Annotated[
    Path | None,
    typer.Option(
        help="A file holding the key (its first line), instead of --api-key: neither the process list nor the "
        "environment shows it. How `gpuwise launch -- serve` hands a replica its key."
    ),
]

AnnounceOpt = Annotated[
    Path | None,
    typer.Option(
        help="Once listening, write where this server answers (JSON: url, host, port, pid) to this file; removed "
        "when it stops. How a launched endpoint's record learns its address (with --port 0, the port the OS chose)."
    ),
]

GraceOpt = Annotated[float, typer.Option(min=0, max=86400, help="Seconds in-flight requests get after SIGTERM.")]
ThreadsOpt = Annotated[
    int | None,
    typer.Option(
        min=1,
        max=4096,
        help="On a CPU, the compute threads of gpuwise's engine [all cores but one, left to the front end that "
        "sends each token] or llama.cpp [all cores]; OMP_NUM_THREADS where set.",
    ),
]


def serve(
    run_dir: RunDirArg = None,
    model: ModelOpt = None,
    host: Annotated[str, typer.Option(help=HOST_HELP)] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="TCP port; 0: any free one (see --announce).")] = 8000,
    allowed_host: Annotated[list[str] | None, typer.Option(metavar="NAME", help=ALLOWED_HOST_HELP)] = None,
    max_batch: MaxBatchOpt = 32,
    max_wait_ms: Annotated[float, typer.Option(min=0, max=10_000, help="How long a pass waits for more items.")] = 5.0,
    runtime: Annotated[str, typer.Option(help="torch, or onnx (after `gpuwise export`).")] = "torch",
    api_key: ApiKeyOpt = None,
    api_key_file: ApiKeyFileOpt = None,
    timeout: Annotated[float, typer.Option(min=0.001, max=86400, help="Seconds a request may take.")] = 30.0,
    read_timeout: ReadTimeoutOpt = 30.0,
    max_connections: MaxConnectionsOpt = 256,
    max_body_mb: Annotated[float, typer.Option(min=0.001, max=4096, help="Largest request body.")] = 16.0,
    max_k: Annotated[int, typer.Option(min=1, max=1_000_000, help="Ranking workloads: largest k.")] = 100,
    max_tokens: Annotated[int, typer.Option(min=1, max=1_000_000, help="Language models: largest max_tokens.")] = 512,
    max_prompt_chars: Annotated[
        int,
        typer.Option(
            min=1,
            max=10_000_000,
            help="Language models: the longest prompt (or messages) in characters, a 413 beyond; about 4 a token: "
            "raise it with --max-model-len for long prompts.",
        ),
    ] = 8000,
    max_seqs: MaxSeqsOpt = 32,
    max_queue: MaxQueueOpt = 256,
    prefix_cache: PrefixCacheOpt = 4096,
    max_model_len: MaxModelLenOpt = 0,
    dtype: DtypeOpt = "auto",
    weights: WeightsOpt = "auto",
    engine: EngineOpt = "auto",
    vllm_python: VllmPythonOpt = None,
    llama_server: LlamaServerOpt = None,
    vllm_timeout: VllmTimeoutOpt = 900.0,
    confirmed: WorkloadOpt = None,
    cors_origin: CorsOriginOpt = None,
    grace: GraceOpt = 30.0,
    threads: ThreadsOpt = None,
    announce: AnnounceOpt = None,
    record: Annotated[
        bool,
        typer.Option(
            "--record/--no-record",
            help="Language models: when the server stops, record what it served (TTFT, TPOT, goodput) beside what "
            "the plan expected at that traffic, for `gpuwise runs`.",
        ),
    ] = True,
    json_out: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Print the start-up plan (where it serves, the engine, the serving plan, the goodput it holds) as "
            "one JSON object on stdout once the model is loaded, instead of the banner; then serve.",
        ),
    ] = False,
):
    """Serve a trained run over HTTP: its workload's route (/v1/predict for images, /v1/recommend for
    rankings), with /health, /v1/info, /metrics and the OpenAPI docs at /docs. A language model (a
    trained run, or a model given directly) gets the OpenAI API: /v1/models, /v1/chat/completions,
    /v1/completions, with continuous batching.

    Example: gpuwise serve smollm2-135m-instruct, then point the openai SDK or Open WebUI at
    http://127.0.0.1:8000/v1"""
    # Before torch loads OpenMP: a server's compute threads share the cores with its event loop, and OpenMP's
    # workers spinning between parallel regions take the CPU that loop needs to send each token (on 2 cores,
    # PASSIVE against libgomp's default: 32 streams 1.16-1.28x, one stream level; docs/serving.md "One stream").
    # Set OMP_WAIT_POLICY to override. For this process only: an engine server gpuwise starts keeps its own
    # default (serve/engines/child.py).
    if "OMP_WAIT_POLICY" not in os.environ:
        from gpuwise.serve.engines.child import OWN_ONLY  # no torch in it

        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        os.environ[OWN_ONLY] = "OMP_WAIT_POLICY"
    # here, not at the top: `gpuwise --help` and the other commands start without them
    from gpuwise.serve.app import Settings, create_app, run_server, server_config
    from gpuwise.serve.engines.choose import choose_engine
    from gpuwise.serve.hosts import allowed_hosts
    from gpuwise.serve.llm.core import LLM
    from gpuwise.serve.models import Limits, Target, load

    # parse: every flag checked before anything loads
    numbers = {"--timeout": timeout, "--read-timeout": read_timeout, "--max-body-mb": max_body_mb,
               "--max-wait-ms": max_wait_ms, "--grace": grace, "--vllm-timeout": vllm_timeout}  # fmt: skip
    for flag, value in numbers.items():
        if math.isnan(value):  # click's range check lets nan through (every comparison with it is false)
            raise GpuwiseError(f"{flag} must be a number, not nan")
    if runtime not in ("torch", "onnx"):
        raise GpuwiseError(f"--runtime {runtime}: choose torch or onnx")
    if weights not in WEIGHTS:
        raise GpuwiseError(f"--weights {weights}: choose {', '.join(WEIGHTS)}")
    if weights == "bf16" and dtype not in ("auto", "bf16"):
        raise GpuwiseError(f"--weights bf16 with --dtype {dtype}: give one of them")
    if weights in ("int8", "int4") and dtype not in ("auto", "bf16", "fp32"):
        raise GpuwiseError(f"--weights {weights} computes in bf16 or fp32 (--dtype), not {dtype}")
    if weights in ("int8", "int4") and engine == "auto":
        engine = "gpuwise"  # the quantized weights are gpuwise's engine's
    if api_key_file is not None:
        if api_key is not None:
            raise GpuwiseError("give the key once: --api-key (or GPUWISE_API_KEY) or --api-key-file, not both")
        api_key = read_key_file(api_key_file)
    check_key(host, api_key, "the model")
    allowed_hosts(allowed_host)  # a bad name is one line now, not after the model loads
    if port:
        _check_port_free(host, port)
    if announce is not None and not announce.parent.is_dir():
        raise GpuwiseError(f"--announce {announce}: its folder does not exist")
    limits = Limits(
        max_body_bytes=int(max_body_mb * 2**20),
        max_k=max_k,
        max_tokens=max_tokens,
        max_prompt_chars=max_prompt_chars,
        timeout_s=timeout,
        read_timeout_s=read_timeout,
        max_connections=max_connections,
        max_seqs=max_seqs,
        max_queue=max_queue,
        prefix_cache_tokens=prefix_cache,
        max_model_len=max_model_len,
    )
    # plan and choose: what is served, on which engine (the serving plan is each backend's, printed below)
    target = Target.of(str(run_dir) if run_dir is not None else None, model)
    chosen = choose_engine(engine, list(target.refs), max_seqs, dtype, vllm_python, llama_server)
    chosen = _set_threads(chosen, threads)
    if weights == "auto" and chosen.weights:  # a quantized GGUF on gpuwise's engine: the file's own blocks
        weights = chosen.weights
    # start
    served = load(target, chosen, runtime, limits, dtype, vllm_timeout, weights)
    name = str(run_dir) if run_dir is not None else target.refs[0][0]  # --model alone: /v1/info names the first
    settings = Settings(name, runtime, max_batch, max_wait_ms, api_key, limits, list(cors_origin or []), host=host,
                        allowed_hosts=list(allowed_host or []))  # fmt: skip
    llm = served if isinstance(served, LLM) else None
    replica, goodput_line = None, ""
    if llm is not None:  # what the plan says this server holds at the default targets
        replica, goodput_line = _startup_plan(llm, name, chosen.engine)
    on_stop = None
    if llm is not None and record:

        def on_stop(usage: dict | None) -> None:
            # here, not at the top: `gpuwise --help` and the other commands start without it
            from gpuwise.serve.llm.session import record_session

            record_session(llm.session, name, chosen.engine, llm.device, replica, llm.startup, usage)

    precision = llm.precision if llm else "fp32"
    # an endpoint launched onto a cluster keeps its devices' use beside its address, for `gpuwise fleet`
    usage_file = announce.with_name(announce.stem + ".usage.json") if announce is not None else None
    asgi = create_app(served, settings, run_id=Path(name).name, precision=precision, on_stop=on_stop,
                      usage_file=usage_file)  # fmt: skip
    # print
    if json_out:
        emit(_startup(llm, served, name, chosen, runtime, host, port, max_batch, max_wait_ms, goodput_line))
        sys.stdout.flush()
    else:
        console.print(_banner(llm, served, name, runtime, host, port, max_batch, max_wait_ms))
        if goodput_line:
            console.print(goodput_line, markup=False, highlight=False)
    # uvicorn handles SIGTERM/SIGINT: it stops accepting, lets in-flight requests finish (up to
    # --grace seconds), then runs the app's shutdown.
    run_server(server_config(asgi, host, port, limits, grace), announce, "/v1" if llm is not None else "")


def _startup_plan(llm, name: str, engine: str):
    """The replica this server is planned as and the start-up plan's goodput line (plan/endpoint.py); a plan
    that cannot be made is said in that line, and the server starts all the same."""
    # here, not at the top: `gpuwise --help` and the other commands start without it
    from gpuwise.hardware.catalog import load_catalog
    from gpuwise.plan.endpoint import endpoint_replica, startup_line

    try:
        weights = getattr(llm.backends[0], "weights", "bf16")
        replica, why = endpoint_replica(name, engine, llm.device, llm.precision, load_catalog(), weights)
        line, llm.startup = startup_line(replica, why, llm.backends[0].context)
    except GpuwiseError as e:
        return None, f"goodput: not planned: {e}"
    return replica, line


def _set_threads(chosen, threads: int | None):
    """On a CPU, the compute threads the plan gives gpuwise's engine (this process's torch) or llama.cpp (which
    reads them from torch: serve/engines/llamacpp.py), said in the engine's line; vLLM-CPU reserves its own."""
    # here, not at the top: `gpuwise --help` and the other commands start without them
    import torch

    from gpuwise.hardware.cpu import detect_cpu
    from gpuwise.hardware.devices import serving_device
    from gpuwise.plan import serving

    if chosen.engine == "vllm" or serving_device() != "cpu":
        return chosen
    cores, env = detect_cpu().cores, os.environ.get("OMP_NUM_THREADS")
    n, why = serving.compute_threads(cores, chosen.engine, threads, env)
    torch.set_num_threads(n)
    if chosen.engine == "gpuwise" and n < cores and threads is None and not env:
        serving.ONE_STREAM_THREADS = cores  # a step of one stream: every core (plan/serving.py says why)
        why += f", {cores} for a step of one stream"
    return dataclasses.replace(chosen, why=f"{chosen.why}; {why}")


def _startup(llm, served, name, chosen, runtime, host, port, max_batch, max_wait_ms, goodput_line) -> dict:
    """`serve --json`: what the banner and the goodput line say, as data."""
    if llm is not None:
        return {
            "url": f"http://{host}:{port}/v1",
            "api": "openai",
            "models": list(llm.names),
            "model": llm.model_name,
            "device": llm.device,
            "precision": llm.precision,
            "engine": chosen.engine,
            "engine_why": chosen.why,
            "plan": llm.plan().splitlines(),
            "goodput": llm.startup,
            "goodput_line": goodput_line,
        }
    return {
        "url": f"http://{host}:{port}",
        "api": served.workload,
        "run": name,
        "runtime": runtime,
        "device": served.device,
        "max_batch": max_batch,
        "max_wait_ms": max_wait_ms,
    }


def _banner(llm, served, name: str, runtime: str, host: str, port: int, max_batch: int, max_wait_ms: float) -> str:
    """What `gpuwise serve` prints once the model is loaded: where, and the plan it serves by (a language model:
    its engine, and the serving plan each backend reads; image and ranking runs: fp32, batched)."""
    if llm is not None:
        return (
            f"serving {llm.model_name} on {llm.device} at http://{host}:{port}/v1 (OpenAI API: model "
            f"{' or '.join(map(repr, llm.names))}) · docs at /docs\n{llm.plan()}"
        )
    return (
        f"serving {name} ({served.workload}, {runtime} on {served.device}) at http://{host}:{port}"
        f" · docs at /docs · batches of up to {max_batch}, waiting up to {max_wait_ms:g} ms"
    )
