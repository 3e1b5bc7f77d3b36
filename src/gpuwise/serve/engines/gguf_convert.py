"""Run one of llama.cpp's converters (convert_hf_to_gguf.py, convert_lora_to_gguf.py) with one change, for
`gpuwise serve --engine llama.cpp`: a tokenizer whose pre-tokenizer llama.cpp does not know (its converter
recognises a list of published ones by a hash of their output; a language-model run trained from scratch has a
tokenizer of its own) is written as llama.cpp's "default" one instead of ending the conversion.

Why that is safe here: the pre-tokenizer only decides how llama.cpp itself would split a text into tokens, and
gpuwise never asks it to: prompts go to llama-server as token ids from the model's own tokenizer, and what comes
back is token ids, and their text by the same vocabulary.

    python -m gpuwise.serve.engines.gguf_convert SCRIPT ARGS...   (with the converter's directory and gguf-py on
    PYTHONPATH)
"""

from __future__ import annotations

import logging
import runpy
import sys


def main() -> None:
    script, args = sys.argv[1], sys.argv[2:]
    from conversion.base import TextModel  # the converter's own package, from PYTHONPATH

    known = TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            logging.getLogger("gpuwise").warning("pre-tokenizer not known to llama.cpp: written as 'default'")
            return "default"

    TextModel.get_vocab_base_pre = get_vocab_base_pre  # type: ignore[method-assign]
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
