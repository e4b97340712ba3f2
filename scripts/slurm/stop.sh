#!/usr/bin/env bash
# Stop a cluster started by scripts/slurm/start.sh DIR: cancel its jobs, then end slurmd,
# slurmctld and munged by the PIDs in DIR/run. Safe to call twice or on a half-started cluster.
#
#   scripts/slurm/stop.sh DIR
#
# Client commands against a dead controller stall for many seconds, so jobs are cancelled only
# while slurmctld's process is alive. DIR itself is left in place (logs); remove it afterwards.
set -uo pipefail

[[ $# -eq 1 ]] || { echo "usage: $0 DIR" >&2; exit 2; }
DIR=$1
[[ -d $DIR ]] || exit 0
export PATH="$PATH:/usr/sbin:/sbin"
export SLURM_CONF="$DIR/etc/slurm.conf"

pid_of() {  # NAME -> the live PID from DIR/run/NAME.pid, or nothing
    local pid
    pid=$(cat "$DIR/run/$1.pid" 2>/dev/null) || return 1
    [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}

stop_pid() {  # NAME: SIGTERM, wait up to 10 s, then SIGKILL
    local pid _
    pid=$(pid_of "$1") || return 0
    kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 100); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.1
    done
    echo "slurm/stop: $1 ($pid) ignored SIGTERM; killing it" >&2
    kill -KILL "$pid" 2>/dev/null
}

if [[ -f $SLURM_CONF ]] && pid_of slurmctld >/dev/null && pid_of slurmd >/dev/null; then
    # Cancel every job and wait (15 s) until none is left, so that no job step outlives slurmd.
    timeout 10 scancel --full --user="$(id -un)" 2>/dev/null
    for _ in $(seq 75); do
        # finished jobs stay listed (MinJobAge): only unfinished ones count
        left=$(timeout 5 squeue -h -t PENDING,RUNNING,COMPLETING,CONFIGURING,SUSPENDED -o %i 2>/dev/null) || break
        [[ -z $left ]] && break
        sleep 0.2
    done
fi

stop_pid slurmd
stop_pid slurmctld
stop_pid munged
exit 0
