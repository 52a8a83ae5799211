#!/usr/bin/env bash
# A three-node RabbitMQ cluster on this machine, for tests (tests/support/cluster.rs drives it).
#
#   scripts/rabbitmq-cluster.sh DIR up|down|status|ports
#   scripts/rabbitmq-cluster.sh DIR kill|freeze|thaw|start|rejoin|stop N  (N = 1, 2 or 3)
#
#   up        create DIR, start node 1, then nodes 2 and 3 (which join 1 as they boot), wait
#             until each node sees 3 running
#   down      kill -9 every node process of DIR (thawing first), wait until no process,
#             epmd name or listening port is left, remove DIR; safe to repeat, and after a
#             failed or partial up
#   kill N    kill -9 node N's beam.smp and wait until it is gone (name off epmd, port closed)
#   freeze N  SIGSTOP node N's processes (beam.smp and its helpers): a hung VM, sockets open
#   thaw N    SIGCONT them
#   start N   start node N again on its own data (it rejoins by itself); wait until it has
#             booted and every node up sees all nodes up running (3, unless another is down too)
#   rejoin N  restart node N's RabbitMQ application inside its running VM (stop_app,
#             start_app) and wait as start does: a node thawed after the others declared it
#             down stays out of their cluster until then. About 1 s of CPU where start, a VM
#             boot, takes 6.
#   stop N    stop node N cleanly (rabbitmqctl stop) and wait until its process is gone
#   status    one line per node (name, AMQP port, distribution port, pid, state) and the
#             running nodes as each reachable node sees them
#   ports     the three AMQP ports, one a line, node 1 first
#   leader Q  the number of the node that leads quorum queue Q (on the default vhost)
#   alarm on|off  a disk alarm on node 1 (its free-disk limit set beyond any disk), which
#             blocks every publishing connection of the cluster; off clears it
#
# Nodes are c1-H@localhost, c2-H@localhost and c3-H@localhost, H being the first 6 hex digits
# of the SHA-1 of DIR's absolute path, so clusters in different directories never collide and
# never touch the machine's own rabbit@localhost. Each node has its own AMQP port (listening on
# 127.0.0.1 only), distribution port, data, logs, config and an empty plugins file; all share
# one Erlang cookie in DIR/home, which every rabbitmqctl call here uses too. Ports are free
# ports picked at `up` and recorded in DIR; SLUICE_CLUSTER_BASE_PORT=B fixes them instead: AMQP
# B, B+1, B+2 and distribution B+3, B+4, B+5. Every wait has a deadline
# (SLUICE_CLUSTER_WAIT_SECS, default 120 s); a failure prints the tail of the node's logs and
# exits non-zero, and a failed `up` kills what it started (DIR stays for its logs until `down`).
set -euo pipefail

RMQ_BIN=/usr/lib/rabbitmq/bin # Debian's own scripts: the /usr/sbin wrappers switch user and cookie
WAIT_SECS=${SLUICE_CLUSTER_WAIT_SECS:-120}
NODES=(1 2 3)

usage() {
  sed -n '4,5p' "$0" | sed 's/^# *//' >&2
  exit 2
}

