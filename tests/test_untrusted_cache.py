"""What gpuwise runs or writes where others may reach it (issue #50, item 11; items 1's citations).

A llama-server in gpuwise's cache that another user could have put there (a folder or file others can write, or
one another user owns) is refused in one line before anything of it runs: its planted program would write a
marker file. Whatever the umask (000 on some shared machines), what gpuwise writes is writable by no one else,
and its cache folder is made 0700. The docs, the README and the code cite the project's own files, never a
folder outside the repository."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpuwise.bench.serving import free_port
from gpuwise.cli import main
from gpuwise.errors import GpuwiseError
from gpuwise.serve.engines.llamacpp import check_own_build, find_llama_server

GPUWISE = Path(sys.executable).with_name("gpuwise")
ROOT = Path(__file__).resolve().parent.parent


def build(where: Path, marker: Path) -> Path:
    """A build folder as `make llama.cpp` leaves it, whose llama-server is a program that leaves `marker`."""
    (where / "bin").mkdir(parents=True)
    (where / "convert").mkdir()
    server = where / "bin" / "llama-server"
    server.write_text(f"#!/bin/sh\ntouch {marker}\necho 'version: 1 (planted)'\n")
    server.chmod(0o755)
    (where / "convert" / "convert_hf_to_gguf.py").write_text("")
    for path in (where, where / "bin", where / "convert"):
        path.chmod(0o755)
    return server


def test_a_build_of_this_users_own_is_found(tmp_path, monkeypatch):
    server = build(tmp_path / "llama.cpp", tmp_path / "ran")
    monkeypatch.setenv("GPUWISE_LLAMA_CPP", str(tmp_path / "llama.cpp"))
    monkeypatch.delenv("GPUWISE_LLAMA_SERVER", raising=False)
    assert find_llama_server(None) == (server, "make llama.cpp")


@pytest.mark.parametrize("how", ["folder-0777", "file-0666", "another-user", "symlink-out"])
def test_a_build_others_could_have_replaced_is_refused_in_one_line_and_nothing_of_it_runs(tmp_path, how):
    root, marker = tmp_path / "llama.cpp", tmp_path / "ran"
    server = build(root, marker)
    if how == "folder-0777":
        (root / "bin").chmod(0o777)
        why = "bin is writable by others (mode 777)"
    elif how == "file-0666":
        (root / "convert" / "convert_hf_to_gguf.py").chmod(0o666)
        why = "convert_hf_to_gguf.py is writable by others (mode 666)"
    elif how == "another-user":
        if os.geteuid() != 0:
            pytest.skip("making a file another user's needs root")
        os.chown(server, 4321, 4321)
        why = "llama-server is owned by uid 4321"
    else:
        (tmp_path / "elsewhere.so").write_text("")
        (root / "bin" / "libggml.so").symlink_to(tmp_path / "elsewhere.so")
        why = f"libggml.so is a symlink out of {root}"
    with pytest.raises(GpuwiseError, match=re.escape(why)):
        check_own_build(root)
    if not GPUWISE.exists():
        return
    env = {**os.environ, "GPUWISE_LLAMA_CPP": str(root)}
    env.pop("GPUWISE_LLAMA_SERVER", None)
    port = str(free_port())
    done = subprocess.run([str(GPUWISE), "serve", "smollm2-135m-instruct", "--engine", "llama.cpp", "--port", port],
                          capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and why in done.stderr and "--llama-server" in done.stderr, done.stderr
    assert not marker.exists(), "the planted llama-server ran"


def test_what_gpuwise_writes_is_writable_by_no_one_else_whatever_the_umask(tmp_path, monkeypatch, capsys):
    old = os.umask(0)
    try:
        assert main(["--version"]) == 0
        assert os.umask(0) & 0o022 == 0o022  # main() tightened it
        os.umask(0)
        monkeypatch.setenv("GPUWISE_CACHE", str(tmp_path / "cache"))
        from gpuwise.workloads.pretrained import cache_root

        assert (cache_root().stat().st_mode & 0o777) == 0o700
    finally:
        os.umask(old)


def test_the_build_script_builds_under_its_own_umask_and_owner():
    """`make llama.cpp` copies the sdist's files: as root, `cp -a` and tar kept their packager's uid (1001), which
    check_own_build then refuses."""
    script = (ROOT / "tests" / "engines" / "llamacpp_build.sh").read_text()
    assert "umask 022" in script and "--no-same-owner" in script and "cp -a" not in script


def test_no_citation_points_outside_the_repository(capsys):
    """The reference folder the team shares is not in a clone: docs and output cite the project's own files."""
    texts = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "src").rglob("*.py")]
    found = [f"{p.relative_to(ROOT)}:{i}" for p in texts for i, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"(\.\./)?shared/(reference|docs)", line)]  # fmt: skip
    assert not found, found
    assert main(["hardware"]) == 0
    assert "shared" not in capsys.readouterr().out
