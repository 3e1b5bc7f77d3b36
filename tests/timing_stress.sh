#!/usr/bin/env bash
# The test files whose checks involve time, run N times under each of three conditions (issue #47):
#   as-is      the host as it is
#   omp1       OMP_NUM_THREADS=1: the engines' threads limited, so generation is slower
#   neighbour  a busy neighbour: one `yes > /dev/null` per run, for its whole duration
# A test that passes only at some speed fails under one of them. Prints one line per run and a table.
#
#   tests/timing_stress.sh [-n N] [-c CONDITIONS] [-k EXPR] [FILE ...]
#   (default: N=5, -c as-is,omp1,neighbour, the files below)
#
# Needs the set-up `make test` does (.venv), and `make vllm` and `make llama.cpp` for test_llm_api's engines.
set -uo pipefail
cd "$(dirname "$0")/.."
N=5
K=()
CONDITIONS=(as-is omp1 neighbour)
while getopts "n:c:k:" opt; do
  case $opt in
    n) N=$OPTARG ;;
    c) IFS=, read -r -a CONDITIONS <<<"$OPTARG" ;;
    k) K=(-k "$OPTARG") ;;
    *) echo "usage: $0 [-n N] [-c as-is,omp1,neighbour] [-k EXPR] [FILE ...]" >&2; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
for condition in "${CONDITIONS[@]}"; do
  case $condition in
    as-is | omp1 | neighbour) ;;
    *) echo "unknown condition '$condition': choose from as-is, omp1, neighbour" >&2; exit 2 ;;
  esac
done
FILES=("$@")
if [ ${#FILES[@]} -eq 0 ]; then
  FILES=(tests/test_serve.py tests/test_llm_api.py tests/test_web_origin.py tests/test_ui.py
         tests/test_pretrained.py tests/test_engine.py tests/test_planner.py tests/test_kernel_gguf_untrusted.py
         tests/test_calibrated_time.py)
fi
PY=.venv/bin/python
[ -x "$PY" ] || { echo "no .venv: run make test (or make .venv/.installed) first" >&2; exit 2; }
LOGS=$(mktemp -d /tmp/gpuwise-timing.XXXXXX)
echo "host: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores; logs in $LOGS"

declare -A PASSED FAILED
for condition in "${CONDITIONS[@]}"; do
  PASSED[$condition]=0
  FAILED[$condition]=0
  for i in $(seq 1 "$N"); do
    log=$LOGS/$condition-$i.log
    hog=
    env=()
    case $condition in
      omp1) env=(OMP_NUM_THREADS=1) ;;
      neighbour) yes >/dev/null & hog=$! ;;
    esac
    start=$(date +%s)
    env "${env[@]}" "$PY" -m pytest -q -p no:cacheprovider "${K[@]}" "${FILES[@]}" >"$log" 2>&1
    rc=$?
    [ -n "$hog" ] && kill "$hog"
    summary=$(grep -E '^[=]* ?[0-9]+ (passed|failed)|^[=]* ?[0-9]+ failed' "$log" | tail -1 | tr -d '=' | xargs)
    printf '%-10s run %d  %4ds  rc %d  %s\n' "$condition" "$i" $(($(date +%s) - start)) "$rc" "$summary"
    grep -E '^FAILED' "$log" | sed 's/^/    /'
    if [ "$rc" -eq 0 ]; then PASSED[$condition]=$((PASSED[$condition] + 1)); else FAILED[$condition]=$((FAILED[$condition] + 1)); fi
  done
done
echo
echo "| condition | runs passed | runs failed |"
echo "|---|---|---|"
for condition in "${CONDITIONS[@]}"; do
  echo "| $condition | ${PASSED[$condition]} of $N | ${FAILED[$condition]} |"
done
