"""`gpuwise ui`: the planner, the runs, the bench and the served models in a browser (ui/)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gpuwise.cli.options import CatalogOpt
from gpuwise.cli.serve import _check_port_free, check_key


def ui(
    host: Annotated[str, typer.Option(help="Address to bind; anything but loopback needs an API key.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="TCP port.")] = 8300,
    runs_dir: Annotated[
        Path, typer.Option(help="Where `gpuwise train` writes its runs: those still training show from here.")
    ] = Path("runs"),
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="GPUWISE_API_KEY",
            help="Required on every data request when set; the page asks for it once. GPUWISE_API_KEY does not "
            "show in the process list.",
        ),
    ] = None,
    endpoint: Annotated[
        list[str] | None,
        typer.Option(
            metavar="URL",
            help="A running `gpuwise serve` (its URL, e.g. http://127.0.0.1:8000), repeatable: the Models page "
            "chats with its language models and sends images to its image model, through this server.",
        ),
    ] = None,
    endpoint_key: Annotated[
        str | None,
        typer.Option(envvar="GPUWISE_ENDPOINT_KEY", help="The API key of the --endpoint servers, if they need one."),
    ] = None,
    catalog: CatalogOpt = None,
) -> None:
    """A local web page: plan a model on every accelerator, follow and compare runs, see the bench, and try the
    models `gpuwise serve` serves (a chat, an image).

    Example: gpuwise ui --endpoint http://127.0.0.1:8000, then open http://127.0.0.1:8300/ (every script and
    style ships in the package)."""
    import uvicorn

    from gpuwise.ui.app import create_app
    from gpuwise.ui.endpoints import parse_endpoints

    check_key(host, api_key, "the run record", cookie=True)
    endpoints = parse_endpoints(list(endpoint or []), endpoint_key)
    app = create_app(catalog, runs_dir, api_key, endpoints)
    _check_port_free(host, port)
    print(f"gpuwise ui on http://{host}:{port}/ (Ctrl-C stops it)", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")
