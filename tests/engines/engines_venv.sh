#!/usr/bin/env bash
# Make a separate venv at DIR with SkyPilot and kubernetes-validate.
#
#   tests/engines/engines_venv.sh DIR
#
# SkyPilot pins uvicorn<0.36 and click<8.2, so it cannot share the main venv.
# No cloud extras: `skypilot` alone is enough for sky.Task.from_yaml offline
# (it does not pull torch; ~570 MB, mostly pandas/numpy/pulp/sqlalchemy and
# kubernetes-validate's bundled schemas). Idempotent: DIR/.installed marks a
# finished install and makes later runs a no-op. Silent on success; on
# failure prints pip's log and exits non-zero.
source "$(dirname "$0")/venv_common.sh"

"$DIR/bin/python" -m pip install -q --disable-pip-version-check \
    skypilot kubernetes-validate >>"$LOG" 2>&1 || fail "pip install"
"$DIR/bin/python" -c 'import sky, kubernetes_validate' >>"$LOG" 2>&1 \
    || fail "import check"

touch "$DIR/.installed"
