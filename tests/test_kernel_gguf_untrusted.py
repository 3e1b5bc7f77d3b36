"""Files gpuwise loads or reads that someone else may have made (issue #33, classes 5 and 6).

The decode-attention kernel's cache: a library planted under the name gpuwise would look for is never loaded
(its constructor would write a marker file), the kernel is rebuilt instead; a cache directory others can write,
or one that is a symlink or another user's, is not used; a kernel whose self-check at load, or whose call during
a decode, fails leaves the decoder on SDPA with one log line, and the tokens are transformers' own.

GGUF headers (plan/model.py's reader): arrays nested 1,000 deep, counts and string lengths far past the file's
end, a sparse file of 10 GB declaring gigabytes, a file cut mid-header and one that shrinks while it is read
each get one line, at once, from the function, from `gpuwise plan --model FILE`, from the UI's plan API (a 400)
and, for the first, from `gpuwise serve FILE` before transformers reads it."""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gpuwise.errors import GpuwiseError
from gpuwise.plan import gguf as plan_gguf
from gpuwise.plan.model import read_gguf_header
from gpuwise.serve.engines.gpuwise import attention
from gpuwise.serve.engines.gpuwise import decoder as fused

needs_kernel = pytest.mark.skipif(
    bool(attention.unavailable()) or shutil.which("gcc") is None,
    reason=f"no kernel here ({attention.unavailable() or 'ok'}), or no gcc for the planted library",
)
GPUWISE = Path(sys.executable).with_name("gpuwise")

# A library whose constructor runs at dlopen, before any of its functions is called: loading it at all is what
# the cache must prevent. It writes the file GPUWISE_TEST_MARKER names.
PLANTED = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
  const char *path = getenv("GPUWISE_TEST_MARKER");
  FILE *f = path ? fopen(path, "w") : NULL;
  if (f) { fputs("the planted library ran\n", f); fclose(f); }
}
int gpuwise_decode_attention(void) { return 0; }
"""


# --- the kernel's cache ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def built() -> Path:
    """The real kernel's cache (the session's: built once, ~3 s, if test_decode_attention has not already)."""
    attention.load.cache_clear()
    kernel, why = attention.load()
    assert kernel is not None, why
    attention.load.cache_clear()
    return attention._cache_dir()


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> bytes:
    where = tmp_path_factory.mktemp("planted")
    (where / "planted.c").write_text(PLANTED)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(where / "planted.so"), str(where / "planted.c")], check=True)
    return (where / "planted.so").read_bytes()


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """attention.load() run again, with its cache under tmp_path and the planted library's marker armed."""
    monkeypatch.setenv("GPUWISE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("GPUWISE_TEST_MARKER", str(tmp_path / "marker"))
    attention.load.cache_clear()
    yield tmp_path / "cache" / "kernels"
    attention.load.cache_clear()


def pair(cache: Path) -> tuple[str, str, str]:
    """(key, digest, library file name) of the build recorded in `cache`."""
    (record,) = cache.glob("decode_attention-*.sha256")
    key = record.name[len("decode_attention-") : -len(".sha256")]
    digest = record.read_text().strip()
    return key, digest, f"decode_attention-{key}-{digest[:16]}.so"


def copy_cache(src: Path, dst: Path, mode: int = 0o700) -> None:
    dst.mkdir(parents=True)
    for f in src.glob("decode_attention-*"):
        shutil.copyfile(f, dst / f.name)
        (dst / f.name).chmod(0o600)
    dst.chmod(mode)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "gpuwise.serve" and r.levelno >= logging.WARNING]


def stub_build(monkeypatch, built: Path) -> list[Path]:
    """Rebuilds answered with the real kernel's bytes (the compile itself is tested once, above): the calls."""
    data = (built / pair(built)[2]).read_bytes()
    calls: list[Path] = []

    def build(compiler, where):
        calls.append(where)
        return data, ""

    monkeypatch.setattr(attention, "_build", build)
    return calls


@needs_kernel
def test_the_planted_library_runs_its_constructor_when_loaded(planted, tmp_path):
    # what the tests below look for: dlopen of the planted library alone writes the marker
    (tmp_path / "planted.so").write_bytes(planted)
    env = os.environ | {"GPUWISE_TEST_MARKER": str(tmp_path / "marker")}
    code = "import ctypes, sys; ctypes.CDLL(sys.argv[1])"
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "planted.so")], env=env, check=True)
    assert (tmp_path / "marker").exists()


