#!/usr/bin/env bash
# Fetch the peer code the benchmarks measure against into .peers/ (git-ignored; never committed).
# Run where PyPI is reachable; carry .peers/ along to a GPU machine without network.
#   scripts/fetch_peers.sh            # SGLang's serial tree verifier for GDN (docs: shared/peers/README.md)
set -euo pipefail
cd "$(dirname "$0")/.."
SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"
PY="${PY:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
DEST=.peers/sglang
WANT=sglang/kernels/ops/attention/fla/fused_recurrent.py
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

"$PY" -m pip download --quiet --no-deps --dest "$TMP" "sglang==${SGLANG_VERSION}"
WHEEL="$(ls "$TMP"/sglang-*.whl)"
# The path has moved between releases: fall back to whichever file defines the tree verifier.
if ! unzip -l "$WHEEL" "$WANT" >/dev/null 2>&1; then
  mkdir -p "$TMP/x" && unzip -q "$WHEEL" 'sglang/*.py' -d "$TMP/x"
  WANT="$(cd "$TMP/x" && grep -rl 'def fused_recurrent_gated_delta_rule_update' sglang | head -1)"
  [ -n "$WANT" ] || { echo "no file defines fused_recurrent_gated_delta_rule_update in $WHEEL" >&2; exit 1; }
fi
mkdir -p "$DEST"
unzip -o -q -j "$WHEEL" "$WANT" -d "$DEST"
printf 'sglang==%s\n%s\n' "$SGLANG_VERSION" "$WANT" > "$DEST/SOURCE"
echo "fetched $WANT from $(basename "$WHEEL") into $DEST/"
