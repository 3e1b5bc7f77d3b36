#!/usr/bin/env bash
# Bring up / tear down Slurm ACCOUNTING (slurmdbd on a private MariaDB) for the one-node
# local test cluster of tests/engines/slurm_local.sh.
#
#   bash tests/engines/slurm_accounting.sh up DIR    # start MariaDB + slurmdbd for DIR; idempotent;
#                                                    # last stdout line:  Include DIR/accounting.conf
#   bash tests/engines/slurm_accounting.sh down DIR  # stop slurmdbd and MariaDB started for DIR
#
# DIR is a directory of its own (not the slurm_local.sh DIR). Needs root (the daemons run as
# root: SlurmUser=root, mariadbd --user=root). Installs mariadb-server + slurmdbd (Debian
# packages; slurmdbd pulls slurm-wlm-mysql-plugin) with apt-get when missing and we are root.
# MUNGE must already be running (slurm_local.sh starts it; this script starts it too if not).
#
# Files written in DIR:
#   mysql/ mysql.sock mysql.pid mysql.err   MariaDB datadir, socket (TCP 127.0.0.1:DB_PORT)
#   db.pass                                 password of the MariaDB user 'slurm' (mode 600)
#   slurmdbd.conf slurmdbd.pid slurmdbd.log slurmdbd (port DBD_PORT). slurmdbd has no -f
#                                           option: it reads dirname($SLURM_CONF)/slurmdbd.conf,
#                                           so it is started with SLURM_CONF=DIR/slurm.conf.
#   slurm.conf       a minimal CLIENT slurm.conf (ClusterName + accounting lines) that lets
#                    sacctmgr/sacct talk to this slurmdbd before any cluster exists.
#   accounting.conf  the lines a cluster's slurm.conf needs to use this slurmdbd:
#                      AccountingStorageType=accounting_storage/slurmdbd
#                      AccountingStorageHost=localhost
#                      AccountingStoragePort=DBD_PORT
#                      AccountingStorageTRES=gres/gpu
#                      JobAcctGatherType=jobacct_gather/linux
#                      JobAcctGatherFrequency=task=5
#   gres-lines.txt   "GresTypes=gpu" and the text to add to the NodeName line: " Gres=gpu:N"
#   gres.conf        "AutoDetect=off" + "Name=gpu File=DIR/fakegpu[0-N-1]": N fake GPUs, so that
#                    --gpus=1 / --gres=gpu:1 are allocated and accounted as gres/gpu on a
#                    CPU-only machine (jobs get CUDA_VISIBLE_DEVICES=0.. as usual). A count-only
#                    "Name=gpu Count=N" does NOT work in Slurm 22.05: slurmd drops file-less GPUs.
#   fakegpu0..N-1    character devices c 1 3 (clones of /dev/null) for gres.conf's File=
#
# How slurm_local.sh uses them (when it wants accounting + fake GPUs):
#   1. run `slurm_accounting.sh up ADIR` BEFORE starting slurmctld: a slurmctld with
#      accounting_storage/slurmdbd and no state files (slurm_local.sh wipes state/ on every
#      start) dies at once if slurmdbd is down ("fatal: You are running with a database but
#      for some reason we have no TRES from it"). `sacctmgr add cluster` is NOT needed:
#      slurmctld registers its ClusterName in the database by itself on its first start
#      (with account root and user root in it).
#   2. in its slurm.conf DROP its own `JobAcctGatherType=jobacct_gather/none` and
#      `AccountingStorageType=accounting_storage/none` lines (with duplicates, the LAST one
#      wins silently), and add
#          Include ADIR/accounting.conf
#          GresTypes=gpu
#          NodeName=$host CPUs=... RealMemory=... Gres=gpu:4 State=UNKNOWN
#   3. copy ADIR/gres.conf next to its slurm.conf (slurmd reads dirname($SLURM_CONF)/gres.conf).
#   4. accounts/users: sacctmgr -i add account team-a team-b
#                      sacctmgr -i add user root account=team-a,team-b
#      Without AccountingStorageEnforce, `sbatch --account=nosuch` is accepted but runs and is
#      recorded under the user's default account (root); AccountingStorageEnforce=associations
#      would reject it instead. Not needed for jobs with existing accounts.
#   MinJobAge=86400 in slurm_local.sh is harmless: sacct reads the database, not slurmctld;
#   a job shows in `sacct -a -X` (State=COMPLETED, End set) right after it ends.
#   Tear down in reverse: slurm_local.sh down, then slurm_accounting.sh down.
#
# Environment knobs (all optional):
#   SLURM_ACCT_DBD_PORT   slurmdbd port                         [default 6819]
#   SLURM_ACCT_DB_PORT    MariaDB TCP port on 127.0.0.1          [default 3307]
#   SLURM_ACCT_GPUS       GPUs per node in gres.conf/gres-lines  [default 4]
#   SLURM_ACCT_CLUSTER    ClusterName in the client DIR/slurm.conf [default gpuwise-local]
#   SLURM_ACCT_WAIT       seconds to wait for MariaDB / slurmdbd [default 60]
set -u

