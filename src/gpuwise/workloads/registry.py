"""The one place a workload's name becomes a workload.

Three ways in, tried in this order:
- built in: the three below, imported only when used (the CLI starts without torch);
- an entry point in the group ``gpuwise.workloads`` of any installed package (as pytest finds its
  plugins): ``[project.entry-points."gpuwise.workloads"] my-task = "my_pkg.task:MyTask"``;
- ``my_pkg.module:MyWorkload`` given as the name, for a module on the Python path.

A run's config.yaml keeps the name as given, so `--resume`, `predict`, `serve` and `export` find the
same workload again. A run directory is untrusted input: a module it names is imported only from the
installed packages and the Python path, never from inside the run directory itself.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
from pathlib import Path

from gpuwise.errors import GpuwiseError, closest, first_line
from gpuwise.workloads.base import WORKLOAD_OPTIONS, Workload

GROUP = "gpuwise.workloads"
BUILTIN = {
    "defects": ("gpuwise.workloads.defects:Defects", "ELPV solar cells, defect or not"),
    "recommender": ("gpuwise.workloads.recommender:Recommender", "MovieLens, top-k items per user"),
    "product-lm": ("gpuwise.workloads.product_lm:ProductLM", "an LLM fine-tuned on fine-food reviews"),
}


@functools.cache
def _entry_points() -> dict:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=GROUP) if ep.name not in BUILTIN}


def names() -> list[str]:
    """Every workload name this installation knows: built in, then from entry points."""
    return [*BUILTIN, *sorted(_entry_points())]


def described() -> str:
    """The names with a few words each, for help texts (no workload module is imported)."""
    plugins = [f"{n} (plugin)" for n in sorted(_entry_points())]
    return ", ".join([f"{n} ({about})" for n, (_, about) in BUILTIN.items()] + plugins)


def _import(target: str, untrusted_dir: Path | None):
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise GpuwiseError(f"workload '{target}': expected package.module:Class")
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError) as e:
        raise GpuwiseError(f"workload '{target}': cannot find module {module_name} ({first_line(e)})") from None
    if spec is None:
        raise GpuwiseError(f"workload '{target}': no module {module_name} on the Python path")
    if untrusted_dir is not None and spec.origin:
        origin, inside = Path(spec.origin).resolve(), untrusted_dir.resolve()
        if origin == inside or inside in origin.parents:
            raise GpuwiseError(f"workload '{target}': {module_name} lies inside the run directory; not imported")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - the user's module ran on import, and failed: one line
        raise GpuwiseError(f"workload '{target}': importing {module_name} failed: {first_line(e)}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise GpuwiseError(f"workload '{target}': {module_name} has no {attr}") from None


def _instance(obj, name: str) -> Workload:
    if isinstance(obj, type) and issubclass(obj, Workload):
        obj = obj()
    if not isinstance(obj, Workload):
        raise GpuwiseError(f"workload '{name}': {obj!r} is not a gpuwise.workloads.Workload (subclass it)")
    unknown = set(obj.options) - set(WORKLOAD_OPTIONS)
    if unknown:
        raise GpuwiseError(
            f"workload '{name}': unknown options {sorted(unknown)}; known: {', '.join(WORKLOAD_OPTIONS)}"
        )
    return obj


@functools.cache
def _get(name: str, untrusted_dir: Path | None) -> Workload:
    if name in BUILTIN:
        return _instance(_import(BUILTIN[name][0], None), name)
    if name in _entry_points():
        try:
            obj = _entry_points()[name].load()
        except Exception as e:  # noqa: BLE001 - a plugin's import failed: one line naming it
            raise GpuwiseError(
                f"workload '{name}' (entry point {_entry_points()[name].value}): {first_line(e)}"
            ) from None
        return _instance(obj, name)
    if ":" in name:
        return _instance(_import(name, untrusted_dir), name)
    raise GpuwiseError(f"unknown workload '{name}'{closest(name, names())} (or give package.module:Class)")


def get(name: str, untrusted_dir: Path | None = None) -> Workload:
    """The workload called `name`, or one line saying why there is none. `untrusted_dir`: the run
    directory the name was read from (its own files are never imported)."""
    return _get(name, untrusted_dir.resolve() if untrusted_dir else None)
