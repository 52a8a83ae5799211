#!/bin/sh
# Example command handler: pretends to make a thumbnail. Exit 65 (EX_DATAERR) on a bad size,
# which the pipeline marks permanent; any other failure is retried.
set -eu
image_id="$1"; size="$3"
case "$size" in
  ''|*[!0-9]*) echo "size must be a number, got '$size'" >&2; exit 65 ;;
esac
mkdir -p "${OUT_DIR:-/tmp/sluice-thumbnails}"
echo "$SLUICE_IDEMPOTENCY_KEY attempt=$SLUICE_ATTEMPT image=$image_id size=$size" >> "${OUT_DIR:-/tmp/sluice-thumbnails}/done.log"
