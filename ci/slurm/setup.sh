#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, so tests/slurm can submit real jobs.
#
# Run as root on Debian (CI images, the dev VM): installs slurm-wlm and munge when missing, then
# brings up munged, slurmctld and slurmd for this host with a partition "debug", and waits until
# the node is idle. Safe to run again: every step first checks whether it is already done, and
# the daemons are restarted only when the configuration they run with changed.
#
#   sudo bash ci/slurm/setup.sh && python -m pytest -q tests/slurm
set -euo pipefail

log() { echo "setup.sh: $*"; }
# Not `sbatch --version`: it fails until slurm.conf exists.
slurm_version() { dpkg-query -W -f='slurm-wlm ${Version}' slurm-wlm 2>/dev/null || slurmd -V; }
die() { echo "setup.sh: error: $*" >&2; exit 1; }

[[ $(id -u) -eq 0 ]] || die "run as root (it installs packages and starts daemons as root)"

started=$SECONDS
host=$(hostname -s)
conf_dir=/etc/slurm
conf=$conf_dir/slurm.conf
log_dir=/var/log/slurm
ctld_pidfile=/run/slurmctld.pid
slurmd_pidfile=/run/slurmd.pid

# --- packages --------------------------------------------------------------------------------
if command -v sbatch >/dev/null && command -v slurmctld >/dev/null \
    && command -v slurmd >/dev/null && command -v munged >/dev/null; then
    log "slurm and munge already installed ($(slurm_version))"
else
    log "installing slurm-wlm and munge with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    # Package scripts would try to start the daemons through init scripts, before the key and
    # configuration below exist; a policy-rc.d answering 101 ("forbidden") stops that, and this
    # script starts them itself once they can work.
    policy=/usr/sbin/policy-rc.d
    own_policy=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy"
        chmod 755 "$policy"
        own_policy=1
    fi
    apt-get update -q
    apt-get install -y -q --no-install-recommends slurm-wlm munge
    [[ $own_policy -eq 0 ]] || rm -f "$policy"
    log "installed $(slurm_version)"
fi

# --- host name -------------------------------------------------------------------------------
# slurmctld and slurmd find each other by this name, and tandem.init() uses the first host of
# SLURM_JOB_NODELIST as the rendezvous address: it has to resolve.
if getent hosts "$host" >/dev/null; then
    log "host name $host resolves to $(getent hosts "$host" | awk '{print $1; exit}')"
else
    echo "127.0.0.1 $host" >>/etc/hosts
    log "host name $host did not resolve: added '127.0.0.1 $host' to /etc/hosts"
fi

# --- munge -----------------------------------------------------------------------------------
# munged refuses to start unless its key and directories belong to the munge user and nobody
# else can read the key.
install -d -o munge -g munge -m 0700 /etc/munge /var/log/munge
install -d -o munge -g munge -m 0711 /var/lib/munge
install -d -o munge -g munge -m 0755 /run/munge
key=/etc/munge/munge.key
if [[ -s $key ]]; then
    log "munge key $key exists"
else
    if command -v mungekey >/dev/null; then
        mungekey --create --keyfile="$key" --force
    else
        dd if=/dev/urandom of="$key" bs=1 count=1024 status=none
    fi
    log "created munge key $key"
fi
chown munge:munge "$key"
chmod 0400 "$key"

if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    log "munged already running"
else
    # A munged killed uncleanly leaves its socket and pid file behind, which a new munged takes
    # for a live one; --force starts it anyway.
    runuser -u munge -- munged --force
    for _ in $(seq 50); do
        munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break
        sleep 0.1
    done
    munge -n | unmunge >/dev/null || die "munged does not answer; see /var/log/munge/munged.log"
    log "started munged"
fi

