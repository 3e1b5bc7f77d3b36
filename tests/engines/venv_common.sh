# Sourced by the *_venv.sh scripts (`source venv_common.sh`): DIR from their one argument, nothing to do
# when DIR/.installed marks a finished install, a pip log in $LOG, `fail WHAT` (prints that log and exits
# 1), and the venv made at DIR. The script then installs into it and touches DIR/.installed.
set -euo pipefail

if [ "$#" -ne 1 ]; then
    echo "usage: $0 DIR" >&2
    exit 2
fi
DIR=$1
PY=${PYTHON:-python3}

if [ -f "$DIR/.installed" ]; then
    exit 0
fi

LOG=$(mktemp)
trap 'rm -f "$LOG"' EXIT

fail() {
    echo "$(basename "$0"): $1 failed; pip log:" >&2
    cat "$LOG" >&2
    exit 1
}

"$PY" -m venv "$DIR" >"$LOG" 2>&1 || fail "venv creation"
