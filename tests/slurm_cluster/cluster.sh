#!/usr/bin/env bash
# Local, single-host, *real* SLURM cluster for chexflow's tests and CI.
#
#   tests/slurm_cluster/cluster.sh start    # install (if needed) + start; idempotent
#   tests/slurm_cluster/cluster.sh status   # daemons, pids, sinfo
#   tests/slurm_cluster/cluster.sh env      # eval "$(tests/slurm_cluster/cluster.sh env)"
#   tests/slurm_cluster/cluster.sh stop     # stop all daemons (by their pid files)
#
# What it runs (all as root, no systemd needed, Debian/Ubuntu packages):
#   munged (as user munge, private key + socket), mariadbd (as user mysql, private datadir,
#   TCP on 127.0.0.1 only), slurmdbd (accounting => `sacct` works, which the snakemake
#   SLURM executor uses for job status and --slurm-efficiency-report), slurmctld, and
#   N x `slurmd -N nodeK` on this one host (each its own Port, spool dir and TmpFS).
#   Every node advertises Gres=gpu:2 backed by symlinks to /dev/null, so SLURM schedules
#   GPUs and sets CUDA_VISIBLE_DEVICES per task although the machine has no GPU.
#   Partitions: `cpu` (default) and `gpu`, both over all nodes.
#
# All state (configs, logs, pid files, spool, database) lives under one directory:
#   CHEXFLOW_SLURM_DIR   (default /tmp/chexflow-slurm)
# Client configuration: the config is written to $CHEXFLOW_SLURM_DIR/etc/slurm.conf and
#   /etc/slurm/slurm.conf (the default path every SLURM client reads) is made a symlink to
#   it, unless that path belongs to something else (a real file, or a symlink to another
#   live config) -- it is then left alone with a warning.  `cluster.sh env` always prints
#   `export SLURM_CONF=...` too, but that alone is NOT enough for the snakemake executor:
#   its in-job helper (slurm-jobstep) deletes all SLURM_* variables, SLURM_CONF included,
#   before running the rule's srun, which then reads /etc/slurm/slurm.conf.
#
# Tunables (environment):
#   CHEXFLOW_SLURM_NODES (3)  CHEXFLOW_SLURM_CPUS (2 per node, oversubscribes the host)
#   CHEXFLOW_SLURM_MEM_MB (8000 per node)  CHEXFLOW_SLURM_GPUS (2 fake GPUs per node)
#   CHEXFLOW_SLURM_PORT_BASE (16800: mariadb +6, slurmctld +17, slurmdbd +19, slurmd +20+k)
#   CHEXFLOW_SLURM_START_TIMEOUT (90 s)   CHEXFLOW_SLURM_ACCOUNTING (1; 0 = no slurmdbd,
#     then there is no usable sacct and the executor must use --slurm-status-command=squeue)
#   CHEXFLOW_SLURM_ACCOUNT (chexflow: SLURM account created for root in the accounting DB)
set -euo pipefail

DIR=${CHEXFLOW_SLURM_DIR:-/tmp/chexflow-slurm}
NODES=${CHEXFLOW_SLURM_NODES:-3}
CPUS=${CHEXFLOW_SLURM_CPUS:-2}
MEM_MB=${CHEXFLOW_SLURM_MEM_MB:-8000}
GPUS=${CHEXFLOW_SLURM_GPUS:-2}
PORT_BASE=${CHEXFLOW_SLURM_PORT_BASE:-16800}
START_TIMEOUT=${CHEXFLOW_SLURM_START_TIMEOUT:-90}
ACCOUNTING=${CHEXFLOW_SLURM_ACCOUNTING:-1}
ACCOUNT=${CHEXFLOW_SLURM_ACCOUNT:-chexflow}
CLUSTER_NAME=chexflow

DB_PORT=$((PORT_BASE + 6))
CTLD_PORT=$((PORT_BASE + 17))
DBD_PORT=$((PORT_BASE + 19))
DB_PASS=chexflow-local-only   # DB listens on 127.0.0.1 only; throw-away test cluster

CONF="$DIR/etc/slurm.conf"
SYS_CONF=/etc/slurm/slurm.conf
HOST=$(hostname -s)
T0=$(date +%s%3N)

# libpmix-dev: slurm's mpi/pmix plugin dlopen()s the unversioned libpmix.so it provides
APT_PACKAGES=(munge slurmctld slurmd slurm-client libpmix-dev)
APT_PACKAGES_DBD=(slurmdbd mariadb-server)

