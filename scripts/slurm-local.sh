#!/usr/bin/env bash
# A real Slurm cluster on this machine, for tests: `scripts/slurm-local.sh start DIR` configures
# Debian's slurm-wlm (slurmctld + slurmd) and munge with every file under DIR (config, munge key and
# socket, state, spool, logs, pid files) on free ports, starts the daemons and waits until the node
# takes jobs; `scripts/slurm-local.sh stop DIR` stops them (DIR stays; the caller removes it).
#
# `scripts/slurm-local.sh start DIR N` (N >= 2) makes N nodes n0, n1, ...: each slurmd runs in its own
# network namespace on a bridge (as tests/mpi.rs does for MPI), with its own host name (a UTS
# namespace), its own /dev/shm (a tmpfs in a private mount namespace) and an /etc/hosts that names
# every node; slurmctld and munge stay in this namespace, on the bridge's address. The file system is
# shared, as on a cluster with a shared home. `scripts/slurm-local.sh exec DIR K CMD...` runs CMD in
# node K's namespaces (e.g. `ls /dev/shm`); `stop` also ends whatever still runs in them and removes
# the namespaces and the bridge.
#
# After `start`, `DIR/env` holds the variables a client needs (`. DIR/env`): SLURM_CONF, and nothing
# else. Needs root (slurmd starts job steps as their user) and the packages slurmctld, slurmd,
# slurm-client and munge (`apt-get install slurmctld slurmd slurm-client munge`), and iproute2 for
# several nodes. No cgroups (in a container there are none to delegate): proctrack/linuxproc,
# task/none. Each node claims 8 CPUs or nproc, whichever is more, with
# SlurmdParameters=config_overrides, so a 4-rank job fits on 2 cores.
#
# Exit codes: 0 done, 1 a daemon did not start (its log is printed), 2 usage or missing packages.
set -euo pipefail

