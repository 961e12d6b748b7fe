#!/usr/bin/env bash
# Keep the working tree that a device call sends under its 64 MiB limit.
# The tree (tracked files) is ~18 MB, most of it bench/results; the cute bundle is ~55 MB, so
# a kernel or vLLM call with .gpu/cute carried is refused ("larger than 64 MiB").  The old
# result folders are not needed on the GPU host, so leave them out of the working tree
# with git's sparse checkout while calls are made, and put them back afterwards:
#   bash scripts/device_tree.sh trim      # before device calls
#   bash scripts/device_tree.sh restore   # after them
#   bash scripts/device_tree.sh size      # bytes the tracked, present files take
# Sparse checkout marks the left-out files skip-worktree: `git status` stays clean and
# `git add -A` stages no deletion, so a commit made while trimmed loses nothing.  Result
# folders of the newest KEEP dates (default 2) stay in the tree.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
keep=${KEEP:-2}
size() {
  git ls-files -z | while IFS= read -r -d '' f; do [ -f "$f" ] && stat -c %s "$f"; done \
    | awk '{s += $1} END {printf "%d bytes in tracked files present\n", s}'
}
case "${1:-}" in
  trim)
    mapfile -t old < <(git ls-files bench/results | cut -d/ -f3 | grep -E '^[0-9]{4}-' \
      | sort -u | head -n "-$keep")
    pats=('/*')
    for d in "${old[@]}"; do pats+=("!/bench/results/$d/"); done
    git sparse-checkout set --no-cone "${pats[@]}"
    echo "left out: ${old[*]:-nothing}"
    size ;;
  restore)
    git sparse-checkout disable
    size ;;
  size)
    size ;;
  *)
    echo "usage: $0 trim|restore|size" >&2; exit 2 ;;
esac
