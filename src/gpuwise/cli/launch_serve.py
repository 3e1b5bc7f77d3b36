"""`gpuwise launch ENGINE -- serve MODEL`: an endpoint planned (launch/endpoint.py), written as the engine runs
it, and with --submit handed over with its key and recorded."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import typer
from rich import box
from rich.table import Table

from gpuwise.cli import serve as serve_cli
from gpuwise.cli.options import console, emit, load_catalog
from gpuwise.errors import GpuwiseError
from gpuwise.files import write_atomic
from gpuwise.launch.endpoint import key_file_checked, new_key_file, plan_endpoint
from gpuwise.launch.job import dollars
from gpuwise.launch.rayjob import address_of
from gpuwise.plan.traffic import targets, traffic
from gpuwise.results import LaunchRecord
from gpuwise.runs import db

# Flags of `gpuwise serve` that an endpoint's launch sets: given after `-- serve` they would contradict it.
SERVE_SET_BY_LAUNCH = {
    "--host": "the launch (every interface, where the engine routes to the replica)",
    "--port": "gpuwise launch --port",
    "--api-key": "gpuwise launch --api-key-file or --key-secret (a key is never written inline)",
    "--api-key-file": "gpuwise launch --api-key-file",
    "--announce": "the launch (each replica announces its address beside the record)",
    "--grace": "the launch (the drain fits the engine's kill timeout)",
    "--json": "the launch (its output has no reader on a node): drop it",
}


def parse_serve(argv: list[str]) -> tuple[str, tuple[str, ...], dict]:
    """The serve command after `--`: its model, its options as given, and their values, parsed by `gpuwise
    serve`'s own options (a typo is the same error as there)."""

    for arg in argv[1:]:
        flag = arg.split("=", 1)[0]
        if flag in SERVE_SET_BY_LAUNCH:
            raise GpuwiseError(f"serve {flag} is set by {SERVE_SET_BY_LAUNCH[flag]}")
    app = typer.Typer(add_completion=False)
    app.command()(serve_cli.serve)
    command = typer.main.get_command(app)
    try:
        ctx = command.make_context("gpuwise serve", list(argv[1:]))
    except Exception as e:  # click's usage errors: one line, as `gpuwise serve` gives them
        format_message = getattr(e, "format_message", None)
        message = format_message() if callable(format_message) else str(e)
        raise GpuwiseError(f"the serve command: {message}") from None
    params = ctx.params
    if params.get("model"):
        raise GpuwiseError("serve --model: a launched endpoint serves one model: -- serve MODEL [serve options]")
    if params.get("run_dir") is None:
        raise GpuwiseError("name the model: -- serve MODEL [serve options]")
    model = str(params["run_dir"])
    options = list(argv[1:])
    options.remove(next(a for a in options if a == model or Path(a) == Path(model)))
    return model, tuple(options), params



def launch_endpoint(chosen, argv, opts, sized, gpu, gpus, nodes, submit, out, run_dir, time_limit, cpus, mem,
                     catalog, as_json, max_cost) -> None:  # fmt: skip
    """`gpuwise launch ENGINE [options] -- serve MODEL [serve options]`: plan the endpoint, write the engine's
    artifact, and with --submit hand it over and record it."""

    if nodes is not None:
        raise GpuwiseError("--nodes lays out a training job: an endpoint's replica runs on one node (--replicas)")
    if sized["key_secret"] and chosen.name != "k8s":
        raise GpuwiseError("--key-secret names a Kubernetes Secret: on this engine give --api-key-file")
    model, options, params = parse_serve(argv)
    demand = goal = None
    if any(v is not None for v in sized["serving"].values()):
        demand = traffic(**sized["serving"])
        goal = targets(*sized["targets"])
    ep = plan_endpoint(model, options, params, load_catalog(catalog), gpu, gpus, sized["replicas"],
                       sized["max_replicas"], demand, goal, str(run_dir) if run_dir else None, cpus, mem,
                       chosen.names, rented=chosen.name == "skypilot")  # fmt: skip
    cost = ep.figures.get("usd_per_month")
    if max_cost is not None and cost is not None and cost > max_cost:
        raise GpuwiseError(f"the endpoint costs {cost:,.0f} USD a month, over --max-cost {max_cost:g}")
    opts = replace(opts, key_secret=sized["key_secret"], port=sized["port"] or 0,
                   time_limit_s=time_limit * 60 if time_limit else None)  # fmt: skip
    chosen.check_endpoint(ep, opts)
    if sized["api_key_file"] is not None:
        key_file = key_file_checked(sized["api_key_file"])
    else:
        key_file = Path(ep.run_dir) / "api-key"
    # The replicas read the key where the engine keeps files (Slurm, Ray: the endpoint's folder, shared); on
    # Kubernetes and SkyPilot the engine's own secret carries it, and the file only feeds that secret.
    ep = replace(ep, key_file=str(key_file) if chosen.name in ("slurm", "ray") else None)
    if submit:
        chosen.preflight_endpoint(ep, opts)
    text = chosen.render_endpoint(ep, opts)
    path = out or Path(ep.name + chosen.suffix)
    job_id = record_id = None
    if submit:
        if sized["api_key_file"] is None and not (chosen.name == "k8s" and sized["key_secret"]):
            _write_key(key_file, os.environ.get("GPUWISE_API_KEY"), new_key_file)
        ep = replace(ep, key_file=str(key_file))
        write_atomic(path, text)
        job_id = chosen.submit_endpoint(path, ep, opts)
        record_id = _record_endpoint(chosen.name, job_id, ep, path, opts)
    else:
        write_atomic(path, text)
    if as_json:
        emit({"engine": chosen.name, "artifact": str(path), "text": text, "plan": ep.figures, "job_id": job_id,
              "record_id": record_id, "run_dir": ep.run_dir})  # fmt: skip
        return
    _show_endpoint(ep)
    console.print(f"# {path}", style="bold", highlight=False)
    console.print(text, markup=False, highlight=False, soft_wrap=True)
    if submit:
        console.print(f"submitted to {chosen.name}: job {job_id}; record #{record_id}: gpuwise runs shows its "
                      f"address, gpuwise chat {record_id} talks to it, gpuwise launch --stop {record_id} ends it",
                      highlight=False)  # fmt: skip
    else:
        console.print(f"not submitted: add --submit to hand {path} to {chosen.name}", highlight=False)