die() { echo "slurm_accounting.sh: $*" >&2; exit 1; }

cmd=${1:-}
dir=${2:-}
[[ $cmd == up || $cmd == down ]] && [[ -n $dir ]] || die "usage: slurm_accounting.sh up|down DIR"
if [[ $cmd == down && ! -d $dir ]]; then exit 0; fi
mkdir -p "$dir" 2>/dev/null || die "cannot create $dir"
dir=$(cd "$dir" && pwd -P) || die "cannot enter $dir"
export PATH=$PATH:/usr/sbin:/sbin

dbd_port=${SLURM_ACCT_DBD_PORT:-6819}
db_port=${SLURM_ACCT_DB_PORT:-3307}
gpus=${SLURM_ACCT_GPUS:-4}
cluster=${SLURM_ACCT_CLUSTER:-gpuwise-local}
wait_s=${SLURM_ACCT_WAIT:-60}
sock=$dir/mysql.sock
client_conf=$dir/slurm.conf

pid_alive() {  # pid_alive FILE NAME -> 0 if FILE holds the pid of a live process called NAME
    local pid
    [[ -s $1 ]] || return 1
    pid=$(<"$1")
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    [[ -r /proc/$pid/comm && $(</proc/$pid/comm) == "$2" ]] || return 1
    # a zombie (nobody reaps it when PID 1 is not an init) is not alive
    [[ $(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) != Z ]]
}

stop_daemon() {  # stop_daemon PIDFILE NAME [WAIT_S]: TERM, wait (default 20 s), then KILL
    local pidf=$1 name=$2 wait=${3:-20} pid i
    pid_alive "$pidf" "$name" || { rm -f "$pidf"; return 0; }
    pid=$(<"$pidf")
    kill -TERM "$pid" 2>/dev/null
    for ((i = 0; i < wait * 10; i++)); do
        pid_alive "$pidf" "$name" || break
        sleep 0.1
    done
    pid_alive "$pidf" "$name" && kill -KILL "$pid" 2>/dev/null
    rm -f "$pidf"
}

port_busy() {  # port_busy PORT -> 0 if something listens on TCP PORT
    command -v ss >/dev/null 2>&1 && ss -Hltn "sport = :$1" 2>/dev/null | grep -q .
}

# mariadbd on Debian 12 (mysqld is a symlink to it; /proc/PID/comm follows the name exec'd).
mysqld_bin=""
for b in mariadbd mysqld; do
    if command -v "$b" >/dev/null 2>&1; then mysqld_bin=$(command -v "$b"); break; fi
done
mysqld_name=$(basename "${mysqld_bin:-mariadbd}")

if [[ $cmd == down ]]; then
    stop_daemon "$dir/slurmdbd.pid" slurmdbd
    # the server runs as mariadbd or mysqld, whichever name it was started under
    for name in "$mysqld_name" mariadbd mysqld; do
        pid_alive "$dir/mysql.pid" "$name" && { stop_daemon "$dir/mysql.pid" "$name" 60; break; }
    done
    rm -f "$dir/mysql.pid"
    exit 0
fi

# ---------------------------------------------------------------- up
[[ $dbd_port =~ ^[0-9]+$ && $db_port =~ ^[0-9]+$ && $gpus =~ ^[1-9][0-9]*$ ]] \
    || die "SLURM_ACCT_DBD_PORT, SLURM_ACCT_DB_PORT must be numbers, SLURM_ACCT_GPUS a number >= 1"
[[ $(id -u) == 0 ]] || die "must run as root (SlurmUser=root, mariadbd --user=root)"

