#!/usr/bin/env bash
# Chaos soak (issue 19): a steady stream of messages for a bounded time while runners are
# killed with kill -9, the pipeline is reloaded, the receiver goes down and (on RabbitMQ) the
# broker restarts, at random; then a drain and a ledger: published, handled, dead-lettered by
# reason, lost (must be 0) and handled twice. The method and the latest ledgers are in
# BENCHMARKS.md ("Chaos soak").
#
#   scripts/soak.sh [--broker embedded|rabbitmq] [--minutes N] [--rate N] [--seed S] SLUICE_BINARY
#
# --broker    embedded (default): a broker directory of the soak's own. rabbitmq: a RabbitMQ node
#             of the soak's own (rabbitmq-server on free ports, its own node name, data and
#             cookie, removed at the end), never the machine's shared broker, since it restarts it.
# --minutes   how long the stream and the chaos last (default 10); the drain comes after.
# --rate      messages a second (default 20), published as one `sluice publish --jsonl` batch a
#             second, each message with its own payload {"k": "mN"}. Only a batch whose publish
#             exited 0 counts as published (every message in it confirmed); the keys of a
#             failed one are reported as unconfirmed.
# --seed      the chaos schedule's seed (default: random, printed); the same seed replays the
#             same actions at the same intervals (a kill whose runner is still down is skipped,
#             and a broker restart's own length shifts what follows it).
#
# Two runners (`sluice run`, watching the pipeline directory) consume queue `work` (quorum on
# RabbitMQ, concurrency 8, retry 6 attempts from 200 ms to 2 s, circuit breaker on) and share
# the idempotency keys: the embedded broker's own file, or a state directory (--dedup) beside
# RabbitMQ. Its webhook is scripts/bench-downstream-receiver.py, which records every call's
# idempotency key, the payload's "k" and its status. Every 2-11 s (seeded) one of:
#   kill     kill -9 of one runner, started again 0-2 s later
#   reload   the pipeline file saved with concurrency 8 <-> 9 (temporary file, then rename)
#   outage   the receiver answers 503 to everything for 2-9 s
#   restart  (rabbitmq only) the node stopped (rabbitmqctl stop) and started again
# After the stream: the receiver up, both runners running, and a wait until everything is
# handled or dead-lettered with nothing ready or waiting to retry (or 60 s with nothing left
# anywhere and no call to the receiver); then the runners stop and `sluice dlq list --format
# json` reads the dead-letter queue.
#
# The ledger (per payload key): published (confirmed), handled (at least one 200), dead-lettered
# by reason, lost = published and neither handled nor dead-lettered (exit 1 if any), handled
# twice (keys with more than one 200: with idempotency on, only a message in flight when its
# runner was killed, between the side effect and the ack, may repeat).
# Needs python3 and curl; for rabbitmq, RabbitMQ's own scripts in /usr/lib/rabbitmq/bin and epmd.
set -euo pipefail

usage() {
  sed -n '8p' "$0" | sed 's/^# *//' >&2
  exit 2
}
broker=embedded minutes=10 rate=20 seed=$((RANDOM * 32768 + RANDOM))
while [ $# -gt 1 ]; do
  case "$1" in
    --broker) broker=$2 ;;
    --minutes) minutes=$2 ;;
    --rate) rate=${2%/s} ;;
    --seed) seed=$2 ;;
    *) usage ;;
  esac
  shift 2
