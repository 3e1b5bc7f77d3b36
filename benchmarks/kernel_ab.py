"""The engine's decode step on two versions of gpuwise's CPU kernel side by side, in one process: the kernel as a git
revision has it (`--ref`, HEAD by default) against the working tree's, each built from its own source, on
SmolLM2-135M-Instruct as `gpuwise serve --weights` runs it. What a change to kernels/decode_attention.cpp is worth,
measured on this host in one run, rounds alternating (this VM's speed moves by tens of per cent within minutes;
one version after the other would read the drift as a difference).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/kernel_ab.py [--ref HEAD] [--weights bf16,int8,int4]
        [--batches 1,8] [--rounds 6] [--front-end-ms 0.4]

--front-end-ms: a thread of the same process wakes every 4 ms and holds a core this long, as a server's event loop
does for each token it sends on: how each version's step holds up beside it.
Per (weights, batch): the median step of each version over all rounds, and the speed-up of the working tree's.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch
from engine_step import engine_step  # beside this script

from gpuwise.serve.engines.gpuwise import attention

KERNEL = "src/gpuwise/serve/engines/gpuwise/kernels/decode_attention.cpp"


def front_end(ms: float) -> None:
    """Every 4 ms, `ms` of Python holding a core (the GIL too, as an event loop's work on a token does)."""
    while True:
        time.sleep(0.004)
        t = time.perf_counter()
        while time.perf_counter() - t < ms / 1e3:
            pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", default="HEAD", help="the git revision whose kernel is the baseline")
    ap.add_argument("--weights", default="bf16,int8,int4")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--front-end-ms", type=float, default=0.0)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from gpuwise.serve.engines.gpuwise.decoder import fused_decoder
    from gpuwise.serve.engines.gpuwise.engine import Engine
    from gpuwise.serve.engines.gpuwise.packed import packing
    from gpuwise.workloads.pretrained import resolve_base

    hf_logging.set_verbosity_error()
    root = Path(__file__).resolve().parent.parent
    shown = subprocess.run(["git", "-C", str(root), "show", f"{args.ref}:{KERNEL}"], capture_output=True, text=True)
    if shown.returncode != 0:
        raise SystemExit(f"no kernel at {args.ref}: {shown.stderr.strip()}")
    work = attention.SOURCE
    if shown.stdout == work.read_text():
        raise SystemExit(f"the working tree's kernel is {args.ref}'s: nothing to compare")
    base = Path(tempfile.mkdtemp(prefix="kernel-ab-")) / "decode_attention.cpp"
    base.write_text(shown.stdout)

    model_dir = resolve_base("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is a GPU good for?"}], add_generation_prompt=True, tokenize=False
    )
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    bf16 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    weights, batches = args.weights.split(","), [int(b) for b in args.batches.split(",")]
    versions = {args.ref: base, "working tree": work}
    engines = {}
    for version, source in versions.items():
        attention.SOURCE = source  # each version's engines hold the kernel built from its source
        attention.load.cache_clear()
        if attention.load()[0] is None:
            raise SystemExit(f"{version}'s kernel does not load: {attention.load()[1]}")
        for w in weights:
            model = copy.deepcopy(bf16)
            decoder, note = fused_decoder(model, pack=packing("cpu", model.dtype), weights=w)
            if decoder is None:
                raise SystemExit(f"the fused decoder is not used: {note}")
            kw = {"max_seqs": max(batches), "kv_budget_tokens": 1 << 16, "max_queue": 1, "context": 2048}
            engines[(version, w)] = e = Engine(model, tok, decoder=decoder, **kw)
            e.close()  # its thread stops; the benchmark drives the steps itself
    attention.SOURCE = work
    if args.front_end_ms:
        threading.Thread(target=front_end, args=(args.front_end_ms,), daemon=True).start()
    times: dict[tuple, list[float]] = {(k, b): [] for k in engines for b in batches}
    for r in range(args.rounds):
        for k in list(engines) if r % 2 == 0 else reversed(list(engines)):
            for b in batches:
                times[(k, b)] += engine_step(engines[k], ids, b, args.steps)
        print(f"round {r + 1} of {args.rounds} done", flush=True)
    noise = f", a front end holding a core {args.front_end_ms} ms every 4 ms" if args.front_end_ms else ""
    print(f"decode step, median ms, {torch.get_num_threads()} threads, {args.rounds} rounds interleaved{noise}")
    for w in weights:
        for b in batches:
            old = statistics.median(times[((args.ref, w), b)])
            new = statistics.median(times[(("working tree", w), b)])
            print(f"{w:5} batch {b:2}: {args.ref} {old * 1e3:6.2f}  working tree {new * 1e3:6.2f}  {old / new:.3f}x")


if __name__ == "__main__":
    main()
