# Sourced by slurm_local.sh and slurm_accounting.sh: `munge_up DIR` starts munged (Slurm's authentication)
# unless a working one answers already, making its key on first use; its output goes to DIR/munged.out.
munge_up() {
    local dir=$1 i
    munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return 0
    if [[ ! -s /etc/munge/munge.key ]]; then
        if command -v mungekey >/dev/null 2>&1; then
            mungekey --create --keyfile=/etc/munge/munge.key >/dev/null 2>&1
        else
            dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 2>/dev/null
        fi
        chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key
    fi
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/log/munge /var/lib/munge
    if command -v runuser >/dev/null 2>&1; then
        runuser -u munge -- munged >"$dir/munged.out" 2>&1
    else
        su -s /bin/sh munge -c munged >"$dir/munged.out" 2>&1
    fi
    for ((i = 0; i < 50; i++)); do
        munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    die "munged did not start (see $dir/munged.out, /var/log/munge/munged.log)"
}
