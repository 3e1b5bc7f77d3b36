#!/usr/bin/env bash
# Bring up / tear down a REAL PostgreSQL server of its own in DIR, on loopback, for tests.
#
#   bash tests/engines/postgres_local.sh up DIR PORT    # initdb (first time), start, create database gpuwise;
#                                                       # last stdout line: the URL, with no password in it
#   bash tests/engines/postgres_local.sh down DIR       # stop it (the data stays in DIR until DIR goes)
#
# The password is in DIR/pgpass (0600), as libpq reads it: tests point PGPASSFILE at it, as a team would.
# Debian's postgresql (apt-get install postgresql, done here when missing and we are root). initdb refuses
# to run as root: as root the server runs as the postgres user, so DIR must be one it can reach (the test
# makes it under /tmp, mode 0755).
set -euo pipefail

die() { echo "postgres_local.sh: $*" >&2; exit 1; }
cmd=${1:-}; dir=${2:-}
[[ ($cmd == up && $# -eq 3) || ($cmd == down && $# -eq 2) ]] || die "usage: postgres_local.sh up DIR PORT | down DIR"

bindir=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1 || true)
if [[ -z $bindir && $cmd == up ]]; then
    [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null || die "PostgreSQL is not installed (apt-get install postgresql)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null) \
        || die "apt-get install postgresql failed"
    bindir=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
fi
as_owner() { if [[ $(id -u) == 0 ]]; then runuser -u postgres -- "$@"; else "$@"; fi; }

data=$dir/data
if [[ $cmd == down ]]; then
    [[ -d $data ]] && as_owner "$bindir/pg_ctl" -D "$data" -m fast -w stop >/dev/null 2>&1 || true
    exit 0
fi
port=$3
mkdir -p "$dir"
chmod 0755 "$dir"
if [[ ! -f $data/PG_VERSION ]]; then
    pw=$(head -c 18 /dev/urandom | base64 | tr -d '/+=')
    printf '%s\n' "$pw" >"$dir/pw.init"
    [[ $(id -u) == 0 ]] && chown postgres "$dir" "$dir/pw.init"
    as_owner "$bindir/initdb" -D "$data" -U gpuwise --auth=scram-sha-256 --pwfile="$dir/pw.init" >"$dir/initdb.log" 2>&1 \
        || { cat "$dir/initdb.log" >&2; die "initdb failed"; }
    rm -f "$dir/pw.init"
    printf '127.0.0.1:%s:*:gpuwise:%s\n' "$port" "$pw" >"$dir/pgpass"
    chmod 0600 "$dir/pgpass"
fi
as_owner "$bindir/pg_ctl" -D "$data" -l "$dir/server.log" -w -t 60 \
    -o "-p $port -k $dir -c listen_addresses=127.0.0.1 -c max_connections=200 -c fsync=off" start >/dev/null \
    || { tail -20 "$dir/server.log" >&2; die "the server did not start"; }
export PGPASSFILE=$dir/pgpass
if ! "$bindir/psql" -h 127.0.0.1 -p "$port" -U gpuwise -d postgres -Atc "SELECT 1 FROM pg_database WHERE datname='gpuwise'" | grep -q 1; then
    "$bindir/createdb" -h 127.0.0.1 -p "$port" -U gpuwise gpuwise || die "createdb failed"
fi
echo "postgresql://gpuwise@127.0.0.1:$port/gpuwise"
