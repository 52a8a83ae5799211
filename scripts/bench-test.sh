#!/usr/bin/env bash
# `sluice test` on 200 test cases (issue 14): writes a pipeline (topic exchange, two webhook
# queues, a payload schema) and one test file of 200 tests that route, render, compare a
# request and classify a simulated answer, then times RUNS whole runs of the binary.
# Usage: scripts/bench-test.sh [path/to/sluice]   (default target/release/sluice)
set -euo pipefail
sluice=$(realpath "${1:-target/release/sluice}")
runs=${RUNS:-21}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cat > "$dir/schema.json" <<'JSON'
{"type": "object", "required": ["id"], "properties": {"id": {"type": "integer", "minimum": 0}}}
JSON
cat > "$dir/p.yaml" <<'YAML'
version: 1
exchanges:
  orders: {type: topic}
queues:
  charge:
    bind: [{exchange: orders, routing_key: "order.*"}]
    payload_schema: schema.json
    handler:
      webhook:
        url: "http://127.0.0.1:9/charge/{{payload.id}}"
        headers: {X-Kind: "{{type}}"}
        body: '{"id": {{json payload.id}}, "attempt": {{attempt}}}'
  audit:
    bind: [{exchange: orders, routing_key: "#"}]
    handler:
      webhook: {url: "http://127.0.0.1:9/audit", body: "{{json payload}}"}
YAML
{
  echo "version: 1"
  echo "tests:"
  for i in $(seq 0 199); do
    if (( i % 2 )); then status=503; outcome=retry; else status=200; outcome=success; fi
    cat <<YAML
  - name: order $i
    message: {exchange: orders, routing_key: order.created, payload: {id: $i}}
    responses: {charge: {status: $status}}
    expect:
      queues: [audit, charge]
      requests: {charge: {url: "http://127.0.0.1:9/charge/$i", headers: {X-Kind: order.created}, body: {id: $i, attempt: 1}}}
      outcomes: {charge: $outcome, audit: success}
YAML
  done
} > "$dir/t.test.yaml"
"$sluice" test "$dir" | tail -1
times=()
for _ in $(seq "$runs"); do
  start=$(date +%s%N)
  "$sluice" test "$dir" > /dev/null
  times+=($(( ($(date +%s%N) - start) / 1000000 )))
done
sorted=$(printf '%s\n' "${times[@]}" | sort -n)
echo "runs: $runs; ms: min $(echo "$sorted" | head -1), median $(echo "$sorted" | sed -n "$(( (runs + 1) / 2 ))p"), max $(echo "$sorted" | tail -1)"