done
[ $# -eq 1 ] && [ -x "$1" ] || usage
[[ $broker == embedded || $broker == rabbitmq ]] || usage
[[ $minutes =~ ^[0-9]+$ && $rate =~ ^[1-9][0-9]*$ && $seed =~ ^[0-9]+$ ]] || usage
sluice=$(realpath "$1")
here=$(dirname "$(realpath "$0")")

source "$here/bench-lib.sh"

RMQ_BIN=/usr/lib/rabbitmq/bin # Debian's own scripts: the /usr/sbin wrappers switch user and cookie
rmq=$tmp/rabbit node="soak-$$@localhost"
publisher="" runners=("" "")
soak_cleanup() {
  local pid
  [ -z "$publisher" ] || kill "$publisher" 2>/dev/null || true
  for pid in "${runners[@]}"; do [ -z "$pid" ] || kill -9 "$pid" 2>/dev/null || true; done
  if [ "$broker" = rabbitmq ]; then node_kill; fi
  bench_cleanup
}
trap soak_cleanup EXIT

now_ms() { echo $(($(date +%s%N) / 1000000)); }
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
say() { echo "$(date -u +%H:%M:%S.%3N) $*"; }

# The RabbitMQ node: every process of it carries SLUICE_SOAK_DIR in its environment.
node_pids() {
  local f pid
  for f in $(grep -lzxF -- "SLUICE_SOAK_DIR=$rmq" /proc/[0-9]*/environ 2>/dev/null || true); do
    pid=${f#/proc/}
    echo "${pid%/environ}"
  done
}
node_kill() {
  local pids
  pids=$(node_pids)
  [ -z "$pids" ] || kill -9 $pids 2>/dev/null || true
}
ctl() {
  timeout -k 5 60 env -i PATH="$PATH" HOME="$rmq/home" LANG=C.UTF-8 LC_ALL=C.UTF-8 \
    RABBITMQ_CONF_ENV_FILE="$rmq/rabbitmq-env.conf" RABBITMQ_ENABLED_PLUGINS_FILE="$rmq/enabled_plugins" \
    RABBITMQ_CTL_DIST_PORT_MIN=0 RABBITMQ_CTL_DIST_PORT_MAX=0 SLUICE_SOAK_DIR="$rmq" \
    "$RMQ_BIN/rabbitmqctl" -n "$node" "$@"
}
node_start() {
  (
    cd "$rmq"
    exec setsid env -i PATH="$PATH" HOME="$rmq/home" LANG=C.UTF-8 LC_ALL=C.UTF-8 SLUICE_SOAK_DIR="$rmq" \
      RABBITMQ_NODENAME="$node" RABBITMQ_DIST_PORT="$dist_port" \
      RABBITMQ_CONF_ENV_FILE="$rmq/rabbitmq-env.conf" RABBITMQ_ENABLED_PLUGINS_FILE="$rmq/enabled_plugins" \
      RABBITMQ_CONFIG_FILE="$rmq/rabbitmq.conf" RABBITMQ_CONFIG_FILES="$rmq/conf.d" \
      RABBITMQ_ADVANCED_CONFIG_FILE="$rmq/advanced.config" RABBITMQ_MNESIA_BASE="$rmq/mnesia" \
      RABBITMQ_MNESIA_DIR="$rmq/mnesia/$node" RABBITMQ_LOG_BASE="$rmq/log" RABBITMQ_PID_FILE="$rmq/pid" \
      RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="+S 1:1 -kernel inet_dist_use_interface {127,0,0,1}" \
      "$RMQ_BIN/rabbitmq-server" </dev/null >>"$rmq/stdout.log" 2>&1
  ) &
  disown
  local deadline=$((SECONDS + 120))
  until ctl await_startup --timeout 5 >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || { tail -30 "$rmq/stdout.log" >&2; echo "the RabbitMQ node did not start" >&2; exit 1; }
    sleep 0.5
  done
}
node_stop() {
  ctl stop >/dev/null 2>&1 || true
  local deadline=$((SECONDS + 60))
  while [ -n "$(node_pids)" ]; do
    [ $SECONDS -lt $deadline ] || { node_kill; break; }
    sleep 0.2
  done
}

# The receiver.
rport=$(free_port)
python3 "$here/bench-downstream-receiver.py" "$rport" 2>"$tmp/receiver.log" &
receiver=$!
until curl -s "http://127.0.0.1:$rport/stats" >/dev/null; do sleep 0.1; done
receiver_post() { curl -s -X POST "http://127.0.0.1:$rport/control/$1" >/dev/null; }

# The broker.
if [ "$broker" = rabbitmq ]; then
  mkdir -p "$rmq/home" "$rmq/log" "$rmq/mnesia"
  : >"$rmq/rabbitmq-env.conf" # Debian's /etc/rabbitmq/rabbitmq-env.conf sets a node name
  : >"$rmq/enabled_plugins"
  (umask 077 && head -c 32 /dev/urandom | sha1sum | cut -c1-40 | tr -d '\n' >"$rmq/home/.erlang.cookie")
  amqp_port=$(free_port) dist_port=$(free_port)
  printf 'listeners.tcp.default = 127.0.0.1:%s\nlog.console = false\n' "$amqp_port" >"$rmq/rabbitmq.conf"
  node_start
  url="amqp://guest:guest@127.0.0.1:$amqp_port/%2f"
  dedup=(--dedup "$tmp/state")
  where="RabbitMQ $(ctl version 2>/dev/null | tail -1) node $node on 127.0.0.1:$amqp_port"
else
  url="$tmp/broker"
  dedup=()
  where="the embedded broker in $url"
fi

# The pipeline. Concurrency flips between 8 and 9 on each reload.
mkdir -p "$tmp/p"
concurrency=8
save_pipeline() {
  cat >"$tmp/p/.soak.yaml.tmp" <<YAML
version: 1
exchanges:
  soak: {type: topic}
queues:
  work:
    bind: [{exchange: soak, routing_key: "#"}]
    concurrency: $concurrency
    handler:
      webhook: {url: "http://127.0.0.1:$rport/hook", timeout: 5s}
    retry: {max_attempts: 6, initial: 200ms, max: 2s}
YAML
  mv "$tmp/p/.soak.yaml.tmp" "$tmp/p/soak.yaml"
}
save_pipeline
"$sluice" run "$tmp/p" --broker "$url" "${dedup[@]}" --exit-when-idle --no-watch 2>"$tmp/declare.log" ||
  { cat "$tmp/declare.log" >&2; exit 1; }

start_runner() { # I
  "$sluice" run "$tmp/p" --broker "$url" "${dedup[@]}" >>"$tmp/runner-$1.log" 2>&1 &
  runners[$1]=$!
}

# The stream: a batch a second; confirmed keys to published.txt, the others to unconfirmed.txt.
stream() {
  local n=0 next now status
  next=$(now_ms)
  while [ ! -e "$tmp/stop" ]; do
    seq "$n" $((n + rate - 1)) | awk '{ printf "{\"k\": \"m%d\"}\n", $1 }' >"$tmp/batch.jsonl"
    n=$((n + rate))
    status=0
    timeout 60 "$sluice" publish --exchange soak --routing-key soak --type soak.event --jsonl "$tmp/batch.jsonl" \
      --broker "$url" --connect-timeout 5s >>"$tmp/publish.log" 2>&1 || status=$?
    if [ "$status" = 0 ]; then
      sed 's/.*"k": "\(m[0-9]*\)".*/\1/' "$tmp/batch.jsonl" >>"$tmp/published.txt"
    else
      echo "$(date -u +%H:%M:%S) publish exited $status" >>"$tmp/publish.log"
      sed 's/.*"k": "\(m[0-9]*\)".*/\1/' "$tmp/batch.jsonl" >>"$tmp/unconfirmed.txt"
    fi
    next=$((next + 1000))
    now=$(now_ms)
    [ "$now" -ge "$next" ] || sleep "$(awk -v ms=$((next - now)) 'BEGIN { printf "%.3f", ms / 1000 }')"
  done
}
: >"$tmp/published.txt"
: >"$tmp/unconfirmed.txt"

say "soak: $minutes min at $rate msg/s on $where; seed $seed; binary $sluice ($("$sluice" --version))"
start_runner 0
start_runner 1
stream &
publisher=$!

RANDOM=$seed
kills=0 reloads=0 outages=0 restarts=0 exited=0
restart_at=(0 0) down_until=0
actions=(kill kill kill reload reload reload outage outage)
[ "$broker" = rabbitmq ] && actions+=(restart)
end=$(($(now_ms) + minutes * 60000))
next_chaos=$(($(now_ms) + 2000 + RANDOM % 9000))
while :; do
  now=$(now_ms)
  [ "$now" -lt "$end" ] || break
  for i in 0 1; do
    if [ -n "${runners[i]}" ] && ! kill -0 "${runners[i]}" 2>/dev/null; then
      status=0
      wait "${runners[i]}" || status=$?
      say "runner $i exited on its own (status $status); starting it again"
      exited=$((exited + 1)) runners[i]="" restart_at[i]=$now
    fi
    if [ -z "${runners[i]}" ] && [ "$now" -ge "${restart_at[i]}" ]; then start_runner "$i"; fi
  done
  if [ "$down_until" -gt 0 ] && [ "$now" -ge "$down_until" ]; then
    receiver_post up
    down_until=0
  fi
  if [ "$now" -ge "$next_chaos" ]; then
    action=${actions[RANDOM % ${#actions[@]}]}
    case "$action" in
      kill)
        i=$((RANDOM % 2)) delay=$((RANDOM % 2001))
        if [ -n "${runners[i]}" ]; then
          kill -9 "${runners[i]}" 2>/dev/null || true
          wait "${runners[i]}" 2>/dev/null || true
          runners[i]="" restart_at[i]=$((now + delay)) kills=$((kills + 1))
          say "kill -9 runner $i (again in $delay ms)"
        fi
        ;;
      reload)
        concurrency=$((17 - concurrency))
        save_pipeline
        reloads=$((reloads + 1))
        say "reload (concurrency $concurrency)"
        ;;
      outage)
        length=$((2000 + RANDOM % 7001))
        if [ "$down_until" = 0 ]; then
          receiver_post down
          down_until=$((now + length)) outages=$((outages + 1))
          say "receiver outage for $length ms"
        fi
        ;;
      restart)
        t0=$(now_ms)
        node_stop
        node_start
        restarts=$((restarts + 1))
        say "broker restarted in $(($(now_ms) - t0)) ms"
        ;;
    esac
    next_chaos=$(($(now_ms) + 2000 + RANDOM % 9000))
  fi
  sleep 0.2
done

# The drain.
touch "$tmp/stop"
wait "$publisher" || true
publisher=""
[ "$down_until" = 0 ] || receiver_post up
for i in 0 1; do
  if [ -n "${runners[i]}" ] && ! kill -0 "${runners[i]}" 2>/dev/null; then
    wait "${runners[i]}" || true
    exited=$((exited + 1)) runners[i]=""
  fi
  [ -n "${runners[i]}" ] || start_runner "$i"
done
published=$(wc -l <"$tmp/published.txt")
say "stream over: $published published, $(wc -l <"$tmp/unconfirmed.txt") unconfirmed; draining"
drain_start=$SECONDS quiet_since=$SECONDS last_calls=-1
while :; do
  read -r ready waiting dead < <("$sluice" status "$tmp/p" --broker "$url" --format json 2>/dev/null |
    python3 -c 'import json, sys; s = json.load(sys.stdin); q = s["queues"][0]; print(q["ready"], s["retries_waiting"], q["dead_lettered"])' ||
    echo "- - -")
  read -r calls keys < <(curl -s "http://127.0.0.1:$rport/stats" | python3 -c 'import json, sys; s = json.load(sys.stdin); print(s["calls"], s["keys"])')
  if [ "$ready" = 0 ] && [ "$waiting" = 0 ]; then
    [ "$((keys + dead))" -lt "$published" ] || break
    [ "$calls" = "$last_calls" ] || quiet_since=$SECONDS
    if [ $((SECONDS - quiet_since)) -ge 60 ]; then
      say "nothing ready or waiting and no call for 60 s: $keys handled + $dead dead-lettered < $published published"
      break
    fi
  else
    quiet_since=$SECONDS
  fi
  last_calls=$calls
  if [ $((SECONDS - drain_start)) -ge 900 ]; then
    say "drain not finished after 900 s (ready $ready, waiting $waiting)"
    break
  fi
  sleep 1
done
say "drained in $((SECONDS - drain_start)) s"
for i in 0 1; do
  kill -TERM "${runners[i]}" 2>/dev/null || true
  wait "${runners[i]}" 2>/dev/null || true
  runners[i]=""
done

# The ledger.
curl -s "http://127.0.0.1:$rport/calls" >"$tmp/calls.json"
"$sluice" dlq list work --format json --pipelines "$tmp/p" --broker "$url" >"$tmp/dlq.json" 2>"$tmp/dlq.log" ||
  { cat "$tmp/dlq.log" >&2; exit 1; }
[ "$broker" = embedded ] || node_stop
errors=$(cat "$tmp"/runner-*.log | grep -c ' ERROR ' || true)
panics=$(cat "$tmp"/runner-*.log | grep -c 'panicked' || true)
status=0
python3 - "$tmp" "$sluice" "$url" <<'PY' || status=$?
import collections, json, subprocess, sys

tmp, sluice, url = sys.argv[1:4]
published = set(open(f"{tmp}/published.txt").read().split())
unconfirmed = set(open(f"{tmp}/unconfirmed.txt").read().split())
calls = json.load(open(f"{tmp}/calls.json"))
dlq = json.load(open(f"{tmp}/dlq.json"))

k_of = {}  # idempotency key (the envelope id) -> payload k
successes = collections.Counter()
for key, k, status, _ in calls:
    if k is not None:
        k_of[key] = k
    if status == 200:
        successes[k] += 1
handled = set(successes)

dead = {}  # k -> reason
unmapped = 0
for entry in dlq:
    k = k_of.get(entry.get("idempotency_key"))
    if k is None:  # never called: read its body
        shown = subprocess.run([sluice, "dlq", "show", "work", entry["id"], "--format", "json",
                                "--pipelines", f"{tmp}/p", "--broker", url],
                               capture_output=True, text=True)
        try:
            k = json.loads(shown.stdout)["body"]["payload"]["k"]
        except (ValueError, KeyError, TypeError):
            unmapped += 1
            continue
    dead[k] = entry.get("reason") or "-"

lost = sorted(published - handled - set(dead), key=lambda k: int(k[1:]))
reasons = collections.Counter(dead[k] for k in dead if k in published)
twice = {k: n for k, n in successes.items() if n > 1}
print(f"published (confirmed)      {len(published)}")
print(f"handled                    {len(handled & published)}")
print(f"dead-lettered              {sum(reasons.values())}"
      + "".join(f"; {r} {n}" for r, n in sorted(reasons.items())))
print(f"handled and dead-lettered  {len(handled & set(dead) & published)}")
print(f"lost                       {len(lost)}" + (f": {' '.join(lost[:50])}" if lost else ""))
print(f"handled twice              {len(twice)} keys, {sum(twice.values()) - len(twice)} extra calls"
      + (f": {' '.join(sorted(twice)[:20])}" if twice else ""))
print(f"unconfirmed publishes      {len(unconfirmed)} (of them handled {len(unconfirmed & handled)},"
      f" dead-lettered {len(unconfirmed & set(dead))})")
print(f"receiver calls             {len(calls)} ({sum(1 for c in calls if c[2] != 200)} answered 503)")
if unmapped:
    print(f"dead-lettered, unreadable  {unmapped}")
strays = handled - published - unconfirmed
if strays:
    print(f"handled, never published   {len(strays)}")
sys.exit(1 if lost else 0)
PY
echo "chaos: $kills runner kill -9s, $reloads reloads, $outages receiver outages, $restarts broker restarts;" \
  "runners that exited on their own: $exited; ERROR lines in the runners' logs: $errors; panics: $panics"
kept=$(realpath -m "$here/../target/soak-$broker-$seed")
rm -rf "$kept" && mkdir -p "$kept"
cp -a "$tmp"/*.log "$tmp"/*.txt "$tmp"/*.json "$tmp/p" "$kept/"
echo "seed $seed; the runners' logs, the receiver's calls and the dead letters are kept in $kept"
[ "$status" = 0 ] || echo "LOST MESSAGES (seed $seed)" >&2
exit "$status"