@needs_kernel
def test_a_library_planted_in_the_cache_is_never_loaded_and_the_kernel_is_rebuilt(built, planted, fresh, caplog):
    copy_cache(built, fresh)
    key, digest, name = pair(fresh)
    # the planted library in place of the recorded one, and under the name older gpuwise loaded unchecked
    for target in (fresh / name, fresh / f"decode_attention-{key}.so"):
        target.write_bytes(planted)
        target.chmod(0o600)
    with caplog.at_level(logging.WARNING, logger="gpuwise.serve"):
        kernel, why = attention.load()
    assert not (fresh.parent.parent / "marker").exists()
    assert kernel is not None and "built" in why, why
    (line,) = warnings_of(caplog)
    assert f"{name} does not match the SHA-256 recorded when it was built; rebuilt it" in line
    _, new_digest, new_name = pair(fresh)  # the record now names the rebuilt library, and it is that one
    rebuilt = hashlib.sha256((fresh / new_name).read_bytes()).hexdigest()
    assert rebuilt == new_digest != hashlib.sha256(planted).hexdigest()
    assert (fresh / new_name).stat().st_mode & 0o777 == 0o600 and fresh.stat().st_mode & 0o777 == 0o700
    attention.load.cache_clear()
    caplog.clear()
    again, why = attention.load()  # the rebuilt one is found, checked and loaded, without a word
    assert again is not None and "cached" in why and not warnings_of(caplog)


def forged(cache: Path, planted: bytes, key: str) -> None:
    """The planted library with a record that matches it: only the directory's own checks can refuse it."""
    digest = hashlib.sha256(planted).hexdigest()
    for name, data in ((f"decode_attention-{key}-{digest[:16]}.so", planted), (f"decode_attention-{key}.sha256",
                                                                                 f"{digest}\n".encode())):
        (cache / name).write_bytes(data)
        (cache / name).chmod(0o600)


@needs_kernel
@pytest.mark.parametrize("how", ["mode-0777", "symlink", "another-user"])
def test_a_cache_directory_that_is_not_private_is_not_used(built, planted, fresh, caplog, monkeypatch, how):
    key = pair(built)[0]
    if how == "symlink":
        elsewhere = fresh.parent / "elsewhere"
        elsewhere.mkdir(parents=True, mode=0o700)
        forged(elsewhere, planted, key)
        fresh.symlink_to(elsewhere)
        expected = "is a symlink"
    else:
        fresh.mkdir(parents=True, mode=0o700)
        forged(fresh, planted, key)
        if how == "mode-0777":
            fresh.chmod(0o777)
            expected = "is writable by others (mode 777)"
        else:
            if os.geteuid() != 0:
                pytest.skip("making a directory another user's takes root")
            os.chown(fresh, 65534, 65534)
            expected = "is owned by uid 65534, not this user"
    before = sorted(p.name for p in fresh.iterdir())
    builds = stub_build(monkeypatch, built)
    with caplog.at_level(logging.WARNING, logger="gpuwise.serve"):
        kernel, why = attention.load()
    assert not (fresh.parent.parent / "marker").exists()
    assert kernel is not None and "built" in why, why
    (line,) = warnings_of(caplog)
    assert expected in line and line.endswith("built a private one"), line
    assert len(builds) == 1 and fresh not in builds[0].parents and builds[0] != fresh  # built elsewhere, privately
    assert sorted(p.name for p in fresh.iterdir()) == before  # nothing written into it


@needs_kernel
@pytest.mark.parametrize("how", ["mode-0666", "another-user"])
def test_a_recorded_library_others_could_write_is_rebuilt(built, fresh, caplog, monkeypatch, how):
    copy_cache(built, fresh)
    name = pair(fresh)[2]
    if how == "mode-0666":
        (fresh / name).chmod(0o666)
        expected = f"{name} has mode 666, not 600"
    else:
        if os.geteuid() != 0:
            pytest.skip("making a file another user's takes root")
        os.chown(fresh / name, 65534, 65534)
        expected = f"{name} is owned by uid 65534, not this user"
    builds = stub_build(monkeypatch, built)
    with caplog.at_level(logging.WARNING, logger="gpuwise.serve"):
        kernel, why = attention.load()
    assert kernel is not None and "built" in why and builds == [fresh]
    (line,) = warnings_of(caplog)
    assert expected in line and line.endswith("rebuilt it"), line
    assert (fresh / name).stat().st_mode & 0o777 == 0o600 and (fresh / name).stat().st_uid == os.geteuid()


