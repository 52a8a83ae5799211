# Sourced by the bench scripts: a temporary directory, and the vhost, JetStream prefix,
# receiver and runner a bench starts, all removed when it exits (Ctrl-C included). Every
# bench uses a vhost (or prefix) of its own and deletes it: the broker is shared.
tmp=$(mktemp -d)
scripts=$(dirname "$(realpath "${BASH_SOURCE[0]}")") # this directory, wherever a bench cds to
vhost="" nats_prefix="" receiver="" runner=""
nats=${NATS:-127.0.0.1:4222}
bench_cleanup() {
  if [ -n "$runner" ]; then kill "$runner" 2>/dev/null || true; wait "$runner" 2>/dev/null || true; fi
  if [ -n "$receiver" ]; then kill "$receiver" 2>/dev/null || true; fi
  if [ -n "$vhost" ]; then rabbitmqctl -q delete_vhost "$vhost" >/dev/null 2>&1 || true; fi
  if [ -n "$nats_prefix" ]; then "$scripts/nats-drop-prefix.py" "$nats_prefix" "$nats" >/dev/null 2>&1 || true; fi
  rm -rf "$tmp"
}
trap bench_cleanup EXIT
trap 'exit 130' INT TERM

# make_vhost NAME: a new vhost the guest user may use; sets vhost and url.
make_vhost() {
  vhost=$1
  rabbitmqctl -q add_vhost "$vhost" >/dev/null
  rabbitmqctl -q set_permissions -p "$vhost" guest '.*' '.*' '.*' >/dev/null
  url="amqp://guest:guest@127.0.0.1:5672/$vhost"
}

# drop_vhost: deletes the current vhost.
drop_vhost() { rabbitmqctl -q delete_vhost "$vhost" >/dev/null; vhost=""; }

# drop_nats_prefix PREFIX: deletes the streams of a JetStream deployment on $nats; fails when
# there were none (a run that made nothing measured nothing). A bench that runs in subshells
# sets nats_prefix to a pattern (`NAME-*`) for the exit to sweep.
drop_nats_prefix() {
  local dropped
  dropped=$("$scripts/nats-drop-prefix.py" "$1" "$nats")
  if [ "$dropped" -eq 0 ]; then echo "no streams under prefix $1" >&2; return 1; fi
}

# free_port: a TCP port free on 127.0.0.1 now.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# bench_pipeline DIR PORT: DIR/p.yaml, one webhook queue bench.work (bound to exchange bench,
# routing key work; concurrency 50, idempotency on) calling http://127.0.0.1:PORT/hook.
bench_pipeline() {
  mkdir -p "$1"
  cat >"$1/p.yaml" <<YAML
version: 1
exchanges:
  bench: {type: topic}
queues:
  bench.work:
    bind: [{exchange: bench, routing_key: work}]
    concurrency: 50
    handler:
      webhook: {url: "http://127.0.0.1:$2/hook"}
YAML
}

# happy_path SLUICE MESSAGES: the happy path of bench-ab.sh and profile-happy-path.sh: a
# `sluice demo-receiver` (receiver, port), the pipeline $tmp/p (one webhook queue, concurrency
# 50, idempotency on; a quorum queue on RabbitMQ), the same with idempotency off in
# $tmp/p-off, and MESSAGES payloads in $tmp/m.jsonl.
happy_path() {
  port=$(free_port)
  "$1" demo-receiver --listen "127.0.0.1:$port" >/dev/null &
  receiver=$!
  bench_pipeline "$tmp/p" "$port"
  mkdir -p "$tmp/p-off"
  sed 's/^    handler:/    idempotency: {enabled: false}\n    handler:/' "$tmp/p/p.yaml" >"$tmp/p-off/p.yaml"
  python3 -c "
import json
with open('$tmp/m.jsonl', 'w') as f:
    for i in range($2): f.write(json.dumps({'n': i, 'pad': 'x' * 100}) + '\n')"
}
