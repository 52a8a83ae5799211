# Sourced by the bench scripts: a temporary directory, and the vhost, receiver and runner a
# bench starts, all removed when it exits (Ctrl-C included). Every bench uses a vhost of its
# own and deletes it: the broker is shared.
tmp=$(mktemp -d)
vhost="" receiver="" runner=""
bench_cleanup() {
  if [ -n "$runner" ]; then kill "$runner" 2>/dev/null || true; wait "$runner" 2>/dev/null || true; fi
  if [ -n "$receiver" ]; then kill "$receiver" 2>/dev/null || true; fi
  if [ -n "$vhost" ]; then rabbitmqctl -q delete_vhost "$vhost" >/dev/null 2>&1 || true; fi
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
