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
# redis://127.0.0.1:6379, a fresh key prefix per run, the keys beside the messages), jetstream
# (NATS JetStream at $NATS, default 127.0.0.1:4222: a fresh `?prefix=` per run, its streams
# deleted after by scripts/nats-drop-prefix.py; the idempotency keys in the run's state
# directory). --rabbitmq is --broker quorum.
#
# A side written EXE@baseline times the hand-written consumer EXE instead of `sluice run` on
# the same backlog, declared and published by the other side's sluice: on jetstream
# benches/baseline_nats_consumer.rs (add @double-ack for acks the server confirms, as
# sluice's are), on quorum or classic benches/baseline_consumer.rs; prefetch/concurrency 50.
# Build them with `cargo bench --no-run --bench baseline_nats_consumer` (it prints the path;
# it rebuilds target/release/sluice with test features, so copy the release binary first):
#
#   scripts/bench-ab.sh --broker jetstream BASELINE_EXE@baseline target/release/sluice
#
#   scripts/bench-ab.sh [--broker KIND] OLD_SLUICE[@off][@KIND] NEW_SLUICE[@off][@KIND] [MESSAGES] [RUNS]   # defaults: 30000 5
set -euo pipefail
cd "$(dirname "$0")/.."
kind=embedded
case ${1:-} in
  --rabbitmq) kind=quorum; shift ;;
  --broker) kind=$2; shift 2 ;;
esac
known() { case $1 in embedded | quorum | classic | redis | jetstream) ;; *) echo "a broker is embedded, quorum, classic, redis or jetstream, not $1" >&2; exit 2 ;; esac; }
known "$kind"
side() { # SPEC -> "binary pipeline kind consumer"
  local binary=${1%%@*} pipeline=p side_kind=$kind consumer=sluice tag
  IFS=@ read -ra tags <<<"${1#"$binary"}"
  for tag in "${tags[@]}"; do
    case $tag in
      "") ;;
      off) pipeline=p-off ;;
      baseline) consumer=baseline ;;
      double-ack) consumer=baseline-double-ack ;;
      *) known "$tag"; side_kind=$tag ;;
    esac
  done
  case $consumer@$side_kind in
    sluice@* | baseline@quorum | baseline@classic | baseline*@jetstream) ;;
    *) echo "$1: a hand-written baseline runs on jetstream (@double-ack too) or quorum/classic" >&2; exit 2 ;;
  esac
  echo "$(realpath "$binary") $pipeline $side_kind $consumer"
}
read -r old old_pipeline old_kind old_consumer < <(side "$1")
read -r new new_pipeline new_kind new_consumer < <(side "$2")
if [[ $old_consumer != sluice && $new_consumer != sluice ]]; then
  echo "one side must be sluice: it declares and publishes the baseline's backlog" >&2
  exit 2
fi
messages=${3:-30000}
runs=${4:-5}
redis=${REDIS:-redis://127.0.0.1:6379}
source scripts/bench-lib.sh
# Runs happen in subshells: what one left (interrupted) is swept at the exit.
[[ $old_kind == jetstream || $new_kind == jetstream ]] && nats_prefix="sluice-bench-ab-$$-*"
# The sluice that declares and publishes every backlog (a baseline's too).
publisher=$new
[[ $new_consumer != sluice ]] && publisher=$old

happy_path "$publisher" "$messages"
# A classic queue's pipelines, beside the quorum (default) ones.
for pipeline in p p-off; do
  mkdir -p "$tmp/$pipeline-classic"
  sed 's/^    concurrency:/    type: classic\n    concurrency:/' "$tmp/$pipeline/p.yaml" >"$tmp/$pipeline-classic/p.yaml"
done

# run_once BINARY PIPELINE KIND CONSUMER: prints messages/s, CPU seconds (user + system) and
# peak RSS (MiB) of one drain, by `BINARY run` (CONSUMER sluice) or by the hand-written
# consumer BINARY (a baseline; $publisher declares and publishes).
run_once() {
  local dir broker=() kind=$3 consumer=$4 publish=$1 name
  dir=$(mktemp -d "$tmp/run.XXXX")
  name=sluice-bench-ab-$$-${dir##*.}
  [[ $kind == classic ]] && set -- "$1" "$2-classic" "$3" "$4"
  [[ $consumer != sluice ]] && publish=$publisher
  case $kind in
    quorum | classic)
      make_vhost "$name"
      broker=(--broker "$url") ;;
    redis) broker=(--broker "$redis/?prefix=$name:") ;;
    jetstream) broker=(--broker "nats://$nats?prefix=$name") ;;
  esac
  (cd "$dir" && "$publish" run "$tmp/$2" "${broker[@]}" --exit-when-idle 2>/dev/null &&
    "$publish" publish "${broker[@]}" --exchange bench --routing-key work --type t --jsonl "$tmp/m.jsonl" >/dev/null 2>&1)
  # The baselines: prefetch/concurrency 50; on JetStream, sluice's durable consumer of the
  # queue's stream (a work-queue stream takes one consumer).
  local start end timed=("$1" run "$tmp/$2" "${broker[@]}" --exit-when-idle) hook="http://127.0.0.1:$port/hook"
  case $consumer@$kind in
    baseline@quorum | baseline@classic) timed=("$1" "$url" bench.work 50 "$messages" --webhook "$hook") ;;
    baseline*@jetstream) timed=("$1" "nats://$nats" "${name}_q_$(printf bench.work | xxd -p -c 256)" sluice 50 "$messages" --webhook "$hook") ;;
  esac
  [[ $consumer == baseline-double-ack ]] && timed+=(--double-ack)
  start=$(date +%s.%N)
  (cd "$dir" && /usr/bin/time -f "%U %S %M" -o "$dir/time" "${timed[@]}" >/dev/null 2>&1)
  end=$(date +%s.%N)
  case $kind in
    quorum | classic) drop_vhost ;;
    redis) redis-cli -u "$redis" --scan --pattern "$name:*" | xargs -r redis-cli -u "$redis" del >/dev/null ;;
    jetstream) drop_nats_prefix "$name" ;;
  esac
  python3 -c "u, s, m = open('$dir/time').read().split(); print(round($messages / ($end - $start)), round(float(u) + float(s), 2), round(int(m) / 1024))"
  rm -rf "$dir"
}

echo "old: $old ($old_pipeline, $old_kind, $old_consumer); new: $new ($new_pipeline, $new_kind, $new_consumer); load average $(cut -d' ' -f1-3 /proc/loadavg)"
results=()
for i in $(seq "$runs"); do
  for build in old new; do
    binary=$old pipeline=$old_pipeline side_kind=$old_kind consumer=$old_consumer
    [[ $build == new ]] && binary=$new pipeline=$new_pipeline side_kind=$new_kind consumer=$new_consumer
    read -r rate cpu rss < <(run_once "$binary" "$pipeline" "$side_kind" "$consumer")
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
