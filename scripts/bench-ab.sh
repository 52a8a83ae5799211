#!/usr/bin/env bash
# The happy path of two sluice builds side by side (issue 24's "no regression" check, issue
# 33's goals): for each run, a fresh broker, one webhook queue (concurrency 50, idempotency on)
# to `sluice demo-receiver`, MESSAGES published with `publish --jsonl`, then `run
# --exit-when-idle` timed as a whole process. The sides alternate; the ratios of the medians
# come last. A side written BINARY@off runs the same pipeline with idempotency off, so
# `bench-ab.sh B@off B` is what idempotency costs; BINARY@KIND runs that side on another
# broker, so `bench-ab.sh --broker redis B@quorum B` puts Redis beside a quorum queue.
#
# KIND (--broker, or a side's own): embedded (a fresh directory per run, the default), quorum
# or classic (a queue of that type on RabbitMQ at 127.0.0.1:5672, a fresh vhost per run, the
# idempotency keys in the run's state directory), redis (Redis at $REDIS, default
# redis://127.0.0.1:6379, a fresh key prefix per run, the keys beside the messages).
# --rabbitmq is --broker quorum.
#
#   scripts/bench-ab.sh [--broker KIND] OLD_SLUICE[@off][@KIND] NEW_SLUICE[@off][@KIND] [MESSAGES] [RUNS]   # defaults: 30000 5
set -euo pipefail
cd "$(dirname "$0")/.."
kind=embedded
case ${1:-} in
  --rabbitmq) kind=quorum; shift ;;
  --broker) kind=$2; shift 2 ;;
esac
known() { case $1 in embedded | quorum | classic | redis) ;; *) echo "a broker is embedded, quorum, classic or redis, not $1" >&2; exit 2 ;; esac; }
known "$kind"
side() { # SPEC -> "binary pipeline kind"
  local binary=${1%%@*} pipeline=p side_kind=$kind tag
  IFS=@ read -ra tags <<<"${1#"$binary"}"
  for tag in "${tags[@]}"; do
    case $tag in "") ;; off) pipeline=p-off ;; *) known "$tag"; side_kind=$tag ;; esac
  done
  echo "$(realpath "$binary") $pipeline $side_kind"
}
read -r old old_pipeline old_kind < <(side "$1")
read -r new new_pipeline new_kind < <(side "$2")
messages=${3:-30000}
runs=${4:-5}
redis=${REDIS:-redis://127.0.0.1:6379}
source scripts/bench-lib.sh

happy_path "$new" "$messages"
# A classic queue's pipelines, beside the quorum (default) ones.
for pipeline in p p-off; do
  mkdir -p "$tmp/$pipeline-classic"
  sed 's/^    concurrency:/    type: classic\n    concurrency:/' "$tmp/$pipeline/p.yaml" >"$tmp/$pipeline-classic/p.yaml"
done

# run_once BINARY PIPELINE KIND: prints messages/s, CPU seconds (user + system) and peak RSS
# (MiB) of one drain.
run_once() {
  local dir broker=() kind=$3
  dir=$(mktemp -d "$tmp/run.XXXX")
  [[ $kind == classic ]] && set -- "$1" "$2-classic" "$3"
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

echo "old: $old ($old_pipeline, $old_kind); new: $new ($new_pipeline, $new_kind); load average $(cut -d' ' -f1-3 /proc/loadavg)"
results=()
for i in $(seq "$runs"); do
  for build in old new; do
    binary=$old pipeline=$old_pipeline side_kind=$old_kind
    [[ $build == new ]] && binary=$new pipeline=$new_pipeline side_kind=$new_kind
    read -r rate cpu rss < <(run_once "$binary" "$pipeline" "$side_kind")
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
