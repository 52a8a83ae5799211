#!/usr/bin/env bash
# Benchmarks sluice; the method and the latest figures are in BENCHMARKS.md.
#
#   scripts/bench.sh                 # everything (about 13 minutes on 2 cores)
#   scripts/bench.sh --quick         # tiny sizes, one run: checks the harness, figures mean nothing
#   scripts/bench.sh --no-validate --only throughput --runs 5    # options after ours go to the driver
#
# Parts: the drain driver (benches/drain/, against the hand-written consumer in
# benches/baseline_consumer.rs) and `sluice validate` on 1,000 generated pipeline files.
# Needs RabbitMQ at 127.0.0.1:5672 (guest/guest), rabbitmqctl, jq; hyperfine if installed;
# for `--queues redis`, Redis at 127.0.0.1:6379 (or `--redis URL`).
# Results go to target/bench/ (a Markdown summary and raw JSON per run), or under
# $CARGO_TARGET_DIR when that is set.
set -euo pipefail
cd "$(dirname "$0")/.."

drain=1 validate=1 driver_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) driver_args+=(--messages 2000 --runs 1 --other-runs 1 --retry-messages 1000 --command-messages 500 --backlog 5000) ;;
    --no-drain) drain=0 ;;
    --no-validate) validate=0 ;;
    *) driver_args+=("$1") ;;
  esac
  shift
done

target=${CARGO_TARGET_DIR:-target}
out=$target/bench
stamp=$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$out"

cargo build --release --bin sluice
# `cargo bench` below builds the binary again with dev-dependency features unified in;
# measure the plain release build.
cp "$target/release/sluice" "$out/sluice"

if [ "$drain" = 1 ]; then
  declare -A exe
  while IFS='=' read -r name path; do exe[$name]=$path; done < <(
    cargo bench --no-run --bench baseline_consumer --bench drain --message-format=json |
      jq -r 'select(.reason == "compiler-artifact" and .executable != null) | "\(.target.name)=\(.executable)"'
  )
  "${exe[drain]}" --baseline "${exe[baseline_consumer]}" --sluice "$out/sluice" \
    --json "$out/drain-$stamp.json" "${driver_args[@]}" | tee "$out/drain-$stamp.md"
fi

# 1,000 files, one exchange and one queue each, with templates in the URL, a header, the body
# and the idempotency key: the shape of a real pipeline directory, just many of them.
generate_pipelines() {
  local count=$1 dir=$2 i
  for ((i = 0; i < count; i++)); do
    cat >"$dir/p$i.yaml" <<YAML
version: 1
exchanges:
  ex$i: {type: topic}
queues:
  q$i.work:
    type: quorum
    bind: [{exchange: ex$i, routing_key: "order.*"}]
    concurrency: 8
    handler:
      webhook:
        url: "https://hooks.internal/q$i/{{payload.order_id}}"
        headers: {X-Order: "{{payload.order_id}}"}
        body: "{{json payload}}"
        timeout: 10s
    retry: {max_attempts: 5, initial: 1s, max: 5m}
    idempotency: {key: "q$i:{{payload.order_id}}", ttl: 24h}
YAML
  done
}

if [ "$validate" = 1 ]; then
  files=1000
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  generate_pipelines "$files" "$tmp"
  "$out/sluice" validate "$tmp" # must succeed, or the timing below measures an error path
  echo
  echo "## sluice validate on $files files"
  echo
  if command -v hyperfine >/dev/null; then
    hyperfine --warmup 3 --runs 20 --export-json "$out/validate-$stamp.json" "$out/sluice validate $tmp" >&2
    jq -r '.results[0] | "median \(.median * 1000 | floor) ms (min \(.min * 1000 | floor), max \(.max * 1000 | floor), \(.times | length) runs, hyperfine)"' \
      "$out/validate-$stamp.json" | tee -a "$out/drain-$stamp.md"
  else
    times=()
    for _ in $(seq 20); do
      start=$(date +%s%N)
      "$out/sluice" validate "$tmp" 2>/dev/null
      times+=($((($(date +%s%N) - start) / 1000000)))
    done
    sorted=$(printf '%s\n' "${times[@]}" | sort -n)
    echo "median $(sed -n 10p <<<"$sorted") ms (min $(head -1 <<<"$sorted"), max $(tail -1 <<<"$sorted"), 20 runs, shell loop)" |
      tee -a "$out/drain-$stamp.md"
  fi
fi
