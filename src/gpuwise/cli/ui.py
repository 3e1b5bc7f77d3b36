"""`gpuwise ui`: the planner, the runs, the bench and the served models in a browser (ui/)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gpuwise.cli.options import CatalogOpt
from gpuwise.cli.serve import ALLOWED_HOST_HELP, HOST_HELP, ReadTimeoutOpt, _check_port_free, check_key
from gpuwise.errors import GpuwiseError


def ui(
    host: Annotated[str, typer.Option(help=HOST_HELP)] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="TCP port.")] = 8300,
    allowed_host: Annotated[list[str] | None, typer.Option(metavar="NAME", help=ALLOWED_HOST_HELP)] = None,
    runs_dir: Annotated[
        Path, typer.Option(help="Where `gpuwise train` writes its runs: those still training show from here.")
    ] = Path("runs"),
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="GPUWISE_API_KEY",
            help="Required on every data request when set; the page asks for it once. GPUWISE_API_KEY does not "
            "show in the process list. Without it, a ui given --endpoint-key makes a token for this launch and "
            "prints the URL that carries it (?token=...), as Jupyter does: it never lends the endpoints' key to "
            "whoever reaches it.",
        ),
    ] = None,
    endpoint: Annotated[
        list[str] | None,
        typer.Option(
            metavar="URL|ID",
            help="A running `gpuwise serve` (its URL, e.g. http://127.0.0.1:8000), or the record id of an endpoint "
            "`gpuwise launch` started (its address and key from the record), repeatable: the Models page "
            "chats with its language models and sends images to its image model, through this server.",
        ),
    ] = None,
    endpoint_key: Annotated[
        str | None,
        typer.Option(envvar="GPUWISE_ENDPOINT_KEY", help="The API key of the --endpoint servers, if they need one."),
    ] = None,
    read_timeout: ReadTimeoutOpt = 30.0,
    max_body_mb: Annotated[
        float, typer.Option(min=0.001, max=4096, help="Largest request body (an image sent to an endpoint).")
    ] = 64.0,
    catalog: CatalogOpt = None,
) -> None:
    """A local web page: plan a model on every accelerator, follow and compare runs, see the bench, and try the
    models `gpuwise serve` serves (a chat, an image). A request from another site's page is refused (403), as is
    one whose Host names another server (421): see --host.

    Example: gpuwise ui --endpoint http://127.0.0.1:8000, then open http://127.0.0.1:8300/ (every script and
    style ships in the package)."""
    import math

    import uvicorn

    # here, not at the top: `gpuwise --help` and the other commands start without it
    from gpuwise.serve.app import server_config
    from gpuwise.ui.app import create_app
    from gpuwise.ui.endpoints import parse_endpoints
    from gpuwise.workloads.serving import Limits

    for flag, value in (("--read-timeout", read_timeout), ("--max-body-mb", max_body_mb)):
        if math.isnan(value):  # click's range check lets nan through
            raise GpuwiseError(f"{flag} must be a number, not nan")
    check_key(host, api_key, "the run record", cookie=True)
    endpoints = parse_endpoints(list(endpoint or []), endpoint_key)
    limits = Limits(max_body_bytes=int(max_body_mb * 2**20), read_timeout_s=read_timeout)
    app = create_app(catalog, runs_dir, api_key, endpoints, host=host, allowed_hosts=allowed_host, limits=limits)
    _check_port_free(host, port)
    where = f"[{host}]" if ":" in host else host
    token = f"?token={app.token}" if app.token else ""
    print(f"gpuwise ui on http://{where}:{port}/{token} (Ctrl-C stops it)", flush=True)
    # serve's uvicorn settings: a deadline on a request's headers (a silent connection is closed), a bound on
    # open connections; Guard caps the body and its read time.
    uvicorn.Server(server_config(app, host, port, limits, grace=5.0)).run()
