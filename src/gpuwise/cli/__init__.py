"""The command line: `cli.app` holds the typer app and `main`; one module per command."""

from gpuwise.cli.app import app, main

__all__ = ["app", "main"]