[[ $# -ge 2 ]] || usage
DIR=$(realpath -m -- "$1")
CMD=$2
N=${3:-}
case $CMD in
  kill | freeze | thaw | start | rejoin | stop) [[ $N == [123] && $# -eq 3 ]] || usage ;;
  up | down | status | ports) [[ $# -eq 2 ]] || usage ;;
  leader) [[ -n $N && $# -eq 3 ]] || usage ;;
  alarm) [[ $N == on || $N == off ]] || usage ;;
  *) usage ;;
esac

HASH=$(printf '%s' "$DIR" | sha1sum | cut -c1-6)

say() { printf 'rabbitmq-cluster: %s\n' "$*"; }
short_name() { printf 'c%s-%s' "$1" "$HASH"; }
node_name() { printf '%s@localhost' "$(short_name "$1")"; }
node_dir() { printf '%s/n%s' "$DIR" "$1"; }
amqp_port() { cat "$(node_dir "$1")/amqp_port"; }
dist_port() { cat "$(node_dir "$1")/dist_port"; }
now_ms() { echo $(($(date +%s%N) / 1000000)); }

# The tail of node N's logs, for failure reports.
log_tail() {
  local nd f
  nd=$(node_dir "$1")
  for f in "$nd"/log/*.log "$nd/stdout.log"; do
    [[ -s $f ]] || continue
    echo "---- last lines of $f"
    tail -n 30 "$f"
  done
}

# fail MESSAGE [N...]: report, with the logs of the nodes named, and exit non-zero.
fail() {
  local msg=$1 n
  shift
  say "FAILED: $msg" >&2
  for n in "$@"; do log_tail "$n" >&2; done
  exit 1
}

# rabbitmqctl against node N, with the cluster's cookie, never the machine's settings; the CLI
# takes an ephemeral distribution port (not 35672-35682, which other tests' calls share).
ctl() {
  local n=$1
  shift
  timeout -k 5 "${CTL_TIMEOUT:-60}" env -i PATH="$PATH" HOME="$DIR/home" LANG=C.UTF-8 LC_ALL=C.UTF-8 \
    RABBITMQ_CONF_ENV_FILE="$DIR/rabbitmq-env.conf" \
    RABBITMQ_ENABLED_PLUGINS_FILE="$DIR/enabled_plugins" \
    RABBITMQ_CTL_DIST_PORT_MIN=0 RABBITMQ_CTL_DIST_PORT_MAX=0 \
    SLUICE_CLUSTER_DIR="$DIR" SLUICE_CLUSTER_NODE=cli \
    "$RMQ_BIN/rabbitmqctl" -n "$(node_name "$n")" "$@"
}

# Pids of the live processes started for this DIR (or for node N only): every node process
# carries SLUICE_CLUSTER_DIR and SLUICE_CLUSTER_NODE (1, 2, 3, or cli for rabbitmqctl) in its
# environment, which also finds them after a partial `up` that recorded nothing.
node_pids() {
  local f pid
  for f in $(grep -lzxF -- "SLUICE_CLUSTER_DIR=$DIR" /proc/[0-9]*/environ 2>/dev/null || true); do
    pid=${f#/proc/}
    pid=${pid%/environ}
    [[ $pid != "$$" ]] || continue
    if [[ -n ${1:-} ]] && ! grep -qzxF -- "SLUICE_CLUSTER_NODE=$1" "$f" 2>/dev/null; then continue; fi
    echo "$pid"
  done
}

# The OS pid of node N's beam.smp, if it runs.
beam_pid() {
  local pid
  for pid in $(node_pids "$1"); do
    if [[ $(cat "/proc/$pid/comm" 2>/dev/null) == beam.smp ]]; then
      echo "$pid"
      return 0
    fi
  done
  return 1
}

proc_state() { awk '{print $3}' "/proc/$1/stat" 2>/dev/null || echo gone; }

# Local TCP ports in use (any state) or, with "listen", listening; decimal, one a line.
tcp_ports() {
  awk -v want="${1:-}" '
    function hex(s, i, v) { for (i = 1; i <= length(s); i++) v = v * 16 + index("0123456789ABCDEF", substr(s, i, 1)) - 1; return v }
    FNR > 1 && (want != "listen" || $4 == "0A") { split($2, a, ":"); print hex(toupper(a[2])) }' \
    /proc/net/tcp /proc/net/tcp6 2>/dev/null | sort -un
}
listening() { tcp_ports listen | grep -qx -- "$1"; }
epmd_has() { epmd -names 2>/dev/null | grep -q "^name $(short_name "$1") at port "; }
off_epmd() { ! epmd_has "$1"; }

# wait_until DESCRIPTION SECONDS COMMAND...: poll COMMAND until it succeeds or time runs out.
wait_until() {
  local what=$1 secs=$2
  shift 2
  local deadline=$((SECONDS + secs))
  until "$@"; do
    ((SECONDS < deadline)) || return 1
    sleep 0.2
  done
}

node_gone() {
  ! beam_pid "$1" >/dev/null && ! epmd_has "$1" && { [[ ! -f $(node_dir "$1")/amqp_port ]] || ! listening "$(amqp_port "$1")"; }
}

pick_ports() {
  local used port ports=()
  used=$(tcp_ports)
  if [[ -n ${SLUICE_CLUSTER_BASE_PORT:-} ]]; then
    for port in $(seq "$SLUICE_CLUSTER_BASE_PORT" $((SLUICE_CLUSTER_BASE_PORT + 5))); do
      grep -qx -- "$port" <<<"$used" && fail "port $port (from SLUICE_CLUSTER_BASE_PORT) is in use"
      ports+=("$port")
    done
  else
    # Below the ephemeral range (32768+), from a random start so concurrent clusters rarely meet.
    port=$((20000 + RANDOM % 10000))
    while ((${#ports[@]} < 6)); do
      port=$((port + 1))
      ((port < 32000)) || port=20001
      grep -qx -- "$port" <<<"$used" || ports+=("$port")
    done
  fi
  echo "${ports[@]}"
}

write_node_files() {
  local n=$1 amqp=$2 dist=$3 nd
  nd=$(node_dir "$n")
  mkdir -p "$nd/log" "$nd/mnesia"
  echo "$amqp" >"$nd/amqp_port"
  echo "$dist" >"$nd/dist_port"
  cat >"$nd/rabbitmq.conf" <<EOF
listeners.tcp.default = 127.0.0.1:$amqp
queue_leader_locator = balanced
cluster_partition_handling = pause_minority
# A frozen node is declared down after 10 s (7.5-12.5 s) instead of 60 s: until then a quorum
# queue whose leader it holds accepts no new consumer on any node (README, "Running on a
# RabbitMQ cluster").
net_ticktime = 10
log.console = false
log.file.level = info
EOF
  ((n == 1)) || join_at_boot "$n" >>"$nd/rabbitmq.conf"
}

# Nodes 2 and 3 join node 1 while they boot (classic config peer discovery), which saves the
# three rabbitmqctl calls per node (each an Erlang VM of its own) of stop_app, join_cluster and
# start_app. Node 1 lists no peers, so it alone starts the cluster; node N lists node 1 (and
# itself, as the discovery lock expects) and waits for it as long as `up` waits: RabbitMQ
# 3.10 skips a peer whose database is not up yet and tries again every retry interval, up to
# the retry limit, after which the node would start on its own, which await_cluster reports.
# Only a node with an empty database looks: a restart rejoins by itself.
join_at_boot() {
  cat <<EOF
cluster_formation.peer_discovery_backend = classic_config
cluster_formation.classic_config.nodes.1 = $(node_name 1)
cluster_formation.classic_config.nodes.2 = $(node_name "$1")
cluster_formation.discovery_retry_interval = 250
cluster_formation.discovery_retry_limit = $((WAIT_SECS * 4))
EOF
}

# Start node N in the background, in a session of its own, on its existing files.
start_node() {
  local n=$1 nd name
  nd=$(node_dir "$n")
  name=$(node_name "$n")
  echo "==== $(date -Is) start" >>"$nd/stdout.log"
  (
    cd "$nd"
    exec setsid env -i PATH="$PATH" HOME="$DIR/home" LANG=C.UTF-8 LC_ALL=C.UTF-8 \
      SLUICE_CLUSTER_DIR="$DIR" SLUICE_CLUSTER_NODE="$n" \
      RABBITMQ_NODENAME="$name" \
      RABBITMQ_DIST_PORT="$(dist_port "$n")" \
      RABBITMQ_CONF_ENV_FILE="$DIR/rabbitmq-env.conf" \
      RABBITMQ_ENABLED_PLUGINS_FILE="$DIR/enabled_plugins" \
      RABBITMQ_CONFIG_FILE="$nd/rabbitmq.conf" \
      RABBITMQ_CONFIG_FILES="$nd/conf.d" \
      RABBITMQ_ADVANCED_CONFIG_FILE="$nd/advanced.config" \
      RABBITMQ_MNESIA_BASE="$nd/mnesia" \
      RABBITMQ_MNESIA_DIR="$nd/mnesia/$name" \
      RABBITMQ_LOG_BASE="$nd/log" \
      RABBITMQ_PID_FILE="$nd/pid" \
      RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="+S 1:1 +sbwt none +sbwtdcpu none +sbwtdio none -kernel inet_dist_use_interface {127,0,0,1}" \
      "$RMQ_BIN/rabbitmq-server" </dev/null >>"$nd/stdout.log" 2>&1
  ) &
  wait_until "node $n launched" 10 has_procs "$n" || fail "node $n: rabbitmq-server did not start" "$n"
}
has_procs() { [[ -n $(node_pids "$1") ]]; }

# Wait until node N listens on its AMQP port, one of the last steps of its boot (after its
# database has joined the cluster's), by reading /proc rather than running rabbitmqctl.
await_listening() {
  local n=$1 deadline=$((SECONDS + WAIT_SECS))
  until listening "$(amqp_port "$n")"; do
    has_procs "$n" || fail "node $n ($(node_name "$n")) exited while starting" "$n"
    ((SECONDS < deadline)) || fail "node $n did not listen on AMQP port $(amqp_port "$n") within ${WAIT_SECS}s" "$n"
    sleep 0.2
  done
}

# await_cluster COUNT N...: wait until each node N has booted and sees COUNT running nodes
# (listening does not mean joined), asking them all from the first with one rabbitmqctl call
# whose loop runs inside that node.
await_cluster() {
  local want=$1 n nodes=() out
  for n in "${@:2}"; do nodes+=("'$(node_name "$n")'"); done
  out=$(CTL_TIMEOUT=$((WAIT_SECS + 30)) ctl "$2" eval "
    Deadline = erlang:monotonic_time(second) + $WAIT_SECS,
    View = fun(N) -> {N, rpc:call(N, rabbit, is_booted, [], 5000), rpc:call(N, rabbit_nodes, running_count, [], 5000)} end,
    Await = fun Await() ->
      Views = [View(N) || N <- [$(IFS=,; echo "${nodes[*]}")]],
      case [V || {_, true, $want} = V <- Views] of
        Views -> ok;
        _ -> case erlang:monotonic_time(second) < Deadline of
               true -> timer:sleep(200), Await();
               false -> {not_yet, Views}
             end
      end
    end,
    Await()." 2>&1) || true
  [[ $(tail -n 1 <<<"$out") == ok ]] ||
    fail "not every node of ${*:2} booted and saw $want running within ${WAIT_SECS}s ({node, booted, running}): $out" "${NODES[@]}"
}

# run N DESCRIPTION ARGS...: rabbitmqctl against node N, failing with its output and the log.
run_ctl() {
  local n=$1 what=$2 out
  shift 2
  out=$(ctl "$n" "$@" 2>&1) || fail "$what: rabbitmqctl $* said: $out" "$n"
}

# Kill every process of node N (all nodes when N is empty): thaw, SIGKILL beam.smp first so its
# parent shell (which waits on it) reaps it, then the rest; wait until none is left.
kill_procs() {
  local pids pid beams=()
  pids=$(node_pids "${1:-}")
  [[ -n $pids ]] || return 0
  kill -CONT $pids 2>/dev/null || true
  for pid in $pids; do
    [[ $(cat "/proc/$pid/comm" 2>/dev/null) == beam.smp ]] || continue
    kill -KILL "$pid" 2>/dev/null || true
    beams+=("$pid")
  done
  # A zombie has no environment to find it by, so wait on the pids themselves.
  wait_until "beam.smp reaped" 5 all_reaped "${beams[@]}" || true
  pids=$(node_pids "${1:-}")
  [[ -z $pids ]] || kill -KILL $pids 2>/dev/null || true
  wait_until "processes gone" 30 no_procs "${1:-}" || {
    say "processes still there: $(node_pids "${1:-}" | tr '\n' ' ')" >&2
    return 1
  }
}
no_procs() { [[ -z $(node_pids "${1:-}") ]]; }
all_reaped() {
  local pid
  for pid in "$@"; do
    [[ ! -e /proc/$pid ]] || return 1
  done
}

require_up() { [[ -f $DIR/ports ]] || fail "no cluster in $DIR (run up first)"; }

cmd_up() {
  [[ ! -e $DIR/ports ]] || fail "$DIR already holds a cluster; run down first"
  [[ -x $RMQ_BIN/rabbitmq-server && -x $RMQ_BIN/rabbitmqctl ]] ||
    fail "RabbitMQ is not installed ($RMQ_BIN/rabbitmq-server missing): apt-get install rabbitmq-server"
  command -v epmd >/dev/null || fail "epmd is not on PATH (it comes with Erlang, which RabbitMQ needs)"
  local t0 ports n
  t0=$(now_ms)
  mkdir -p "$DIR/home"
  # From here on a failure kills what was started.
  trap 'st=$?; if ((st != 0)); then kill_procs || true; say "up failed; logs stay in $DIR until down" >&2; fi' EXIT
  : >"$DIR/rabbitmq-env.conf" # Debian's /etc/rabbitmq/rabbitmq-env.conf sets a node name
  : >"$DIR/enabled_plugins"
  (umask 077 && head -c 32 /dev/urandom | sha1sum | cut -c1-40 | tr -d '\n' >"$DIR/home/.erlang.cookie")
  chmod 0400 "$DIR/home/.erlang.cookie"
  ports=$(pick_ports) || exit 1
  read -r -a ports <<<"$ports"
  for n in "${NODES[@]}"; do write_node_files "$n" "${ports[n - 1]}" "${ports[n + 2]}"; done
  printf '%s\n' "${ports[0]}" "${ports[1]}" "${ports[2]}" >"$DIR/ports"
  say "starting $(node_name 1), $(node_name 2), $(node_name 3) on AMQP ports ${ports[*]:0:3} in $DIR"
  # Node 1 first, to the end of its boot: a node that joins one still enabling its feature
  # flags can stop that boot ("incompatible_feature_flags ... All replicas on diskfull nodes
  # are not active yet", seen once under a loaded CI machine). Nodes 2 and 3 then join it one
  # at a time, under the discovery lock.
  start_node 1
  await_listening 1
  for n in "${NODES[@]:1}"; do start_node "$n"; done
  for n in "${NODES[@]:1}"; do await_listening "$n"; done
  say "listening in $(($(now_ms) - t0)) ms"
  await_cluster 3 "${NODES[@]}"
  trap - EXIT
  say "up: 3 nodes running in $(($(now_ms) - t0)) ms"
}

cmd_down() {
  local t0 n
  t0=$(now_ms)
  kill_procs || fail "could not kill the nodes of $DIR"
  if [[ -f $DIR/ports ]]; then
    for n in "${NODES[@]}"; do
      wait_until "node $n gone" 30 node_gone "$n" || fail "node $n: still on epmd or its port still listens"
    done
  else
    for n in "${NODES[@]}"; do
      wait_until "node $n off epmd" 30 off_epmd "$n" || fail "node $n still on epmd"
    done
  fi
  rm -rf -- "$DIR"
  say "down in $(($(now_ms) - t0)) ms"
}

cmd_kill() {
  local pid
  require_up
  pid=$(beam_pid "$N") || fail "node $N is not running"
  kill_procs "$N" || fail "node $N: could not kill its processes" "$N"
  wait_until "node $N gone" 30 node_gone "$N" || fail "node $N: still on epmd or its port still listens after kill -9"
  say "killed node $N (beam.smp pid $pid)"
}

cmd_freeze() {
  local pids
  require_up
  beam_pid "$N" >/dev/null || fail "node $N is not running"
  pids=$(node_pids "$N")
  kill -STOP $pids
  say "froze node $N (pids $(echo $pids))"
}

cmd_thaw() {
  local pids
  require_up
  pids=$(node_pids "$N")
  [[ -n $pids ]] || fail "node $N is not running"
  kill -CONT $pids
  say "thawed node $N"
}

cmd_start() {
  local t0
  require_up
  t0=$(now_ms)
  if beam_pid "$N" >/dev/null; then
    say "node $N already runs"
  else
    start_node "$N"
  fi
  await_listening "$N"
  await_rejoined
  say "started node $N in $(($(now_ms) - t0)) ms"
}

cmd_rejoin() {
  local t0
  require_up
  t0=$(now_ms)
  beam_pid "$N" >/dev/null || fail "node $N is not running"
  run_ctl "$N" "node $N stop_app" stop_app
  run_ctl "$N" "node $N start_app" start_app
  await_rejoined
  say "rejoined node $N in $(($(now_ms) - t0)) ms"
}

# Wait until node $N and every other node that runs see each other running.
await_rejoined() {
  local others=() n
  for n in "${NODES[@]}"; do
    [[ $n == "$N" ]] || ! beam_pid "$n" >/dev/null || others+=("$n")
  done
  await_cluster $((1 + ${#others[@]})) "$N" "${others[@]}"
}

cmd_stop() {
  require_up
  beam_pid "$N" >/dev/null || fail "node $N is not running"
  run_ctl "$N" "node $N stop" stop
  wait_until "node $N stopped" "$WAIT_SECS" node_gone "$N" || fail "node $N did not stop within ${WAIT_SECS}s" "$N"
  kill_procs "$N" || true # what is left of its session (the shell that waited on it)
  say "stopped node $N"
}

cmd_status() {
  local n pid state running
  require_up
  printf '%-4s %-22s %-6s %-6s %-8s %s\n' node name amqp dist pid state
  for n in "${NODES[@]}"; do
    if pid=$(beam_pid "$n"); then
      case $(proc_state "$pid") in
        T | t) state=frozen ;;
        *) state=running ;;
      esac
    else
      pid=- state=down
    fi
    printf '%-4s %-22s %-6s %-6s %-8s %s\n' "$n" "$(node_name "$n")" "$(amqp_port "$n")" "$(dist_port "$n")" "$pid" "$state"
  done
  for n in "${NODES[@]}"; do
    [[ $(proc_state "$(beam_pid "$n" || echo 0)") == [SRD] ]] || continue
    running=$(CTL_TIMEOUT=15 ctl "$n" eval 'rabbit_nodes:all_running().' 2>/dev/null | tr -d ' \n' || true)
    echo "node $n sees running: ${running:-no answer}"
  done
}

cmd_ports() {
  require_up
  cat "$DIR/ports"
}

# The node leading quorum queue $N, as the first node that answers says.
cmd_leader() {
  require_up
  local n line leader
  for n in "${NODES[@]}"; do
    [[ $(proc_state "$(beam_pid "$n" || echo 0)") == [SRD] ]] || continue
    line=$(CTL_TIMEOUT=20 ctl "$n" list_queues name leader --quiet --no-table-headers 2>/dev/null |
      awk -v q="$N" '$1 == q { print $2 }') || continue
    for leader in "${NODES[@]}"; do
      if [[ $line == "$(node_name "$leader")" ]]; then
        echo "$leader"
        return 0
      fi
    done
  done
  fail "no node names a leader of queue $N"
}

# Raises or clears a disk alarm: RabbitMQ blocks publishers cluster-wide while any node has one.
cmd_alarm() {
  require_up
  local limit=50MB
  [[ $N == on ]] && limit=1000000GB
  run_ctl 1 "setting the disk free limit to $limit" set_disk_free_limit "$limit"
}

case $CMD in
  up) cmd_up ;;
  down) cmd_down ;;
  kill) cmd_kill ;;
  freeze) cmd_freeze ;;
  thaw) cmd_thaw ;;
  start) cmd_start ;;
  rejoin) cmd_rejoin ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  ports) cmd_ports ;;
  leader) cmd_leader ;;
  alarm) cmd_alarm ;;
esac
