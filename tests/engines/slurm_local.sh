#!/usr/bin/env bash
# Bring up / tear down a REAL one-node Slurm cluster on this machine, for tests.
#
#   bash tests/engines/slurm_local.sh up DIR    # start munged (if needed), slurmctld, slurmd;
#                                               # wait until the node is idle; last stdout line:
#                                               #   export SLURM_CONF=DIR/slurm.conf
#   bash tests/engines/slurm_local.sh down DIR  # stop slurmctld/slurmd started for DIR (munged stays)
#
# Needs root (the daemons run as root: SlurmUser=root). Installs slurm-wlm + munge with
# apt-get when they are missing and we are root. Everything else lives in DIR:
# slurm.conf, state/, spool/, slurmctld.{pid,log}, slurmd.{pid,log}.
#
# Environment knobs (all optional):
#   SLURM_LOCAL_CRED_EXPIRE  seconds a requeued job is held before it may start again
#                            (AuthInfo=cred_expire; Slurm default 120, min 5) [default 10]
#   SLURM_LOCAL_CTLD_PORT / SLURM_LOCAL_SLURMD_PORT                [default 6817 / 6818]
#   SLURM_LOCAL_WAIT         seconds to wait for the node to become idle          [default 60]
#   SLURM_LOCAL_ACCT_DIR     accounting (slurmdbd on MariaDB) and 4 stand-in GPUs (gres) from
#                            tests/engines/slurm_accounting.sh up DIR, started first [none]
set -u

die() { echo "slurm_local.sh: $*" >&2; exit 1; }

cmd=${1:-}
dir=${2:-}
[[ $cmd == up || $cmd == down ]] && [[ -n $dir ]] || die "usage: slurm_local.sh up|down DIR"
if [[ $cmd == down && ! -d $dir ]]; then exit 0; fi
mkdir -p "$dir" 2>/dev/null || die "cannot create $dir"
dir=$(cd "$dir" && pwd -P) || die "cannot enter $dir"
conf=$dir/slurm.conf
wait_s=${SLURM_LOCAL_WAIT:-60}

pid_alive() {  # pid_alive FILE NAME -> 0 if FILE holds the pid of a live process called NAME
    local pid
    [[ -s $1 ]] || return 1
    pid=$(<"$1")
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    [[ -r /proc/$pid/comm && $(</proc/$pid/comm) == "$2" ]] || return 1
    # a zombie (nobody reaps it when PID 1 is not an init) is not alive
    [[ $(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) != Z ]]
}

stop_daemon() {  # stop_daemon NAME: TERM, wait up to 10 s, then KILL
    local pidf=$dir/$1.pid pid i
    pid_alive "$pidf" "$1" || { rm -f "$pidf"; return 0; }
    pid=$(<"$pidf")
    kill -TERM "$pid" 2>/dev/null
    for ((i = 0; i < 100; i++)); do
        pid_alive "$pidf" "$1" || break
        sleep 0.1
    done
    pid_alive "$pidf" "$1" && kill -KILL "$pid" 2>/dev/null
    rm -f "$pidf"
}

if [[ $cmd == down ]]; then
    # slurmd first so it does not keep retrying a dead controller; stray job steps of
    # this cluster (slurmstepd) are killed by slurmd on shutdown only if jobs are done,
    # so cancel everything while the controller is still up.
    if pid_alive "$dir/slurmctld.pid" slurmctld && [[ -f $conf ]]; then
        SLURM_CONF=$conf timeout 10 scancel --full --quiet --user=root >/dev/null 2>&1 || true
        sleep 1
    fi
    stop_daemon slurmd
    stop_daemon slurmctld
    exit 0
fi

# ---------------------------------------------------------------- up
need_install=0
for b in munged slurmctld slurmd sinfo sbatch; do
    command -v "$b" >/dev/null 2>&1 || [[ -x /usr/sbin/$b ]] || need_install=1
done
if ((need_install)); then
    [[ $(id -u) == 0 ]] || die "slurm-wlm/munge not installed and not root: cannot apt-get install them"
    command -v apt-get >/dev/null 2>&1 || die "slurm-wlm/munge not installed and no apt-get to install them"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge; } \
        >"$dir/apt-install.log" 2>&1 || die "apt-get install slurm-wlm munge failed (see $dir/apt-install.log)"
fi
export PATH=$PATH:/usr/sbin:/sbin
[[ $(id -u) == 0 ]] || die "must run as root (SlurmUser=root)"

# munged: start it unless a working one answers already.
source "$(dirname "${BASH_SOURCE[0]}")/munge_up.sh"
munge_up "$dir"