@needs_kernel
def test_a_cache_of_this_users_that_others_may_read_is_made_private_and_used(built, fresh, caplog):
    copy_cache(built, fresh, mode=0o755)  # as gpuwise before this check made it
    with caplog.at_level(logging.WARNING, logger="gpuwise.serve"):
        kernel, why = attention.load()
    assert kernel is not None and "cached" in why and not warnings_of(caplog)
    assert fresh.stat().st_mode & 0o777 == 0o700


def greedy(decoder, model, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens through the fused decoder over the engine's cache: a prefill, then one-token decode steps
    (where the decode kernel is used), as the engine runs them."""
    from gpuwise.serve.engines.gpuwise.kvcache import PagedCache, additive_mask

    n, total = len(prompt), len(prompt) + steps
    cache = PagedCache.for_rows(model.config, 1, torch.float32, "cpu", context=total)
    pos = torch.arange(n).unsqueeze(0)
    cache.bind(cache.row_table, pos, n)
    out = []
    with torch.inference_mode():
        logits = decoder(torch.tensor([prompt]), pos, additive_mask(pos.view(1, 1, n, 1) >= pos.view(1, 1, 1, n),
                                                                    torch.float32), cache)
        for p in range(n, total):
            out.append(int(logits[0].argmax()))
            at = torch.tensor([[p]])
            cache.bind(cache.row_table, at, p + 1)
            logits = decoder(torch.tensor([[out[-1]]]), at, additive_mask(torch.ones(1, 1, 1, p + 1, dtype=torch.bool),
                                                                          torch.float32), cache)
    return out


PROMPT = [5, 17, 101, 44, 9, 250, 3]


@pytest.fixture
def llama():
    """A tiny Llama (head dim 16, grouped queries: one the kernel takes) and transformers' greedy answer."""
    from test_decoder import tiny

    model = tiny("llama")
    reference = copy.deepcopy(model)
    with torch.inference_mode():
        ids = torch.tensor([PROMPT])
        expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                      pad_token_id=0)[0, len(PROMPT):].tolist()
    return model, expected


@needs_kernel
def test_a_kernel_that_fails_its_self_check_leaves_sdpa_and_the_same_tokens(built, fresh, caplog, monkeypatch, llama):
    copy_cache(built, fresh)
    # a kernel that loads and answers, but wrongly (what a miscompiled or mismatched build would do)
    monkeypatch.setattr(attention.DecodeAttention, "__call__", lambda self, q, k, v, lens: torch.zeros_like(q))
    with caplog.at_level(logging.WARNING, logger="gpuwise.serve"):
        kernel, why = attention.load()
        model, expected = llama
        decoder, note = fused.fused_decoder(model, pack=None)
    assert kernel is None and why.startswith("its self-check against SDPA failed (torch.float32: 1.0e+00 off"), why
    (line,) = warnings_of(caplog)
    assert "self-check against SDPA failed" in line and line.endswith("serving with SDPA")
    assert decoder is not None and decoder.attention is None and "decode attention: SDPA (its self-check" in note
    assert greedy(decoder, model, PROMPT, 12) == expected


@needs_kernel
def test_a_kernel_that_fails_a_call_hands_the_decoder_to_sdpa(built, fresh, caplog, monkeypatch, llama):
    copy_cache(built, fresh)
    kernel, why = attention.load()
    assert kernel is not None, why
    real, calls, failing = attention.DecodeAttention.__call__, [], [True]

    def shape_check(self, q, keys, values, lens, table=None):  # the kernel's own refusal: a head dim it does not take
        calls.append(q.shape)
        if failing[0]:
            raise ValueError(f"decode attention: the kernel does not take H={q.shape[1]}, K=2, D={q.shape[2]}")
        return real(self, q, keys, values, lens, table)

    monkeypatch.setattr(attention.DecodeAttention, "__call__", shape_check)
    # the attention kernel's own refusal: the whole-step kernel, which calls it from C++, is kept out of the way
    monkeypatch.setattr(fused.FusedDecoder, "_step_pointers", lambda self: None)
    model, expected = llama
    # at load: fused_decoder's own check runs a decode step, which used to end `serve` here
    with caplog.at_level(logging.WARNING, logger="gpuwise.serve"):
        decoder, note = fused.fused_decoder(copy.deepcopy(model), pack=None)
    assert calls and decoder is not None and decoder.attention is None, note
    assert "decode attention: SDPA (the kernel failed: decode attention: the kernel does not take H=4" in note
    (line,) = warnings_of(caplog)
    assert line.startswith("the decode attention kernel failed (") and line.endswith("serving with SDPA")
    assert greedy(decoder, model, PROMPT, 12) == expected
    # at the first real call: it passed at load, then refuses during a decode
    failing[0] = False
    decoder, note = fused.fused_decoder(model, pack=None)
    assert decoder is not None and decoder.attention is kernel, note
    failing[0], calls[:] = True, []
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gpuwise.serve"):
        assert greedy(decoder, model, PROMPT, 12) == expected
    assert len(calls) == 1 and decoder.attention is None and "the kernel failed" in decoder.why
    assert len(warnings_of(caplog)) == 1


