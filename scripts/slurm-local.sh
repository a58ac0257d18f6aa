#!/usr/bin/env bash
# A real one-node Slurm cluster on localhost, for tests: `scripts/slurm-local.sh start DIR` configures
# Debian's slurm-wlm (slurmctld + slurmd) and munge with every file under DIR (config, munge key and
# socket, state, spool, logs, pid files) on free ports, starts the daemons and waits until the node
# takes jobs; `scripts/slurm-local.sh stop DIR` stops them (DIR stays; the caller removes it).
#
# After `start`, `DIR/env` holds the variables a client needs (`. DIR/env`): SLURM_CONF, and nothing
# else. Needs root (slurmd starts job steps as their user) and the packages slurmctld, slurmd,
# slurm-client and munge (`apt-get install slurmctld slurmd slurm-client munge`). No cgroups (in a
# container there are none to delegate): proctrack/linuxproc, task/none. The node claims 8 CPUs or
# nproc, whichever is more, with SlurmdParameters=config_overrides, so a 4-rank job fits on 2 cores.
#
# Exit codes: 0 done, 1 a daemon did not start (its log is printed), 2 usage or missing packages.
set -euo pipefail

usage() {
  echo "usage: $0 start|stop DIR" >&2
  exit 2
}
[ $# -eq 2 ] || usage
cmd=$1
dir=$2

need_cmds() {
  local missing=()
  for c in munged slurmctld slurmd sinfo srun sbatch; do
    command -v "$c" >/dev/null 2>&1 || [ -x "/usr/sbin/$c" ] || missing+=("$c")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "slurm-local: missing ${missing[*]} (apt-get install -y slurmctld slurmd slurm-client munge)" >&2
    exit 2
  fi
}

# A TCP port nobody listens on, from a start that differs per caller; bash's /dev/tcp probes it.
free_port() {
  local p=$1
  while (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; do p=$((p + 1)); done
  echo "$p"
}

# Prints a daemon's log and fails.
die_with_log() {
  echo "slurm-local: $1" >&2
  for f in "$dir"/log/*.log; do
    [ -f "$f" ] && { echo "--- $f (last 30 lines)" >&2; tail -n 30 "$f" >&2; }
  done
  exit 1
}

start() {
  need_cmds
  [ "$(id -u)" = 0 ] || { echo "slurm-local: needs root (slurmd runs job steps as their user)" >&2; exit 2; }
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  mkdir -p "$dir"/{munge,state,spool,log,run}
  chmod 700 "$dir/munge"

  # munge: a fresh key, a socket and everything else under DIR.
  export PATH="$PATH:/usr/sbin"
  mungekey --create --keyfile="$dir/munge/munge.key" --force 2>/dev/null ||
    dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
  chmod 400 "$dir/munge/munge.key"
  local sock="$dir/munge/munge.socket"
  munged --force --key-file="$dir/munge/munge.key" --socket="$sock" \
    --pid-file="$dir/run/munged.pid" --log-file="$dir/log/munged.log" \
    --seed-file="$dir/munge/munged.seed" || die_with_log "munged did not start"

  local base=$((20000 + $$ % 20000))
  local ctld_port slurmd_port
  ctld_port=$(free_port "$base")
  slurmd_port=$(free_port $((ctld_port + 1)))
  local cpus
  cpus=$(nproc)
  [ "$cpus" -ge 8 ] || cpus=8
  cat >"$dir/slurm.conf" <<EOF
# Written by scripts/slurm-local.sh: a one-node test cluster, everything under $dir.
ClusterName=gradbus-test
SlurmctldHost=localhost
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$sock
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
# Schedule a batch job at once, not on the next pass (3 s by default).
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=2
# sbatch --wait polls every 2 s while 2 < MinJobAge/2 is false, else every 8 s and more; a finished
# job stays visible to scontrol for these 5 s.
MinJobAge=5
InactiveLimit=0
SlurmdTimeout=60
MailProg=/bin/true
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=test Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
EOF
  echo "export SLURM_CONF=$dir/slurm.conf" >"$dir/env"
  export SLURM_CONF="$dir/slurm.conf"
  slurmctld -f "$SLURM_CONF" -i || die_with_log "slurmctld did not start"
  slurmd -f "$SLURM_CONF" -N localhost || die_with_log "slurmd did not start"

  # Ready when the node is idle (bounded: 30 s).
  local state=""
  for _ in $(seq 1 150); do
    state=$(sinfo -h -n localhost -o %t 2>/dev/null || true)
    case "$state" in idle | mix | alloc) return 0 ;; esac
    sleep 0.2
  done
  die_with_log "the node did not become idle in 30 s (sinfo says: '${state:-nothing}')"
}

# Stops one daemon by its pid file: SIGTERM, then SIGKILL after 5 s.
stop_pid() {
  local f=$1 pid
  [ -f "$f" ] || return 0
  pid=$(cat "$f" 2>/dev/null || true)
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 50); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.1
  done
  kill -KILL "$pid" 2>/dev/null || true
}

stop() {
  [ -d "$dir" ] || return 0
  stop_pid "$dir/run/slurmd.pid"
  stop_pid "$dir/run/slurmctld.pid"
  stop_pid "$dir/run/munged.pid"
}

case "$cmd" in
  start) start ;;
  stop) stop ;;
  *) usage ;;
esac
