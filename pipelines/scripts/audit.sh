#!/bin/sh
# The audit handler of pipelines/orders.yaml: appends one line per order event to $AUDIT_LOG.
# argv: the order id. stdin: the message envelope (JSON). Exit 65 (EX_DATAERR, permanent in
# the pipeline) when there is no order id; any other failure is retried.
set -eu
order_id="${1:-}"
[ -n "$order_id" ] || { echo "no order id" >&2; exit 65; }
envelope=$(cat)
echo "$(date -u +%Y-%m-%dT%H:%M:%SZ) order=$order_id attempt=$SLUICE_ATTEMPT key=$SLUICE_IDEMPOTENCY_KEY bytes=${#envelope}" >> "${AUDIT_LOG:-/tmp/sluice-audit.log}"
