#!/usr/bin/env bash
# Start a throw-away single-node Slurm cluster (munged, slurmctld, slurmd) in one directory.
#
#   scripts/slurm/start.sh DIR [CPUS]   # then: source DIR/env.sh; sbatch ...; scripts/slurm/stop.sh DIR
#
# Everything lives under DIR: slurm.conf, the munge key and socket, state and spool directories,
# logs (DIR/log) and pid files (DIR/run); no system file is used or changed, so several clusters
# can coexist with each other and with a real Slurm installation (free ports are picked).
# The node offers the machine's CPUs (or CPUS, which may exceed them: tests that oversubscribe a
# small machine) and ~80 % of its memory in one partition, `debug`.
#
# DIR/env.sh sets SLURM_CONF and puts scripts/slurm/bin (an `sacct` stand-in: there is no
# accounting daemon) first on PATH; source it in the shell that submits jobs.
#
# Needs slurmctld, slurmd, the Slurm client commands and munged (Debian: slurmctld slurmd
# slurm-client munge). Runs as the calling user; the job processes run as that user too.
# Exit status 0 once the node is idle and accepts jobs; otherwise 1, with the logs' tails on
# stderr and every daemon already started stopped again.
set -euo pipefail

die() { echo "slurm/start: $*" >&2; exit 1; }
[[ $# -ge 1 && $# -le 2 ]] || die "usage: $0 DIR [CPUS]"
CPUS=${2:-}
[[ -z $CPUS || $CPUS =~ ^[1-9][0-9]*$ ]] || die "CPUS must be a positive integer: $CPUS"
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p "$1"
DIR=$(cd "$1" && pwd)

export PATH="$PATH:/usr/sbin:/sbin"
for cmd in munged slurmctld slurmd sbatch srun scontrol sinfo squeue scancel; do
    command -v "$cmd" >/dev/null 2>&1 || die "missing: $cmd (Debian: slurmctld slurmd slurm-client munge)"
done

mkdir -p "$DIR"/{etc,state,spool,log,run,munge}
chmod 711 "$DIR/munge"
USER_NAME=$(id -un)
HOST=$(hostname -s)
NODE=localhost  # the node's name in Slurm: job node lists (and torch.distributed's master address) resolve anywhere

# A free TCP port from a random start, not one of the arguments (/dev/tcp connects if one listens).
free_port() {
    local p=$((20000 + RANDOM % 20000))
    while (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null || [[ " $* " == *" $p "* ]]; do
        p=$((p + 1))
    done
    echo "$p"
}
CTLD_PORT=$(free_port)
SLURMD_PORT=$(free_port "$CTLD_PORT")
KEY="$DIR/munge/munge.key"
SOCKET="$DIR/munge/munge.socket"

# --- slurm.conf: the node line from `slurmd -C`, ~80 % of the memory ---------------------------
NODE_LINE=$(slurmd -C | head -n 1)
[[ $NODE_LINE == NodeName=* ]] || die "slurmd -C printed no node line: $NODE_LINE"
MEM_MB=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$NODE_LINE")
MEM_MB=$(( ${MEM_MB:-1024} * 8 / 10 ))
NODE_LINE=$(sed -e "s/^NodeName=[^ ]*/NodeName=$NODE/" -e "s/RealMemory=[0-9]*/RealMemory=$MEM_MB/" \
    <<<"$NODE_LINE")
OVERRIDES=""
if [[ -n $CPUS ]]; then  # declared, not detected: slurmd must trust the configuration
    NODE_LINE="NodeName=$NODE CPUs=$CPUS RealMemory=$MEM_MB"
    OVERRIDES="SlurmdParameters=config_overrides"
fi

CONF="$DIR/etc/slurm.conf"
cat >"$CONF" <<EOF
# A single-node test cluster written by scripts/slurm/start.sh.
ClusterName=readback
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=$USER_NAME
SlurmdUser=$USER_NAME
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$SOCKET
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig=$DIR/etc/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MailProg=/bin/true
# finished jobs stay visible to scontrol (the sacct stand-in reads their state from it)
MinJobAge=86400
ReturnToService=2
InactiveLimit=0
KillWait=5
SlurmctldTimeout=30
SlurmdTimeout=30
MessageTimeout=10
$OVERRIDES
$NODE_LINE NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
: >"$DIR/etc/plugstack.conf"

cat >"$DIR/env.sh" <<EOF
export SLURM_CONF=$CONF
export PATH=$HERE/bin:\$PATH:/usr/sbin:/sbin
EOF
export SLURM_CONF="$CONF"
export PATH="$HERE/bin:$PATH"

# On failure: the logs' tails on stderr, and whatever started is stopped again.
fail() {
    echo "slurm/start: $*" >&2
    for log in "$DIR"/log/*.log; do
        echo "--- $log" >&2
        tail -n 20 "$log" >&2 || true
    done
    bash "$HERE/stop.sh" "$DIR" >&2 || true
    exit 1
}

# --- munge: a private daemon, key and socket ------------------------------------------------
if [[ ! -s $KEY ]]; then
    if command -v mungekey >/dev/null 2>&1; then
        mungekey --create --keyfile="$KEY" --force >/dev/null
    else
        dd if=/dev/urandom of="$KEY" bs=1 count=1024 status=none
    fi
fi
chmod 600 "$KEY"
munged --force --socket="$SOCKET" --key-file="$KEY" --pid-file="$DIR/run/munged.pid" \
    --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed" \
    || fail "munged did not start"

# --- slurm daemons ---------------------------------------------------------------------------
wait_pidfile() {  # NAME: wait (5 s) for DIR/run/NAME.pid and a live process
    local _
    for _ in $(seq 50); do
        if [[ -s $DIR/run/$1.pid ]] && kill -0 "$(cat "$DIR/run/$1.pid")" 2>/dev/null; then return 0; fi
        sleep 0.1
    done
    return 1
}
slurmctld -c -f "$CONF" || fail "slurmctld did not start"
wait_pidfile slurmctld || fail "slurmctld exited"
slurmd -N "$NODE" -f "$CONF" || fail "slurmd did not start"
wait_pidfile slurmd || fail "slurmd exited"

# Ready when the node is idle (30 s at most).
for _ in $(seq 150); do
    state=$(timeout 5 sinfo -h -n "$NODE" -o %T 2>/dev/null || true)
    if [[ $state == idle ]]; then
        echo "slurm/start: node $NODE idle (partition debug, ctld port $CTLD_PORT); source $DIR/env.sh"
        exit 0
    fi
    sleep 0.2
done
fail "node $NODE not idle after 30 s (state: ${state:-none})"
