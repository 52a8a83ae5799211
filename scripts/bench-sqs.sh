#!/usr/bin/env bash
# Issue 36's performance goal: sluice's webhook pipeline on SQS beside a hand-written consumer
# (scripts/bench-sqs-consumer.py: boto3, long poll, receive and delete 10 at a time, the same
# 50 workers and receiver), on a moto server of the bench's own. For each run, MESSAGES are
# published with `sluice publish --jsonl` to a fresh prefix (not timed), then one side drains
# the queue, timed as a whole process (the hand-written consumer waits 2 s idle at its end,
# `--exit-when-idle` about 0.75 s: both subtracted from nothing, so the ratio slightly favours
# sluice on small MESSAGES). The sides alternate. Requests per message are moto's own count of
# requests during the drain (on AWS, that is the bill). Medians and their ratio come last.
#
#   scripts/bench-sqs.sh SLUICE [MESSAGES] [RUNS]   # defaults: 1000 3
set -euo pipefail
cd "$(dirname "$0")/.."
sluice=$(realpath "$1") messages=${2:-1000} runs=${3:-3}
source scripts/bench-lib.sh
moto_port=$(free_port)
moto_server -H 127.0.0.1 -p "$moto_port" >"$tmp/moto.log" 2>&1 &
moto=$!
trap 'kill $moto 2>/dev/null || true; bench_cleanup' EXIT
endpoint="http://127.0.0.1:$moto_port"
for _ in $(seq 100); do (exec 3<>"/dev/tcp/127.0.0.1/$moto_port") 2>/dev/null && break; sleep 0.1; done
happy_path "$sluice" "$messages"
export AWS_ACCESS_KEY_ID=bench AWS_SECRET_ACCESS_KEY=bench
requests() { grep -c '"POST / ' "$tmp/moto.log" || true; }
side() { # NAME RUN
  local prefix="b$2$1" url
  url="sqs://us-east-1/$prefix?endpoint=$endpoint"
  timeout 60 "$sluice" run "$tmp/p" --broker "$url" --dedup "$tmp/state-$prefix" --exit-when-idle >/dev/null 2>&1
  "$sluice" publish --exchange bench --routing-key work --type bench --jsonl "$tmp/m.jsonl" --broker "$url" >/dev/null 2>&1
  local before start end
  before=$(requests)
  start=$(date +%s.%N)
  if [ "$1" = sluice ]; then
    "$sluice" run "$tmp/p" --broker "$url" --dedup "$tmp/state-$prefix" --exit-when-idle >/dev/null 2>&1
  else
    python3 scripts/bench-sqs-consumer.py "$endpoint" "$endpoint/123456789012/$prefix-bench-work" \
      "http://127.0.0.1:$port/hook" 50
  fi
  end=$(date +%s.%N)
  python3 -c "print(f'$1 run $2: {$messages/($end-$start):.0f} msg/s, {($(requests)-$before)/$messages:.2f} requests/message, load {open(\"/proc/loadavg\").read().split()[0]}')"
}
for run in $(seq "$runs"); do
  side handwritten "$run" | tee -a "$tmp/results"
  side sluice "$run" | tee -a "$tmp/results"
done
python3 - "$tmp/results" <<'PY'
import statistics, sys
rates = {}
for line in open(sys.argv[1]):
    name, _, _, rate = line.split()[:4]
    rates.setdefault(name, []).append(float(rate))
h, s = statistics.median(rates["handwritten"]), statistics.median(rates["sluice"])
print(f"medians: hand-written {h:.0f} msg/s, sluice {s:.0f} msg/s: sluice {s / h:.2f}x")
PY