usage() {
  echo "usage: $0 start DIR [NODES] | stop DIR | exec DIR NODE CMD..." >&2
  exit 2
}
[ $# -ge 2 ] || usage
cmd=$1
dir=$2
shift 2

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

# Prints the daemons' logs and fails.
die_with_log() {
  echo "slurm-local: $1" >&2
  for f in "$dir"/log/*.log "$dir"/n*/slurmd.log; do
    [ -f "$f" ] && { echo "--- $f (last 30 lines)" >&2; tail -n 30 "$f" >&2; }
  done
  exit 1
}

# The network of an N-node cluster: a bridge holding this namespace's address .1, and per node a
# network namespace whose eth0 has .2, .3, ...; names and subnet come from this script's pid.
# DIR/network records them for `stop`, DIR/hosts names every node for the nodes' /etc/hosts.
make_network() {
  local nodes=$1 i ns
  tag="gbs$(($$ % 100000))"
  net="10.214.$(($$ % 250 + 1))"
  command -v ip >/dev/null || { echo "slurm-local: $nodes nodes need iproute2 (ip)" >&2; exit 2; }
  echo "$tag $net $nodes" >"$dir/network"
  { ip link add "${tag}br" type bridge && ip addr add "$net.1/24" dev "${tag}br" && ip link set "${tag}br" up; } ||
    die_with_log "cannot make the bridge ${tag}br (needs CAP_NET_ADMIN)"
  printf '127.0.0.1 localhost\n%s.1 gbctl\n' "$net" >"$dir/hosts"
  for ((i = 0; i < nodes; i++)); do
    ns="${tag}n$i"
    { ip netns add "$ns" &&
      ip link add "${tag}v$i" type veth peer name eth0 netns "$ns" &&
      ip link set "${tag}v$i" master "${tag}br" up &&
      ip -n "$ns" addr add "$net.$((i + 2))/24" dev eth0 &&
      ip -n "$ns" link set eth0 up &&
      ip -n "$ns" link set lo up; } || die_with_log "cannot make the network namespace $ns"
    printf '%s.%d n%d\n' "$net" $((i + 2)) "$i" >>"$dir/hosts"
  done
}

# Starts node K's slurmd in its namespaces. Its spool, log and pid file are DIR/nK/..., which the
# daemon sees as DIR/node/... (a bind mount private to its mount namespace), so every node reads the
# same slurm.conf.
start_node() {
  local i=$1
  mkdir -p "$dir/n$i/spool" "$dir/n$i/pmix"
  # nsenter, not `ip netns exec`: that remounts /sys for the namespace, which hides /sys/fs/cgroup
  # (slurmd reads it even with task/none).
  nsenter --net="/run/netns/${tag}n$i" unshare --uts --mount --propagation private /bin/sh -c "
    hostname n$i &&
    mount -t tmpfs -o size=1g tmpfs /dev/shm &&
    mount --bind '$dir/n$i' '$dir/node' &&
    mount --bind '$dir/hosts' /etc/hosts &&
    exec slurmd -f '$dir/slurm.conf'" || die_with_log "slurmd of node n$i did not start"
}

start() {
  need_cmds
  [ "$(id -u)" = 0 ] || { echo "slurm-local: needs root (slurmd runs job steps as their user)" >&2; exit 2; }
  local nodes=${1:-1}
  [[ $nodes =~ ^[1-9][0-9]*$ ]] || usage
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  mkdir -p "$dir"/{munge,state,spool,log,run}
  chmod 700 "$dir/munge"

  # munge: a fresh key, a socket and everything else under DIR (a socket in the file system, so the
  # nodes' namespaces reach it too).
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
  # One node: localhost. Several: the namespaces' nodes, with slurmctld on the bridge.
  local ctl=localhost names=localhost
  local node_lines="NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN"
  local slurmd_files="SlurmdSpoolDir=$dir/spool/%n
SlurmdPidFile=$dir/run/slurmd.pid
SlurmdLogFile=$dir/log/slurmd.log"
  if [ "$nodes" -gt 1 ]; then
    make_network "$nodes"
    ctl="localhost($net.1)"
    names="n[0-$((nodes - 1))]"
    node_lines=""
    for ((i = 0; i < nodes; i++)); do
      node_lines+="NodeName=n$i NodeAddr=$net.$((i + 2)) CPUs=$cpus State=UNKNOWN"$'\n'
    done
    mkdir -p "$dir/node"
    # PMIx's client directories are named by job and step only: on a shared /tmp the nodes' would
    # collide, so they go to each node's own DIR/node/.
    echo "PMIxCliTmpDirBase=$dir/node/pmix" >"$dir/mpi.conf"
    slurmd_files="SlurmdSpoolDir=$dir/node/spool
SlurmdPidFile=$dir/node/slurmd.pid
SlurmdLogFile=$dir/node/slurmd.log"
  fi
  cat >"$dir/slurm.conf" <<SLURM_CONF
# Written by scripts/slurm-local.sh: a $nodes-node test cluster, everything under $dir.
ClusterName=gradbus-test
SlurmctldHost=$ctl
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$sock
StateSaveLocation=$dir/state
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmctldLogFile=$dir/log/slurmctld.log
$slurmd_files
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
$node_lines
PartitionName=test Nodes=$names Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
SLURM_CONF
  echo "export SLURM_CONF=$dir/slurm.conf" >"$dir/env"
  export SLURM_CONF="$dir/slurm.conf"
  slurmctld -f "$SLURM_CONF" -i || die_with_log "slurmctld did not start"
  if [ "$nodes" = 1 ]; then
    slurmd -f "$SLURM_CONF" -N localhost || die_with_log "slurmd did not start"
  else
    for ((i = 0; i < nodes; i++)); do start_node "$i"; done
  fi

  # Ready when every node is idle (bounded: 30 s).
  local states=""
  for _ in $(seq 1 150); do
    states=$(sinfo -h -N -o %t 2>/dev/null | sort -u | tr '\n' ' ' || true)
    case "$states" in "idle " | "mix " | "alloc ") return 0 ;; esac
    sleep 0.2
  done
  die_with_log "the nodes did not become idle in 30 s (sinfo says: '${states:-nothing}')"
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
  local tag net nodes i pid
  if [ -f "$dir/network" ]; then
    read -r tag net nodes <"$dir/network"
    for ((i = 0; i < nodes; i++)); do
      stop_pid "$dir/n$i/slurmd.pid"
      # Deleting a namespace does not end its processes: end what is left there (job steps).
      for pid in $(ip netns pids "${tag}n$i" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
      ip netns del "${tag}n$i" 2>/dev/null || true
    done
    ip link del "${tag}br" 2>/dev/null || true
  fi
  stop_pid "$dir/run/slurmctld.pid"
  stop_pid "$dir/run/munged.pid"
}

# Runs a command in node K's namespaces (those of its slurmd).
in_node() {
  [ $# -ge 2 ] || usage
  local pid
  pid=$(cat "$dir/n$1/slurmd.pid" 2>/dev/null) || { echo "slurm-local: no slurmd of node n$1 in $dir" >&2; exit 2; }
  shift
  exec nsenter -t "$pid" -m -u -n -- "$@"
}

case "$cmd" in
  start) start "$@" ;;
  stop) stop ;;
  exec) in_node "$@" ;;
  *) usage ;;
esac
