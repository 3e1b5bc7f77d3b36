"""The one place a workload's name becomes a workload.

Three ways in, tried in this order:
- built in: the three below, imported only when used (the CLI starts without torch);
- an entry point in the group ``gpuwise.workloads`` of any installed package (as pytest finds its
  plugins): ``[project.entry-points."gpuwise.workloads"] my-task = "my_pkg.task:MyTask"``;
- ``my_pkg.module:MyWorkload`` given as the name on the command line, for a module on the Python path.

A run's config.yaml keeps the name as given, so `--resume`, `predict`, `serve` and `export` find the
same workload again. A run directory is untrusted input, and a name read from it is data: a built-in
name or an installed entry point is looked up, but a ``package.module:Class`` is imported only when the
user named that same class on the command line too (`--workload my_pkg.module:MyWorkload`), and never
from inside the run directory itself. Without it the command stops before anything is imported.
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


# What the user named on this command line (`gpuwise train X`, `--workload X`): the only package.module:Class
# names a run's config.yaml may resolve to. `--workload` is also checked against the config it confirms.
_named: set[str] = set()
_flag: list[str] = []


def name_given(name: str, flag: bool = False) -> None:
    """`name` was given on the command line (`flag`: as --workload, which a run's config must then match)."""
    _named.add(name)
    if flag:
        _flag[:] = [name]


def forget_given() -> None:
    """A new command line (main() called again in one process) starts with nothing named."""
    _named.clear()
    _flag.clear()


def _check_read(name: str, run_dir: Path) -> None:
    where = run_dir / "config.yaml"
    if _flag and name != _flag[0]:
        raise GpuwiseError(f"{where} names the workload {name}, not --workload {_flag[0]}: is it the run you meant?")
    if ":" in name and name not in _named:
        raise GpuwiseError(
            f"{where} names the workload {name}, code that a run directory cannot choose, so nothing was imported; "
            f"if you trained it, name it yourself: add --workload {name}"
        )


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
    # The top-level package is located first, and finding a top-level name runs nothing; a dotted name's
    # find_spec would already import (run) its parent package, which may be the one planted.
    top = module_name.partition(".")[0]
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError) as e:
        raise GpuwiseError(f"workload '{target}': cannot find module {module_name} ({first_line(e)})") from None
    if spec is None:
        raise GpuwiseError(f"workload '{target}': no module {top} on the Python path")
    if untrusted_dir is not None:
        inside = untrusted_dir.resolve()
        for where in [spec.origin, *(spec.submodule_search_locations or [])]:
            found = Path(where).resolve() if where and where not in ("built-in", "frozen") else None
            if found is not None and (found == inside or inside in found.parents):
                raise GpuwiseError(f"workload '{target}': {top} lies inside the run directory; not imported")
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
    directory whose config.yaml the name was read from: a package.module:Class from there must have been
    given on the command line (`name_given`), and none of that directory's own files is ever imported.
    Checked before the cache: the same name may be allowed by one command line and not by the next."""
    if untrusted_dir is not None:
        _check_read(name, untrusted_dir)
    return _get(name, untrusted_dir.resolve() if untrusted_dir else None)