log() { local ms=$(($(date +%s%3N) - T0)); printf '[cluster.sh %3d.%03ds] %s\n' $((ms / 1000)) $((ms % 1000)) "$*"; }
die() { printf 'cluster.sh: ERROR: %s\n' "$*" >&2; exit 1; }

node_names() { local k; for ((k = 1; k <= NODES; k++)); do echo "node$k"; done; }
node_port() { echo $((PORT_BASE + 20 + ${1#node})); }

# ---------------------------------------------------------------- process helpers
pid_alive() {  # pidfile -> 0 if the process in it is alive (works for non-root callers too)
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 1
  [[ $pid =~ ^[0-9]+$ && -d /proc/$pid ]]
}

stop_pidfiles() {  # pidfile... : SIGTERM all, wait up to 15 s, then SIGKILL leftovers
  local f pid i alive
  local -A pids=()
  for f in "$@"; do
    if pid_alive "$f"; then pids[$f]=$(cat "$f"); kill -TERM "${pids[$f]}" 2>/dev/null || true
    else rm -f "$f"; fi
  done
  for ((i = 0; i < 150; i++)); do
    alive=0
    for f in "${!pids[@]}"; do kill -0 "${pids[$f]}" 2>/dev/null && alive=1; done
    ((alive)) || break
    sleep 0.1
  done
  for f in "${!pids[@]}"; do
    pid=${pids[$f]}
    if kill -0 "$pid" 2>/dev/null; then
      kill -KILL "$pid" 2>/dev/null || true
      log "killed $(basename "$f" .pid) (pid $pid) after 15 s"
    else
      log "stopped $(basename "$f" .pid) (pid $pid)"
    fi
    rm -f "$f"
  done
}

wait_for() {  # description timeout_s command...
  local what=$1 timeout=$2; shift 2
  local deadline; deadline=$(($(date +%s) + timeout))
  until "$@" >/dev/null 2>&1; do
    if (($(date +%s) >= deadline)); then
      echo "cluster.sh: ERROR: timed out after ${timeout}s waiting for: $what" >&2
      dump_logs >&2
      exit 1
    fi
    sleep 0.2
  done
}

dump_logs() {
  local f
  echo "---- log tails (under $DIR/log) ----"
  for f in "$DIR"/log/*.log; do
    [[ -f "$f" ]] || continue
    echo "==> $f <=="
    tail -n 15 "$f"
  done
  echo "---- sinfo ----"
  sinfo -N -o '%N %P %t %E' 2>&1 || true
}

# ---------------------------------------------------------------- installation
have_all() {
  local p pkgs=("${APT_PACKAGES[@]}")
  [[ $ACCOUNTING == 1 ]] && pkgs+=("${APT_PACKAGES_DBD[@]}")
  for p in "${pkgs[@]}"; do
    [[ $(dpkg-query -W -f='${Status}' "$p" 2>/dev/null) == "install ok installed" ]] || return 1
  done
}

ensure_packages() {
  have_all && return 0
  local pkgs=("${APT_PACKAGES[@]}")
  [[ $ACCOUNTING == 1 ]] && pkgs+=("${APT_PACKAGES_DBD[@]}")
  command -v apt-get >/dev/null || die "missing packages and no apt-get; install: ${pkgs[*]}"
  log "installing ${pkgs[*]} (apt-get)"
  local apt=(env DEBIAN_FRONTEND=noninteractive apt-get -y -q -o DPkg::Lock::Timeout=300
             --no-install-recommends install "${pkgs[@]}")
  if ! "${apt[@]}" >"$DIR/log/apt.log" 2>&1; then
    log "apt-get install failed; running apt-get update and retrying"
    env DEBIAN_FRONTEND=noninteractive apt-get -q -o DPkg::Lock::Timeout=300 update >>"$DIR/log/apt.log" 2>&1 \
      || { tail -n 20 "$DIR/log/apt.log" >&2; die "apt-get update failed (log: $DIR/log/apt.log)"; }
    "${apt[@]}" >>"$DIR/log/apt.log" 2>&1 \
      || { tail -n 20 "$DIR/log/apt.log" >&2; die "apt-get install ${pkgs[*]} failed (log: $DIR/log/apt.log)"; }
  fi
  have_all || die "apt-get finished but ${pkgs[*]} are not all installed (see $DIR/log/apt.log)"
}

# ---------------------------------------------------------------- configuration
write_configs() {
  mkdir -p "$DIR"/{etc,log,run,state,dev} "$DIR"/spool "$DIR"/tmp
  local n g gpu_files
  for n in $(node_names); do mkdir -p "$DIR/spool/$n" "$DIR/tmp/$n"; done
  # fake GPU device files: SLURM only needs paths that exist; CUDA_VISIBLE_DEVICES
  # is derived from their index.
  for ((g = 0; g < GPUS; g++)); do ln -sfn /dev/null "$DIR/dev/fakegpu$g"; done
  gpu_files="$DIR/dev/fakegpu[0-$((GPUS - 1))]"
  ((GPUS == 1)) && gpu_files="$DIR/dev/fakegpu0"

  local acct_lines
  if [[ $ACCOUNTING == 1 ]]; then
    acct_lines="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
# (for slurmdbd connections this names the munge socket; AuthInfo is not used there)
AccountingStoragePass=$DIR/munge/munge.socket
AccountingStorageTRES=gres/gpu
# store --comment (the executor puts rule_<name> there; used by its efficiency report)
AccountingStoreFlags=job_comment
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=task=5"
  else
    acct_lines="AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none"
  fi

  cat >"$CONF.tmp" <<EOF
# Generated by tests/slurm_cluster/cluster.sh -- local emulated cluster, do not edit.
ClusterName=$CLUSTER_NAME
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$DIR/munge/munge.socket
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# per-node TmpFS: PMIx puts its per-step directories there (would collide otherwise)
TmpFS=$DIR/tmp/%n
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
# emulated nodes: trust the CPUs/RealMemory/Gres below instead of the real hardware
SlurmdParameters=config_overrides
SwitchType=switch/none
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=500
GresTypes=gpu
# SLURM's default: between SIGTERM and SIGKILL a trainer finishes its step, agrees with its peers and
# writes its checkpoint (5 s lost it on a loaded CI machine, ~3 s per step; issue 18)
KillWait=30
InactiveLimit=0
MinJobAge=300
SlurmctldTimeout=60
SlurmdTimeout=120
MessageTimeout=30
$acct_lines
JobCompType=jobcomp/none
MailProg=/bin/true
NodeName=DEFAULT CPUs=$CPUS RealMemory=$MEM_MB Gres=gpu:$GPUS State=UNKNOWN
EOF
  for n in $(node_names); do echo "NodeName=$n NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$(node_port "$n")" >>"$CONF.tmp"; done
  cat >>"$CONF.tmp" <<EOF
PartitionName=cpu Nodes=ALL Default=YES MaxTime=INFINITE State=UP
PartitionName=gpu Nodes=ALL Default=NO MaxTime=INFINITE State=UP
EOF
  mv -f "$CONF.tmp" "$CONF"

  cat >"$DIR/etc/gres.conf" <<EOF
# fake GPUs: /dev/null symlinks, no NVML autodetection
AutoDetect=off
Name=gpu File=$gpu_files
EOF

  if [[ $ACCOUNTING == 1 ]]; then
    (umask 077; cat >"$DIR/etc/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$DIR/munge/munge.socket
DbdAddr=127.0.0.1
DbdHost=$HOST
DbdPort=$DBD_PORT
SlurmUser=root
DebugLevel=info
LogFile=$DIR/log/slurmdbd.log
PidFile=$DIR/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF
    )
  fi
}

link_system_conf() {
  # make plain `sinfo`/`sbatch` (and the snakemake executor) find this cluster
  mkdir -p "$(dirname "$SYS_CONF")"
  # only claim it when it is free: missing, already ours, or a dangling symlink
  if [[ ! -e $SYS_CONF && ! -L $SYS_CONF ]] || [[ -L $SYS_CONF && ( $(readlink "$SYS_CONF") == "$CONF" || ! -e $SYS_CONF ) ]]; then
    ln -sfn "$CONF" "$SYS_CONF"
  else
    log "WARNING: $SYS_CONF belongs to another cluster/config -- left alone. Clients need"
    log "  export SLURM_CONF=$CONF, and srun inside snakemake-executor jobs (which drop"
    log "  SLURM_CONF) will talk to the other cluster: remove $SYS_CONF for snakemake runs."
  fi
}

unlink_system_conf() {
  if [[ -L $SYS_CONF && $(readlink "$SYS_CONF") == "$CONF" ]]; then rm -f "$SYS_CONF"; fi
}

# ---------------------------------------------------------------- daemons
start_munge() {
  local d="$DIR/munge"
  if pid_alive "$d/munged.pid"; then return 0; fi
  mkdir -p "$d"
  if [[ ! -s "$d/munge.key" ]]; then
    mungekey --create --keyfile="$d/munge.key" >/dev/null
  fi
  chown -R munge:munge "$d"
  chmod 0755 "$d"   # munged requires the socket dir to be world-executable
  chmod 0600 "$d/munge.key"
  rm -f "$d/munge.socket" "$d/munge.socket.lock"
  touch "$DIR/log/munged.log"; chown munge:munge "$DIR/log/munged.log"
  runuser -u munge -- munged --socket="$d/munge.socket" --key-file="$d/munge.key" \
    --pid-file="$d/munged.pid" --log-file="$DIR/log/munged.log" --seed-file="$d/munged.seed" \
    || { dump_logs >&2; die "munged failed to start"; }
  wait_for "munged socket" 20 test -S "$d/munge.socket"
  log "munged up"
}

db_client() { mariadb --no-defaults --socket="$DIR/mysql/mysql.sock" -u root "$@"; }

start_mariadb() {
  local d="$DIR/mysql"
  if pid_alive "$DIR/mysql/mariadb.pid"; then return 0; fi
  mkdir -p "$d"
  chown mysql:mysql "$d"
  if [[ ! -d "$d/data/mysql" ]]; then
    rm -rf "$d/data"
    mariadb-install-db --no-defaults --datadir="$d/data" --user=mysql \
      --auth-root-authentication-method=socket --skip-test-db >"$DIR/log/mariadb-install.log" 2>&1 \
      || { tail -n 20 "$DIR/log/mariadb-install.log" >&2; die "mariadb-install-db failed"; }
  fi
  touch "$DIR/log/mariadb.log"; chown mysql:mysql "$DIR/log/mariadb.log"
  # mariadbd does not daemonize by itself
  setsid mariadbd --no-defaults --user=mysql --datadir="$d/data" --socket="$d/mysql.sock" \
    --pid-file="$DIR/mysql/mariadb.pid" --port="$DB_PORT" --bind-address=127.0.0.1 \
    --skip-name-resolve --log-error="$DIR/log/mariadb.log" --innodb-buffer-pool-size=64M \
    --innodb-log-file-size=16M --skip-log-bin </dev/null >/dev/null 2>&1 &
  wait_for "mariadb (socket $d/mysql.sock)" 60 mariadb-admin --no-defaults --socket="$d/mysql.sock" -u root ping
  chmod 0644 "$d/mariadb.pid"   # let `cluster.sh status` read it as any user
  if [[ ! -e "$d/.slurm-user-created" ]]; then
    db_client -e "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
      GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1'; FLUSH PRIVILEGES;"
    touch "$d/.slurm-user-created"
  fi
  log "mariadb up"
}

start_slurmdbd() {
  if pid_alive "$DIR/run/slurmdbd.pid"; then return 0; fi
  slurmdbd || { dump_logs >&2; die "slurmdbd failed to start"; }
  wait_for "slurmdbd (sacctmgr list cluster)" 60 sacctmgr -n list cluster
  if ! sacctmgr -n -P list cluster format=cluster | grep -qx "$CLUSTER_NAME"; then
    sacctmgr -i add cluster "$CLUSTER_NAME" >/dev/null
  fi
  if ! sacctmgr -n -P list account format=account | grep -qx "$ACCOUNT"; then
    sacctmgr -i add account "$ACCOUNT" Cluster="$CLUSTER_NAME" \
      Description="chexflow test account" Organization=chexflow >/dev/null
  fi
  if ! sacctmgr -n -P list assoc user=root account="$ACCOUNT" format=account | grep -qx "$ACCOUNT"; then
    sacctmgr -i add user root Account="$ACCOUNT" Cluster="$CLUSTER_NAME" >/dev/null
  fi
  log "slurmdbd up (account '$ACCOUNT' for root)"
}

start_slurmctld() {
  if pid_alive "$DIR/run/slurmctld.pid"; then return 0; fi
  slurmctld -f "$CONF" -i || { dump_logs >&2; die "slurmctld failed to start"; }
  wait_for "slurmctld (scontrol ping)" 30 bash -c "scontrol ping | grep -q UP"
  log "slurmctld up"
}

start_slurmds() {
  local n started=0
  for n in $(node_names); do
    pid_alive "$DIR/run/slurmd-$n.pid" && continue
    slurmd -f "$CONF" -N "$n" || { dump_logs >&2; die "slurmd -N $n failed to start"; }
    started=$((started + 1))
  done
  ((started == 0)) || log "started $started slurmd"
}

nodes_idle() {
  local idle
  idle=$(sinfo -h -N -p cpu -t idle -o '%N' 2>/dev/null | sort -u | wc -l)
  ((idle == NODES))
}

all_running() {
  local n
  pid_alive "$DIR/munge/munged.pid" || return 1
  if [[ $ACCOUNTING == 1 ]]; then
    pid_alive "$DIR/mysql/mariadb.pid" && pid_alive "$DIR/run/slurmdbd.pid" || return 1
  fi
  pid_alive "$DIR/run/slurmctld.pid" || return 1
  for n in $(node_names); do pid_alive "$DIR/run/slurmd-$n.pid" || return 1; done
}

# ---------------------------------------------------------------- commands
require_root() {
  [[ $(id -u) == 0 ]] || die "must run as root (starts munged/slurmctld/slurmd and may apt-get install); try: sudo $0 $*"
}

cmd_start() {
  require_root start
  mkdir -p "$DIR/log"
  export SLURM_CONF="$CONF"
  if all_running && [[ -f $CONF ]]; then
    link_system_conf
    log "already running (state: $DIR)"
    return 0
  fi
  ensure_packages
  log "packages ok"
  # (re)write the config only while the controller is down (a live cluster keeps its own)
  pid_alive "$DIR/run/slurmctld.pid" || write_configs
  link_system_conf
  start_munge
  if [[ $ACCOUNTING == 1 ]]; then start_mariadb; start_slurmdbd; fi
  start_slurmctld
  start_slurmds
  local deadline=$(($(date +%s) + START_TIMEOUT))
  until nodes_idle; do
    # nodes left DOWN/DRAIN from an earlier run: bring them back
    scontrol update nodename=ALL state=RESUME >/dev/null 2>&1 || true
    if (($(date +%s) >= deadline)); then
      echo "cluster.sh: ERROR: nodes not all idle after ${START_TIMEOUT}s" >&2
      dump_logs >&2
      exit 1
    fi
    sleep 0.3
  done
  log "cluster up: $NODES nodes idle in partitions cpu (default) and gpu (state: $DIR)"
}

cmd_stop() {
  require_root stop
  # slurmds (also those of an earlier run with more nodes) and the controller first,
  # then accounting, then the database and munge
  stop_pidfiles "$DIR"/run/slurmd-*.pid "$DIR/run/slurmctld.pid"
  stop_pidfiles "$DIR/run/slurmdbd.pid"
  stop_pidfiles "$DIR/mysql/mariadb.pid" "$DIR/munge/munged.pid"
  unlink_system_conf
  log "stopped (state kept in $DIR; rm -rf it for a clean slate)"
}

cmd_status() {
  export SLURM_CONF="$CONF"
  local f name rc=0
  echo "state dir: $DIR   config: $CONF"
  for f in "$DIR/munge/munged.pid" "$DIR/mysql/mariadb.pid" "$DIR/run/slurmdbd.pid" \
           "$DIR/run/slurmctld.pid" "$DIR"/run/slurmd-*.pid; do
    [[ -e $f || $f == *mariadb* || $f == *slurmdbd* || $f == *munged* || $f == *slurmctld* ]] || continue
    name=$(basename "$f" .pid)
    if pid_alive "$f"; then echo "  $name: running (pid $(cat "$f"))"; else echo "  $name: stopped"; rc=3; fi
  done
  if [[ -f $CONF ]] && pid_alive "$DIR/run/slurmctld.pid"; then sinfo -o '%P %a %D %t %N %G' || rc=3; fi
  return $rc
}

cmd_env() {
  echo "export SLURM_CONF=$CONF"
  echo "# emulated nodes share one host: keep OpenMPI off shared-memory transports between them"
  echo "export OMPI_MCA_btl=self,tcp"
}

case "${1:-}" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  env) cmd_env ;;
  *) echo "usage: $0 start|stop|status|env" >&2; exit 2 ;;
esac
