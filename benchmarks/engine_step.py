"""One decode step of the serving engine, in one process, side by side, on SmolLM2-135M-Instruct: the fused
decoder (serve/engines/gpuwise/decoder.py, what `gpuwise serve` runs for a Llama-family model) and transformers' forward
through the same engine, in fp32 and in bf16, the linears of both packed as `gpuwise serve` packs them
(serve/engines/gpuwise/packed.py; the fused fp32 decoder also unpacked; the fused bf16 one also with SDPA for its decode
attention instead of serve/engines/gpuwise/attention.py's kernel, with each layer's ops from Python instead of the
whole-step
kernel, and with those ops' products by oneDNN instead of the product kernel: the last two are the decode step
before issue #37; and with its plain weights as stored rather than four rows at a time, quant.interleave_rows), and
transformers' `generate` at the same batch.

Run: .venv/bin/python benchmarks/engine_step.py [--batches 1,8,32] [--rounds 3] [--steps 16] [--lora 8]
     [--weights int8,int4]

--weights: the fused bf16 step also on int8 and int4 weights (`gpuwise serve --weights`), speed-up over bf16's;
with int8, also on its Q8_0 blocks as a GGUF ships them rather than four rows at a time (quant.interleave); on a
CPU without AMX's tiles, with a batch of 16 or more, also with the quantized products of 16 rows or more sent to
the library (dequantized chunks, oneDNN), as before decoder.KERNEL_ROWS.
For each fused bf16 variant the whole-step kernel's call is also timed alone: the rest of its step is Python.
Read them under OMP_WAIT_POLICY=PASSIVE, as `gpuwise serve` runs: with OpenMP's default, the `generate` variants
leave its threads spinning into the next variant's step, and the short quantized steps pay most (int8 / bf16 at
one row read 1.07x so, 1.42x under PASSIVE, on the 2-core Xeon).

--lora R: every model gets a LoRA adapter of rank R on every linear layer (as a `product-lm` run), every row
runs it: the fused decoder's row-by-row LoRA against peft's.

No server, no client: the engine's `_start` and `_step` called directly, so what it shows is the model's
step and the engine's own bookkeeping. Each round measures every variant at every batch, the order
alternating by round (this shared VM's speed drifts by tens of per cent over minutes; one variant after
another would read the drift as a difference). Per (variant, batch): the median decode step over all rounds,
and tokens/s = batch / step. `generate`'s step: (time for 1 + steps new tokens - time for 1) / steps.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch


def engine_step(engine, prompt: list[int], batch: int, steps: int, adapter: str | None = None) -> list[float]:
    """Per-step seconds of `steps` decode steps of `batch` copies of `prompt`, after a prefill and one step."""
    from gpuwise.serve.engines.base import Params, Sequence

    params = Params(max_tokens=steps + 8, temperature=0.0)
    seqs = [
        Sequence(list(prompt), params, lambda e: None, time.monotonic() + 600, adapter=adapter) for _ in range(batch)
    ]
    engine._start(seqs)
    while engine.prefilling:  # the prompts, then a first decode step with them
        engine._step()
    engine._step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine._step()
        times.append(time.perf_counter() - t)
    for s in list(engine.running):
        engine._end(s, "cancelled")
    return times


def generate_step(model, prompt: list[int], batch: int, steps: int) -> float:
    ids = torch.tensor([prompt] * batch)
    mask = torch.ones_like(ids)

    def run(n: int) -> float:
        t = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - t

    return (run(1 + steps) - run(1)) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--lora", type=int, default=0, help="every row through a LoRA adapter of this rank (all linears)")
    ap.add_argument("--weights", default="int8,int4", help="quantized variants of the fused bf16 step ('' for none)")
    args = ap.parse_args()

    from llm_serve_load import WeightRead, weight_bytes  # beside this script
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from gpuwise.serve.engines.gpuwise import attention
    from gpuwise.serve.engines.gpuwise.decoder import LIBRARY_ROWS, fused_decoder
    from gpuwise.serve.engines.gpuwise.engine import Engine
    from gpuwise.serve.engines.gpuwise.packed import pack_linears, packing
    from gpuwise.workloads.pretrained import resolve_base

    hf_logging.set_verbosity_error()
    model_dir = resolve_base("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is a GPU good for?"}], add_generation_prompt=True, tokenize=False
    )
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    batches = [int(b) for b in args.batches.split(",")]

    def engine(model, fuse: bool = False, pack: bool = True, kernel: bool = True, step: bool = True,
               gemv: bool = True, weights: str = "bf16", interleaved: bool = True,
               library_rows: int = 0) -> Engine:  # fmt: skip
        decoder = None
        if fuse:  # as `gpuwise serve` builds it: checked against transformers' at load
            model = copy.deepcopy(model)
            decoder, note = fused_decoder(model, pack=packing("cpu", model.dtype) if pack else None, weights=weights)
            if decoder is None:
                raise SystemExit(f"the fused decoder is not used for this model: {note}")
            if not kernel:  # the decode steps' attention by SDPA, as before serve/engines/gpuwise/attention.py
                decoder.attention, decoder.step = None, None
            if not step:  # each layer's ops from Python, as before the whole-step kernel
                decoder.step = None
            if not gemv:  # and their products by oneDNN or MKL, as before the product kernel
                for x in [y for layer in decoder.layers for y in (layer.qkv, layer.o, layer.gate_up, layer.down)]:
                    x.kernel = None
                decoder.head.kernel = None
            if not interleaved and weights == "bf16":  # the plain weights as stored, not four rows at a time
                for x in [*decoder.linears(), decoder.head]:
                    if x.x4:
                        x.weight.copy_(x.plain())
                        x.x4 = False
                decoder.embed_x4 = False
                decoder.step = decoder._step_pointers()
            if not interleaved and weights != "bf16":  # Q8_0 read as it ships, not four rows at a time
                for x in [*decoder.linears(), decoder.head]:
                    if x.quant is not None and x.quant.fmt.interleaved:
                        x.quant = x.quant.take(slice(None))
                if decoder.embed_q is not None:
                    decoder.embed_q = decoder.head.quant
                decoder.step = decoder._step_pointers()
            if library_rows:  # quantized products of this many rows on go to the library, as before quant_products.py
                for x in [*decoder.linears(), decoder.head]:
                    x._library_rows = lambda dtype, rows=library_rows: rows
        kw = {"max_seqs": max(batches), "kv_budget_tokens": 1 << 20, "max_queue": 1, "context": 2048}
        e = Engine(model, tok, decoder=decoder, **kw)
        e.close()  # its thread stops; the benchmark drives the steps itself
        return e

    fp32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    adapter = None
    if args.lora:  # as a product-lm run: LoRA on every linear layer, B random so that it is not a no-op
        from peft import LoraConfig, get_peft_model

        adapter = "lora"
        config = LoraConfig(r=args.lora, lora_alpha=2 * args.lora, target_modules="all-linear")
        fp32 = get_peft_model(fp32, config, adapter_name=adapter).eval()
        with torch.no_grad():
            for name, p in fp32.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02)
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)

    def packed(model):
        model, kind = copy.deepcopy(model), packing("cpu", model.dtype)
        if kind:
            pack_linears(model, kind)
        return model

    library = attention.load()[0]
    variants = {"fp32": engine(packed(fp32)), "fp32 fused": engine(fp32, fuse=True)}
    variants |= {"fp32 fused unpacked": engine(fp32, fuse=True, pack=False)}
    variants |= {"bf16": engine(packed(bf16)), "bf16 fused": engine(bf16, fuse=True)}
    variants |= {"bf16 fused rows as stored": engine(bf16, fuse=True, interleaved=False)}
    variants |= {"bf16 fused SDPA": engine(bf16, fuse=True, kernel=False)}
    variants |= {"bf16 fused Python step": engine(bf16, fuse=True, step=False)}
    variants |= {"bf16 fused oneDNN products": engine(bf16, fuse=True, step=False, gemv=False)}
    if args.weights and not args.lora:  # `gpuwise serve --weights int8|int4`: the same step on quantized weights
        variants |= {f"bf16 fused {w}": engine(bf16, fuse=True, weights=w) for w in args.weights.split(",")}
        if "int8" in args.weights.split(","):
            variants |= {"bf16 fused int8 as shipped": engine(bf16, fuse=True, weights="int8", interleaved=False)}
        if max(batches) >= LIBRARY_ROWS and library is not None and not library.amx:  # before KERNEL_ROWS
            for w in args.weights.split(","):
                before = engine(bf16, fuse=True, weights=w, library_rows=LIBRARY_ROWS)
                variants |= {f"bf16 fused {w} library from {LIBRARY_ROWS}": before}
    generate = {"fp32 generate": fp32, "bf16 generate": bf16}
    names = list(variants) + list(generate)
    steps: dict[tuple[str, int], list[float]] = {(v, b): [] for v in names for b in batches}
    # the whole-step kernel's calls timed apart from the Python around them (the library is one, shared by every
    # fused variant: each call is put down to the variant running)
    kernel: dict[tuple[str, int], list[float]] = {}
    running: list[tuple[str, int] | None] = [None]
    if library is not None:
        call = library.step_fn

        def timed(*a):
            t = time.perf_counter()
            rc = call(*a)
            if running[0] is not None:
                kernel.setdefault(running[0], []).append(time.perf_counter() - t)
            return rc

        library.step_fn = timed
    reader = WeightRead() if library is not None else None

    def held_bytes(variant: str) -> float:
        """The weight bytes a fused bf16 variant's step reads (the planner's, as llm_serve_load.py counts them)."""
        kind = next((f"gpuwise-{w}" for w in ("int8", "int4") if w in variant.split()), "gpuwise")
        return weight_bytes(kind, model_dir, "bf16")

    sizes = sorted({round(held_bytes(n) / 1e6) for n in variants if n.startswith("bf16 fused")})
    with torch.inference_mode():
        for r in range(args.rounds):
            if reader is not None:  # the bounds the kernel's one-row reads are held to, read between rounds
                for mb in sizes:
                    reader.sample(mb)
            for b in batches:
                for name in names if r % 2 == 0 else names[::-1]:
                    if name in variants:
                        running[0] = (name, b)
                        steps[name, b] += engine_step(variants[name], ids, b, args.steps, adapter)
                        running[0] = None
                    else:
                        steps[name, b].append(generate_step(generate[name], ids, b, args.steps))
            print(f"round {r + 1} of {args.rounds} done", flush=True)
    print(
        f"SmolLM2-135M-Instruct{f' + LoRA r={args.lora}' if args.lora else ''}, one decode step "
        f"({len(ids)}-token prompt), {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}, {args.rounds} rounds interleaved; median ms per step (tokens/s)"
    )
    print(f"{'batch':>5}" + "".join(f"{n:>28}" for n in names))
    for b in batches:
        cells = []
        for n in names:
            ms = statistics.median(steps[n, b]) * 1e3
            cells.append(f"{ms:.1f} ms ({b / ms * 1e3:.0f}/s)")
        print(f"{b:>5}" + "".join(f"{c:>28}" for c in cells))
    if reader is not None:
        for mb in sizes:
            reader.sample(mb)
            print(f"benchmarks/weight_read.cpp on this host over {mb} MB: {reader.median(mb):.1f} GB/s, the median of"
                  f" its readings between rounds ({reader.spread(mb)})")  # fmt: skip
    print(f"packed: fp32 for {packing('cpu', torch.float32)}, bf16 for {packing('cpu', torch.bfloat16)}")
    print(f"decode attention: {attention.load()[1]}")
    for b in batches:
        med = {k: statistics.median(v) for (k, bb), v in steps.items() if bb == b}
        ratio = {d: med[d] / med[f"{d} fused"] for d in ("fp32", "bf16")}
        vs32 = med["fp32 fused"] / med["bf16 fused"]
        pack = med["fp32 fused unpacked"] / med["fp32 fused"]
        kernel_gain = med["bf16 fused SDPA"] / med["bf16 fused"]
        step_gain = med["bf16 fused Python step"] / med["bf16 fused"]
        gemv_gain = med["bf16 fused oneDNN products"] / med["bf16 fused Python step"]
        print(
            f"batch {b}: fused / transformers' forward = {ratio['fp32']:.2f}x in fp32, {ratio['bf16']:.2f}x in bf16;"
            f" fused bf16 / fused fp32 = {vs32:.2f}x; fp32 fused packed / not packed = {pack:.2f}x;"
            f" bf16 fused, decode attention kernel / SDPA = {kernel_gain:.2f}x;"
            f" bf16 fused, whole-step kernel / Python step = {step_gain:.2f}x;"
            f" bf16 Python step, product kernel / oneDNN products = {gemv_gain:.2f}x"
        )
        for w in [n.removeprefix("bf16 fused ") for n in med if n.startswith("bf16 fused int") and "library" not in n]:
            gain = med["bf16 fused"] / med[f"bf16 fused {w}"]
            print(f"batch {b}: bf16 fused, {w} weights / bf16 weights = {gain:.2f}x")
        for n in (n for n in med if n.startswith("bf16 fused") and (n, b) in kernel):
            k = statistics.median(kernel[n, b])
            line = f"batch {b}: {n}: the step kernel's call {k * 1e3:.2f} ms of a {med[n] * 1e3:.2f} ms step"
            if b == 1 and reader is not None:  # at one row the kernel reads every weight once: at what rate
                held = held_bytes(n)
                read = reader.median(round(held / 1e6))
                line += f", {held / 1e6:.0f} MB read at {held / k / 1e9:.1f} GB/s ({held / k / 1e9 / read:.0%} of"
                line += " weight_read's over as many)"
            print(line)
        for w in args.weights.split(",") if args.weights else ():
            before = f"bf16 fused {w} library from {LIBRARY_ROWS}"
            if before in med:
                gain = med[before] / med[f"bf16 fused {w}"]
                print(f"batch {b}: bf16 fused {w}, the kernel to decoder.KERNEL_ROWS / the library from"
                      f" {LIBRARY_ROWS} rows = {gain:.2f}x")  # fmt: skip
        gain = med["bf16 fused rows as stored"] / med["bf16 fused"]
        print(f"batch {b}: bf16 fused, plain weights four rows at a time / as stored = {gain:.2f}x")
        if "bf16 fused int8 as shipped" in med:
            gain = med["bf16 fused int8 as shipped"] / med["bf16 fused int8"]
            print(f"batch {b}: bf16 fused int8, Q8_0 interleaved / as shipped = {gain:.2f}x")


if __name__ == "__main__":
    main()
