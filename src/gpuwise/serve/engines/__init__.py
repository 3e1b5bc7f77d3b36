"""The engines behind the OpenAI front, beside their one interface (`base`): gpuwise's own (`gpuwise/`), vLLM
(`vllm.py`) and llama.cpp (`llamacpp.py`), the last two supervised child servers (`child.py`); `choose` picks one."""