need_pkgs=()
command -v mariadb-install-db >/dev/null 2>&1 && [[ -n $mysqld_bin ]] || need_pkgs+=(mariadb-server)
command -v slurmdbd >/dev/null 2>&1 || need_pkgs+=(slurmdbd)
command -v sacctmgr >/dev/null 2>&1 || need_pkgs+=(slurm-client)
command -v munged >/dev/null 2>&1 || need_pkgs+=(munge)
if ((${#need_pkgs[@]})); then
    command -v apt-get >/dev/null 2>&1 || die "${need_pkgs[*]} not installed and no apt-get to install them"
    # Do not let the packages' postinst start the system-wide mariadb/slurmdbd services.
    made_policy=0
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && made_policy=1
    fi
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_pkgs[@]}"; } \
        >"$dir/apt-install.log" 2>&1
    rc=$?
    ((made_policy)) && rm -f /usr/sbin/policy-rc.d
    ((rc == 0)) || die "apt-get install ${need_pkgs[*]} failed (see $dir/apt-install.log)"
    for b in mariadbd mysqld; do
        if command -v "$b" >/dev/null 2>&1; then mysqld_bin=$(command -v "$b"); break; fi
    done
    mysqld_name=$(basename "$mysqld_bin")
fi
[[ -x /usr/lib/x86_64-linux-gnu/slurm-wlm/accounting_storage_mysql.so ]] \
    || ls /usr/lib/*/slurm*/accounting_storage_mysql.so >/dev/null 2>&1 \
    || echo "slurm_accounting.sh: warning: accounting_storage_mysql.so not found (package slurm-wlm-mysql-plugin)" >&2

# munged (normally already started by slurm_local.sh)
source "$(dirname "${BASH_SOURCE[0]}")/munge_up.sh"
munge_up "$dir"

# A running pair keeps the ports it was started with: refuse other ones.
if [[ -s $dir/slurmdbd.conf ]] && { pid_alive "$dir/slurmdbd.pid" slurmdbd || pid_alive "$dir/mysql.pid" "$mysqld_name"; }; then
    old_dbd=$(sed -n 's/^DbdPort=//p' "$dir/slurmdbd.conf")
    old_db=$(sed -n 's/^StoragePort=//p' "$dir/slurmdbd.conf")
    [[ $old_dbd == "$dbd_port" && $old_db == "$db_port" ]] \
        || die "$dir already runs slurmdbd:$old_dbd / MariaDB:$old_db; run 'down $dir' first to change ports"
fi

# ------------------------------------------------ MariaDB (own datadir, socket, port)
sql() { mariadb --no-defaults --protocol=socket --socket="$sock" -uroot -N -B "$@"; }

if ! pid_alive "$dir/mysql.pid" "$mysqld_name"; then
    port_busy "$db_port" && die "port $db_port already in use (set SLURM_ACCT_DB_PORT)"
    if [[ ! -d $dir/mysql/mysql ]]; then
        rm -rf "$dir/mysql"
        # root@localhost: unix_socket auth (we are OS root); no test db, no name resolution.
        mariadb-install-db --no-defaults --datadir="$dir/mysql" --user=root \
            --auth-root-authentication-method=socket --skip-test-db --skip-name-resolve \
            >"$dir/mysql-install.log" 2>&1 \
            || die "mariadb-install-db failed (see $dir/mysql-install.log)"
    fi
    rm -f "$sock" "$dir/mysql.pid"
    # --no-defaults must come first: ignore /etc/mysql/* (datadir, socket, bind-address).
    setsid nohup "$mysqld_bin" --no-defaults --datadir="$dir/mysql" --socket="$sock" \
        --port="$db_port" --bind-address=127.0.0.1 --skip-networking=0 \
        --pid-file="$dir/mysql.pid" --log-error="$dir/mysql.err" --user=root \
        --skip-log-bin --skip-name-resolve --innodb-buffer-pool-size=128M \
        --innodb-lock-wait-timeout=900 --max-allowed-packet=64M \
        </dev/null >"$dir/mysql.out" 2>&1 &
    for ((i = 0; i < wait_s * 10; i++)); do
        [[ -S $sock ]] && sql -e 'SELECT 1' >/dev/null 2>&1 && break
        kill -0 $! 2>/dev/null || break
        sleep 0.1
    done
    sql -e 'SELECT 1' >/dev/null 2>&1 || die "MariaDB did not start (see $dir/mysql.err)"
    for ((i = 0; i < 50; i++)); do pid_alive "$dir/mysql.pid" "$mysqld_name" && break; sleep 0.1; done
fi

if [[ ! -s $dir/db.pass ]]; then
    (umask 077; head -c 18 /dev/urandom | base64 | tr -d '/+=\n' >"$dir/db.pass")
fi
chmod 600 "$dir/db.pass"
pass=$(<"$dir/db.pass")
sql <<EOF || die "cannot create the MariaDB user slurm (see $dir/mysql.err)"
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$pass';
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
ALTER USER 'slurm'@'localhost' IDENTIFIED BY '$pass';
ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
FLUSH PRIVILEGES;
EOF

# ------------------------------------------------ config files
acct_lines="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$dbd_port
AccountingStorageTRES=gres/gpu
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=task=5"
printf '# Generated by tests/engines/slurm_accounting.sh: Include this from slurm.conf.\n%s\n' \
    "$acct_lines" >"$dir/accounting.conf"
# Fake GPUs: Slurm 22.05 drops a gres/gpu without File= ("Removing file-less GPU from final
# GRES list" -> node INVAL "gres/gpu count reported lower than configured (0 < 4)"), and wants
# File= to be a character/block device: DIR/fakegpuN are clones of /dev/null (c 1 3).
for ((i = 0; i < gpus; i++)); do
    f=$dir/fakegpu$i
    [[ -c $f ]] && continue
    rm -f "$f"
    # without mknod (no CAP_MKNOD) a plain file still counts; slurmd then logs
    # "... is not a valid character or block device" but offers the GPU anyway
    mknod -m 666 "$f" c 1 3 2>/dev/null || : >"$f"
done
if ((gpus == 1)); then files=$dir/fakegpu0; else files="$dir/fakegpu[0-$((gpus - 1))]"; fi
printf 'GresTypes=gpu\n Gres=gpu:%s\n' "$gpus" >"$dir/gres-lines.txt"
printf '# Generated by tests/engines/slurm_accounting.sh: %s fake GPUs on a CPU-only machine.\nAutoDetect=off\nName=gpu File=%s\n' \
    "$gpus" "$files" >"$dir/gres.conf"
# Minimal client slurm.conf: lets sacctmgr/sacct reach slurmdbd (and tells slurmdbd where
# slurmdbd.conf is: dirname($SLURM_CONF)).
cat >"$client_conf" <<EOF
# Generated by tests/engines/slurm_accounting.sh: client-only config for sacctmgr/sacct.
ClusterName=$cluster
SlurmctldHost=$(hostname -s)
AuthType=auth/munge
Include $dir/accounting.conf
EOF

if ! pid_alive "$dir/slurmdbd.pid" slurmdbd; then
    port_busy "$dbd_port" && die "port $dbd_port already in use (another slurmdbd? set SLURM_ACCT_DBD_PORT)"
    (umask 077; cat >"$dir/slurmdbd.conf" <<EOF
# Generated by tests/engines/slurm_accounting.sh
AuthType=auth/munge
DbdHost=localhost
DbdPort=$dbd_port
SlurmUser=root
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$db_port
StorageUser=slurm
StoragePass=$pass
StorageLoc=slurm_acct_db
PidFile=$dir/slurmdbd.pid
LogFile=$dir/slurmdbd.log
EOF
    )
    chown root:root "$dir/slurmdbd.conf"; chmod 600 "$dir/slurmdbd.conf"
    rm -f "$dir/slurmdbd.pid"
    SLURM_CONF=$client_conf slurmdbd </dev/null >"$dir/slurmdbd.out" 2>&1 \
        || die "slurmdbd failed to start (see $dir/slurmdbd.out, $dir/slurmdbd.log)"
fi

ok=0
for ((i = 0; i < wait_s * 4; i++)); do
    if SLURM_CONF=$client_conf timeout 5 sacctmgr -n show cluster >/dev/null 2>&1; then ok=1; break; fi
    pid_alive "$dir/slurmdbd.pid" slurmdbd || { ((i > 8)) && break; }
    sleep 0.25
done
((ok)) || die "slurmdbd does not answer on port $dbd_port (see $dir/slurmdbd.log, $dir/mysql.err)"
echo "slurmdbd up on localhost:$dbd_port (MariaDB 127.0.0.1:$db_port); client config: SLURM_CONF=$client_conf"
echo "Include $dir/accounting.conf"
