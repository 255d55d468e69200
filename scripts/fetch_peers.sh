#!/usr/bin/env bash
# Fetch the peer code the benchmarks measure against into .peers/ (git-ignored; never committed).
# Run where PyPI is reachable; carry .peers/ along to a GPU machine without network.
#   scripts/fetch_peers.sh            # SGLang's serial tree verifier from PyPI, then check .peers/sglang-main/
#   scripts/fetch_peers.sh --check    # only check .peers/sglang-main/ (exit 1 when incomplete)
#   scripts/fetch_peers.sh --help     # this text, with how .peers/sglang-main/ is fetched by hand
# Docs: shared/peers/README.md. Tests that need a peer skip with a reason when it is absent.
#
# .peers/sglang/ (scripts/fetch_peers.sh does it): fused_recurrent.py out of the sglang==0.5.23 wheel.
#
# .peers/sglang-main/ (by hand: this script cannot do it): SGLang's two development-tree closed-form
# tree verifiers, in no release, so single files of the sgl-project/sglang repository, folder
# python/sglang/srt/layers/attention/fla/. They are read with the agent search tool's read_file
# (repo sgl-project/sglang, path, commit), which is a tool of the agent sessions, not a shell
# command: call it with offset 0, then again with each answer's next_offset until next_offset is
# null, concatenate the pages' text, and save it verbatim (UTF-8, nothing reformatted) as the
# file's base name in .peers/sglang-main/. A page's length is its characters, so the saved file's
# character count must equal the answer's total_chars. The files and commits:
#   chunk_tree_verify.py   bab5e472a2685d86c15d811a4320f014b5052fd5   (the chunk verifier)
#   op.py, index.py, l2norm.py, wy_fast.py   what chunk_tree_verify.py imports; not stored at
#       bab5e472: take the stored version (read_file without commit names it; find_files with repo
#       and path lists them) and say which in SOURCE
#   utils.py               kept for reference only; benchmarks/peers_dev.py stands in for it
#   gdn_tree_fused.py, gdn_tree_triton.py   205c2b55f3dcd2cc53d44a0f63ee6c74ab4e743f (the fused verifier)
# Then write .peers/sglang-main/SOURCE, one line per file: "<file> <commit> <sha256> <note>", lines
# starting with # ignored (sha256sum <file> gives the checksum). On the agents' machines the folder
# lives in /work/main/.peers/sglang-main/ (it travels to the GPU machine from there); a worktree
# links to it. benchmarks/peers_dev.py loads the files (README there).
set -euo pipefail
cd "$(dirname "$0")/.."
DEV=.peers/sglang-main
DEV_FILES="chunk_tree_verify.py op.py index.py l2norm.py wy_fast.py gdn_tree_fused.py gdn_tree_triton.py"

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

check_dev() {  # prints what is there and what is missing; returns 1 when incomplete
  local missing=() bad=() f c h rest
  [ -f "$DEV/SOURCE" ] || missing+=(SOURCE)
  for f in $DEV_FILES; do [ -f "$DEV/$f" ] || missing+=("$f"); done
  if [ -f "$DEV/SOURCE" ]; then
    while read -r f c h rest; do
      case "$f" in ''|'#'*) continue ;; esac
      [ -f "$DEV/$f" ] || continue
      [ "$(sha256sum "$DEV/$f" | cut -d' ' -f1)" = "$h" ] || bad+=("$f")
    done < "$DEV/SOURCE"
    for f in $DEV_FILES; do
      grep -q "^$f " "$DEV/SOURCE" || bad+=("$f (no SOURCE line)")
    done
  fi
  if [ ${#missing[@]} -eq 0 ] && [ ${#bad[@]} -eq 0 ]; then
    echo "$DEV/: complete ($(grep -vc '^#' "$DEV/SOURCE") files, checksums match SOURCE)"
    return 0
  fi
  [ ${#missing[@]} -eq 0 ] || echo "$DEV/: missing ${missing[*]} (the chunk/fused peers' tests and columns skip; fetch by hand: $0 --help)"
  [ ${#bad[@]} -eq 0 ] || echo "$DEV/: not as in SOURCE: ${bad[*]} (re-read them verbatim: $0 --help)"
  return 1
}

case "${1:-}" in
  -h|--help) usage; exit 0 ;;
  --check) check_dev; exit $? ;;
  "") ;;
  *) echo "unknown argument $1 (see $0 --help)" >&2; exit 2 ;;
esac

check_dev || true  # optional: never fails the fetch below

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
