#!/usr/bin/env bash
# The happy path of two sluice builds side by side (issue 24's "no regression" check, issue
# 33's goals): for each run, a fresh broker, one webhook queue (concurrency 50, idempotency on)
# to `sluice demo-receiver`, MESSAGES published with `publish --jsonl`, then `run
# --exit-when-idle` timed as a whole process. The sides alternate; the ratios of the medians
# come last. A side written BINARY@off runs the same pipeline with idempotency off, so
# `bench-ab.sh B@off B` is what idempotency costs.
#
# --broker: embedded (a fresh directory per run, the default), quorum or classic (a queue of
# that type on RabbitMQ at 127.0.0.1:5672, a fresh vhost per run, the idempotency keys in the
# run's state directory), redis (Redis at $REDIS, default redis://127.0.0.1:6379, a fresh key
# prefix per run, the keys beside the messages). --rabbitmq is --broker quorum.
#
#   scripts/bench-ab.sh [--broker KIND] OLD_SLUICE[@off] NEW_SLUICE[@off] [MESSAGES] [RUNS]   # defaults: 30000 5
set -euo pipefail
cd "$(dirname "$0")/.."
kind=embedded
case ${1:-} in
  --rabbitmq) kind=quorum; shift ;;
  --broker) kind=$2; shift 2 ;;
esac
case $kind in embedded | quorum | classic | redis) ;; *) echo "--broker: embedded, quorum, classic or redis" >&2; exit 2 ;; esac
side() { # SPEC -> "binary pipeline"
  local binary=${1%@off} pipeline=p
  [[ $1 == *@off ]] && pipeline=p-off
  echo "$(realpath "$binary") $pipeline"
}
read -r old old_pipeline < <(side "$1")
read -r new new_pipeline < <(side "$2")
messages=${3:-30000}
runs=${4:-5}
redis=${REDIS:-redis://127.0.0.1:6379}
source scripts/bench-lib.sh

queue_type=""
[[ $kind == classic ]] && queue_type=classic
happy_path "$new" "$messages" "$queue_type"

# run_once BINARY PIPELINE: prints messages/s, CPU seconds (user + system) and peak RSS (MiB)
# of one drain.
run_once() {
  local dir broker=()
  dir=$(mktemp -d "$tmp/run.XXXX")
  case $kind in
    quorum | classic)
      make_vhost "sluice-bench-ab-$$-${dir##*.}"
      broker=(--broker "$url") ;;
    redis) broker=(--broker "$redis/?prefix=sluice-bench-ab-$$-${dir##*.}:") ;;
  esac
  (cd "$dir" && "$1" run "$tmp/$2" "${broker[@]}" --exit-when-idle 2>/dev/null &&
    "$1" publish "${broker[@]}" --exchange bench --routing-key work --type t --jsonl "$tmp/m.jsonl" >/dev/null 2>&1)
  local start end
  start=$(date +%s.%N)
  (cd "$dir" && /usr/bin/time -f "%U %S %M" -o "$dir/time" "$1" run "$tmp/$2" "${broker[@]}" --exit-when-idle 2>/dev/null)
  end=$(date +%s.%N)
  case $kind in
    quorum | classic) drop_vhost ;;
    redis) redis-cli -u "$redis" --scan --pattern "sluice-bench-ab-$$-${dir##*.}:*" | xargs -r redis-cli -u "$redis" del >/dev/null ;;
  esac
  python3 -c "u, s, m = open('$dir/time').read().split(); print(round($messages / ($end - $start)), round(float(u) + float(s), 2), round(int(m) / 1024))"
  rm -rf "$dir"
}

echo "broker $kind; old: $old ($old_pipeline); new: $new ($new_pipeline); load average $(cut -d' ' -f1-3 /proc/loadavg)"
results=()
for i in $(seq "$runs"); do
  for build in old new; do
    binary=$old pipeline=$old_pipeline
    [[ $build == new ]] && binary=$new pipeline=$new_pipeline
    read -r rate cpu rss < <(run_once "$binary" "$pipeline")
    printf '%s run %d: %6d messages/s, %5.2f CPU s, %4d MiB peak RSS\n' "$build" "$i" "$rate" "$cpu" "$rss"
    results+=("$build $rate $cpu $rss")
  done
done
echo "load average at the end $(cut -d' ' -f1-3 /proc/loadavg)"
kill "$receiver"
printf '%s\n' "${results[@]}" | python3 -c "
import sys, statistics as st
rows = [l.split() for l in sys.stdin]
med = lambda b, i: st.median(float(r[i]) for r in rows if r[0] == b)
olds = [float(r[1]) for r in rows if r[0] == 'old']
news = [float(r[1]) for r in rows if r[0] == 'new']
print(f'median: old {med(\"old\", 1):.0f} msg/s, {med(\"old\", 2):.2f} CPU s, {med(\"old\", 3):.0f} MiB; new {med(\"new\", 1):.0f} msg/s, {med(\"new\", 2):.2f} CPU s, {med(\"new\", 3):.0f} MiB')
print('per-run new / old: ' + ', '.join(f'{n / o:.2f}' for o, n in zip(olds, news)))
print(f'throughput new / old {med(\"new\", 1) / med(\"old\", 1):.3f}; CPU per message new / old {med(\"new\", 2) / med(\"old\", 2):.3f}; peak RSS new / old {med(\"new\", 3) / med(\"old\", 3):.3f}')"