# --- GGUF headers ---------------------------------------------------------------------------------------------


def _head(kv_count: int, tensor_count: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, tensor_count, kv_count)


def _str(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def _pad(data: bytes, size: int = 1024) -> bytes:
    return data + bytes(size - len(data))


ARRAY, STRING, UINT8 = struct.pack("<I", 9), struct.pack("<I", 8), struct.pack("<I", 0)
TEN_GB = 10 * 10**9


def _bad_files(tmp: Path) -> dict[str, tuple[Path, str]]:
    """Crafted GGUF files: name -> (file, what its one line says)."""
    from test_open_models import _tiny_gguf

    files = {
        # metadata "a": an array of one array of one array ... 1,000 deep, of no bytes
        "nested-1000-deep": (
            _head(1) + _str(b"a") + ARRAY + (ARRAY + struct.pack("<Q", 1)) * 1000 + UINT8 + struct.pack("<Q", 0),
            "GGUF arrays nested more than 4 deep",
        ),
        "2^40-bytes-in-1-KB": (
            _pad(_head(1) + _str(b"a") + ARRAY + UINT8 + struct.pack("<Q", 2**40)),
            "truncated or damaged GGUF file (an array of 1,099,511,627,776 values at byte 49, where 975 bytes remain)",
        ),
        "2^40-strings-in-1-KB": (
            _pad(_head(1) + _str(b"tokenizer.ggml.tokens") + ARRAY + STRING + struct.pack("<Q", 2**40)),
            "truncated or damaged GGUF file (an array of 1,099,511,627,776 strings",
        ),
        "string-of-2^63-bytes": (
            _pad(_head(1) + struct.pack("<Q", 2**63)),
            "truncated or damaged GGUF file (a key of 9,223,372,036,854,775,808 bytes at byte 32",
        ),
        "2^60-entries": (_pad(_head(2**60)), "(1,152,921,504,606,846,976 metadata entries at byte 24"),
        "tensor-of-2^31-dims": (
            _pad(_head(0, 1) + _str(b"w") + struct.pack("<I", 2**31)),
            "GGUF tensor 'w' has 2,147,483,648 dimensions (at most 4)",
        ),
        "type-99": (_pad(_head(1) + _str(b"a") + struct.pack("<I", 99)), "unknown GGUF value type 99"),
    }
    out = {}
    for name, (data, says) in files.items():
        (tmp / f"{name}.gguf").write_bytes(data)
        out[name] = (tmp / f"{name}.gguf", says)
    # 10 GB, all but the header a hole: a string value of 9 GB, then 10^9 strings of a token list
    for name, tail in (("sparse-9-GB-string", STRING + struct.pack("<Q", 9 * 10**9)),
                       ("sparse-10^9-strings", ARRAY + STRING + struct.pack("<Q", 10**9))):
        path = tmp / f"{name}.gguf"
        path.write_bytes(_head(1) + _str(b"tokenizer.ggml.tokens") + tail)
        os.truncate(path, TEN_GB)
        out[name] = (path, "GGUF header too large: ")
    whole = _tiny_gguf(tmp / "whole.gguf").read_bytes()
    (tmp / "cut-mid-header.gguf").write_bytes(whole[:1500])
    out["cut-mid-header"] = (tmp / "cut-mid-header.gguf", "truncated or damaged GGUF file (")
    return out


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    return _bad_files(tmp_path_factory.mktemp("bad-gguf"))


BAD = ["nested-1000-deep", "2^40-bytes-in-1-KB", "2^40-strings-in-1-KB", "string-of-2^63-bytes", "2^60-entries",
       "tensor-of-2^31-dims", "type-99", "sparse-9-GB-string", "sparse-10^9-strings", "cut-mid-header"]


@pytest.mark.parametrize("name", BAD)
def test_a_bad_gguf_header_is_one_line_at_once(bad_files, name, monkeypatch):
    path, says = bad_files[name]
    real_read, read = os.read, []
    monkeypatch.setattr(os, "read", lambda fd, n: read.append(len(data := real_read(fd, n))) or data)
    started = time.perf_counter()
    with pytest.raises(GpuwiseError) as e:
        read_gguf_header(path)
    took = time.perf_counter() - started
    message = str(e.value)
    assert says in message and message.startswith(str(path)) and "\n" not in message, message
    # Nothing read in proportion to what the file declares (counted: the sparse files declare gigabytes), and
    # nothing looped over: a loop over 2^60 entries or 2^31 dims would run for hours on any host, while what
    # is there is read in about a millisecond. 0.5 s is for a slow or busy host, not a speed.
    assert sum(read) <= 2 << 20, sum(read)
    assert took < 0.5, took


def test_the_sparse_files_are_really_ten_gigabytes_of_holes(bad_files):
    for name in ("sparse-9-GB-string", "sparse-10^9-strings"):
        info = bad_files[name][0].stat()
        assert info.st_size == TEN_GB and info.st_blocks * 512 < 1 << 20


@pytest.mark.skipif(not GPUWISE.exists(), reason="the gpuwise console script is not installed beside python")
def test_gpuwise_plan_gives_each_bad_gguf_one_line(bad_files):
    for name in BAD:
        path, says = bad_files[name]
        done = subprocess.run([str(GPUWISE), "plan", "--model", str(path)], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 2, (name, done.stderr)
        assert done.stderr.startswith("gpuwise: error: ") and done.stderr.count("\n") == 1, (name, done.stderr)
        assert says in done.stderr and not done.stdout, (name, done.stderr)


def test_the_ui_plan_api_gives_each_bad_gguf_a_400(bad_files, tmp_path):
    from fastapi.testclient import TestClient

    from gpuwise.ui.app import create_app

    with TestClient(create_app(runs_dir=tmp_path), base_url="http://127.0.0.1") as client:
        for name in BAD:
            path, says = bad_files[name]
            r = client.get("/api/plan", params={"model": str(path), "task": "inference", "gpu": "l4"})
            assert r.status_code == 400, (name, r.status_code, r.text)
            assert says in r.json()["error"] and r.json()["field"] == "model", (name, r.json())


@pytest.mark.skipif(not GPUWISE.exists(), reason="the gpuwise console script is not installed beside python")
def test_gpuwise_serve_refuses_a_bad_gguf_header_before_transformers_reads_it(bad_files):
    path, says = bad_files["nested-1000-deep"]  # gguf's own reader recurses on it (a RecursionError)
    done = subprocess.run([str(GPUWISE), "serve", str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("gpuwise: error: ") and done.stderr.count("\n") == 1, done.stderr
    assert says in done.stderr


def test_a_gguf_file_that_shrinks_while_it_is_read_is_one_line(tmp_path, monkeypatch):
    from test_open_models import _tiny_gguf

    path = _tiny_gguf(tmp_path / "shrinks.gguf")  # a header of 3 KB
    assert read_gguf_header(path)[0]["general.architecture"] == "qwen2"  # whole, it reads
    monkeypatch.setattr(plan_gguf, "_GGUF_PIECE", 256)  # several reads for this small header
    real_read, reads = os.read, []

    def read(fd, n):
        data = real_read(fd, n)
        reads.append(len(data))
        if len(reads) == 1:  # another process cuts the file after the first read
            os.truncate(path, 300)
        return data

    monkeypatch.setattr(os, "read", read)
    with pytest.raises(GpuwiseError) as e:
        read_gguf_header(path)
    # a memory map of it would have been a SIGBUS here, the process killed
    assert str(e.value) == f"{path}: truncated GGUF file (it ended at byte 300 while its header was read)"
    assert reads[:3] == [256, 44, 0]


def test_a_fifo_named_gguf_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    started = time.perf_counter()
    with pytest.raises(GpuwiseError, match="not a regular file"):
        read_gguf_header(fifo)
    assert time.perf_counter() - started < 1  # one stat; an open() that waited for a writer would wait for ever