# --- slurm.conf ------------------------------------------------------------------------------
cpus=$(nproc)
mem_total_mb=$(awk '/^MemTotal:/ {print int($2 / 1024)}' /proc/meminfo)
# slurmd drains a node that reports less memory than configured, and it measures slightly less
# than MemTotal: claim 90%.
real_memory=$((mem_total_mb * 9 / 10))
install -d -m 0755 "$conf_dir" "$log_dir" /var/spool/slurmctld /var/spool/slurmd
new_conf=$(mktemp)
trap 'rm -f "$new_conf"' EXIT
cat >"$new_conf" <<EOF
# Written by tandem's ci/slurm/setup.sh: a one-node cluster for tests. Rerun it to refresh.
ClusterName=tandem-ci
SlurmctldHost=$host
AuthType=auth/munge
CredType=cred/munge
# A requeued job may start again only after the credential lifetime, 120 s by default; 5 s
# keeps the requeue test quick, and is plenty for a step to launch on this one host.
AuthInfo=cred_expire=5
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=$ctld_pidfile
SlurmdPidFile=$slurmd_pidfile
SlurmctldLogFile=$log_dir/slurmctld.log
SlurmdLogFile=$log_dir/slurmd.log
# No cgroups: linuxproc tracks a job's processes through /proc, which works in containers and
# VMs whose cgroup tree slurmd may not own.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
# Look at pending jobs every 2 s, not every 60 (30 for backfill): a requeued test job then starts
# as soon as it may. Cheap with one node and a handful of jobs.
SchedulerParameters=sched_interval=2,bf_interval=2
# Cores are the consumable, not memory: a job without --mem then does not take the whole
# node's memory and block the next test's job.
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# A node that was DOWN (say, slurmd restarted) returns to service once it registers with a
# valid configuration.
ReturnToService=2
SlurmdTimeout=300
InactiveLimit=0
KillWait=10
MinJobAge=300
NodeName=$host CPUs=$cpus RealMemory=$real_memory State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
conf_changed=0
if [[ -f $conf ]] && cmp -s "$new_conf" "$conf"; then
    log "$conf is up to date (node $host, CPUs=$cpus, RealMemory=$real_memory MB)"
else
    install -m 0644 "$new_conf" "$conf"
    conf_changed=1
    log "wrote $conf (node $host, CPUs=$cpus, RealMemory=$real_memory MB)"
fi

# --- daemons ---------------------------------------------------------------------------------
# A pid file outlives its daemon across a reboot (or a machine restored from a snapshot), and
# its pid may by then belong to another process (a kernel worker, say): alive only if that pid
# runs the daemon named.
alive() {  # pidfile name
    [[ -s $1 ]] || return 1
    local pid comm
    pid=$(cat "$1")
    comm=$(cat "/proc/$pid/comm" 2>/dev/null) || return 1
    [[ $comm == "$2" ]]
}

stop() {  # pidfile name
    alive "$1" "$2" || return 0
    local pid
    pid=$(cat "$1")
    kill "$pid"
    for _ in $(seq 100); do
        kill -0 "$pid" 2>/dev/null || { log "stopped $2 (pid $pid)"; return 0; }
        sleep 0.1
    done
    die "$2 (pid $pid) did not stop within 10 s"
}

if [[ $conf_changed -eq 1 ]]; then
    # slurmd learns its node's definition only at start: a changed file needs a restart.
    stop "$slurmd_pidfile" slurmd
    stop "$ctld_pidfile" slurmctld
fi
if alive "$ctld_pidfile" slurmctld; then
    log "slurmctld already running (pid $(cat "$ctld_pidfile"))"
else
    slurmctld
    log "started slurmctld"
fi
if alive "$slurmd_pidfile" slurmd; then
    log "slurmd already running (pid $(cat "$slurmd_pidfile"))"
else
    slurmd
    log "started slurmd"
fi

# --- wait for the node -----------------------------------------------------------------------
show_logs() {
    for f in "$log_dir/slurmctld.log" "$log_dir/slurmd.log" /var/log/munge/munged.log; do
        echo "----- last lines of $f" >&2
        tail -n 40 "$f" >&2 2>/dev/null || echo "(missing)" >&2
    done
}

resumed=0
state=""
deadline=$((SECONDS + 60))
while ((SECONDS < deadline)); do
    state=$(sinfo --noheader --nodes="$host" --format=%T 2>/dev/null | head -n 1 || true)
    case $state in
        idle | mixed | allocated | completing)
            log "node $host is $state in partition debug; ready after $((SECONDS - started)) s"
            exit 0
            ;;
        drained | draining | down)
            # A drain left over from an earlier configuration (too much memory, say) outlives
            # the fix in slurmctld's saved state; resume once and see whether it holds.
            if [[ $resumed -eq 0 ]]; then
                reason=$(sinfo --noheader --nodes="$host" --format=%E 2>/dev/null || true)
                log "node $host is $state (reason: ${reason:-none}); resuming it"
                scontrol update NodeName="$host" State=RESUME || true
                resumed=1
            fi
            ;;
    esac
    sleep 1
done
echo "setup.sh: error: node $host not idle after 60 s (sinfo state: '${state:-no answer}')" >&2
show_logs
exit 1