def _write_key(path: Path, given: str | None, new_key_file) -> None:
    """The endpoint's key file: GPUWISE_API_KEY's key where it is set, else a new one; only its owner reads it."""

    try:
        if given is None:
            new_key_file(path.parent)
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(given + "\n")
    except FileExistsError:
        raise GpuwiseError(f"{path} exists: another endpoint's key; choose another --run-dir") from None
    except OSError as e:
        raise GpuwiseError(f"cannot write the key file {path} ({e.strerror})") from None


def _record_endpoint(engine: str, job_id: str, ep, path: Path, opts) -> int | None:

    found: dict = {"endpoint": True, "replicas": ep.replicas}
    if ep.key_file and Path(ep.key_file).is_file():  # its path, for gpuwise chat ID; never the key
        found["key_file"] = ep.key_file
    if engine == "ray":

        found["address"] = address_of(opts)
    found |= {"namespace": opts.namespace} if opts.namespace else {}
    found |= {"key_secret": opts.key_secret} if opts.key_secret else {}
    data = LaunchRecord(engine=engine, job_id=job_id, name=ep.name, workload=ep.model, run_dir=ep.run_dir,
                        artifact=str(path.resolve()), command=ep.serve_command(), plan=ep.figures,
                        engine_options=found)  # fmt: skip
    return db.try_record("launch", ep.gpu, ep.model, data, run_dir=ep.run_dir)


def _show_endpoint(ep) -> None:

    f, src = ep.figures, ep.figures["sources"]
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, title=f"endpoint: {ep.model}", title_justify="left")
    t.add_column("figure")
    t.add_column("value", justify="right")
    t.add_column("where it comes from")
    where = f"{ep.gpus} x {ep.gpu_name}" if ep.accelerator == "cuda" else "CPU"
    rows = [
        ("a replica", where, src["layout"]),
        ("replicas", f"{ep.replicas}" + (f" to {ep.max_replicas}" if ep.max_replicas > ep.replicas else ""),
         src["replicas"]),  # fmt: skip
    ]
    if f.get("weights_bytes"):
        rows.append(("weights", f"{f['weights_bytes'] / 2**30:,.2f} GiB", f"{f['precision']}: the model's parameters"))
    if f.get("goodput_per_replica"):
        q = f["targets"]
        rows.append(("goodput a replica", f"{f['goodput_per_replica']:.3g} requests/s",
                     f"TTFT <= {q['ttft']:g} s, TPOT <= {q['tpot']:g} s for {q['percentile']:g} %"))  # fmt: skip
        rows.append(("engine, max sequences", f"{f['engine']}, {f['max_seqs']}", src["engine"]))
    rows.append(("CPUs, memory a replica", f"{ep.cpus}, {ep.mem_gib} GiB", f"{src['cpus']}; {src['host_memory']}"))
    if f.get("usd_per_month") is not None:
        rows.append(("cost", f"{dollars(f['usd_per_month'])}/month", src["cost"]))
    for r in rows:
        t.add_row(*r)
    console.print(t)