host=$(hostname -s)
export SLURM_CONF=$conf

if ! pid_alive "$dir/slurmctld.pid" slurmctld || ! pid_alive "$dir/slurmd.pid" slurmd; then
    # (Re)start from a clean slate: stop whatever half is left, clear state and spool.
    stop_daemon slurmd
    stop_daemon slurmctld
    rm -rf "$dir/state" "$dir/spool"
    mkdir -p "$dir/state" "$dir/spool" || die "cannot create $dir/state"

    ctld_port=${SLURM_LOCAL_CTLD_PORT:-6817}
    slurmd_port=${SLURM_LOCAL_SLURMD_PORT:-6818}
    for p in "$ctld_port" "$slurmd_port"; do
        if command -v ss >/dev/null 2>&1 && ss -Hltn "sport = :$p" 2>/dev/null | grep -q .; then
            die "port $p already in use (another Slurm cluster up? run 'down' for it, or set SLURM_LOCAL_CTLD_PORT/SLURM_LOCAL_SLURMD_PORT)"
        fi
    done

    # Slurm rejects cred_expire < 5 ("AuthInfo=cred_expire=3 invalid") and silently uses 120.
    cred_expire=${SLURM_LOCAL_CRED_EXPIRE:-10}
    [[ $cred_expire =~ ^[0-9]+$ ]] && ((cred_expire >= 5)) || cred_expire=5

    cpus=$(nproc)
    # RealMemory must not exceed what slurmd detects, else the node is drained ("Low RealMemory").
    mem=$(slurmd -C 2>/dev/null | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')
    [[ $mem =~ ^[0-9]+$ ]] || mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 ))
    mem=$(( mem * 9 / 10 ))

    # Accounting (slurmdbd) + fake GPUs from tests/engines/slurm_accounting.sh up ACCT_DIR
    acct_dir=${SLURM_LOCAL_ACCT_DIR:-}
    if [[ -n $acct_dir ]]; then
        [[ -s $acct_dir/accounting.conf && -s $acct_dir/gres.conf && -s $acct_dir/gres-lines.txt ]] \
            || die "SLURM_LOCAL_ACCT_DIR=$acct_dir: run slurm_accounting.sh up there first"
        acct_block="Include $acct_dir/accounting.conf"
        gres_types=$(sed -n 1p "$acct_dir/gres-lines.txt")
        node_gres=$(sed -n 2p "$acct_dir/gres-lines.txt")
        cp "$acct_dir/gres.conf" "$dir/gres.conf"
    else
        acct_block="JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none"
        gres_types=""
        node_gres=""
        rm -f "$dir/gres.conf"
    fi
    cat >"$conf" <<EOF
# Generated by tests/engines/slurm_local.sh: one-node local test cluster.
ClusterName=gpuwise-local
SlurmctldHost=$host
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
AuthType=auth/munge
CredType=cred/munge
# A requeued job stays PENDING (Reason=BeginTime) for cred_expire s (Slurm default 120, min 5).
AuthInfo=cred_expire=$cred_expire
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
$acct_block
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=1
ReturnToService=2
JobRequeue=1
EnforcePartLimits=ALL
# Keep finished jobs visible to squeue/scontrol for a day (no accounting storage here).
MinJobAge=86400
KillWait=10
InactiveLimit=0
Waittime=0
SlurmctldTimeout=30
SlurmdTimeout=60
$gres_types
NodeName=$host CPUs=$cpus RealMemory=$mem$node_gres State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF

    slurmctld -f "$conf" >"$dir/slurmctld.out" 2>&1 || die "slurmctld failed to start (see $dir/slurmctld.log)"
    slurmd -f "$conf" >"$dir/slurmd.out" 2>&1 || die "slurmd failed to start (see $dir/slurmd.log)"
fi

state=""
for ((i = 0; i < wait_s * 2; i++)); do
    state=$(timeout 5 sinfo -h -N -n "$host" -o %T 2>/dev/null | head -1)
    [[ $state == idle ]] && break
    # a freshly started node that is still "down"/"unknown" gets nudged once it has registered
    if [[ $state == down* && $((i % 10)) == 9 ]]; then
        scontrol update NodeName="$host" State=RESUME >/dev/null 2>&1 || true
    fi
    sleep 0.5
done
[[ $state == idle ]] || die "node $host not idle after ${wait_s}s (state '${state:-no answer}'; see $dir/slurmctld.log, $dir/slurmd.log)"
echo "export SLURM_CONF=$conf"
