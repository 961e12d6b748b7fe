#!/usr/bin/env bash
# Wait for a background gpu_session.sh chain (started with setsid in an earlier command) to
# finish, then copy its results, without the torch-profiler traces (hundreds of MB), into a
# device call's $OUT.  A device command may run 10 minutes; a chain may run longer, so one
# call starts the chain and waits, and the next (within the host's warm window) waits again.
#   bash scripts/wait_chain.sh CHAIN_OUT MAX_WAIT_S DEST
# Exit 0 once the chain's steps.txt says "all done", 2 if MAX_WAIT_S passed first (the
# partial results are copied either way).
set -uo pipefail
chain=${1:?CHAIN_OUT} max=${2:?MAX_WAIT_S} dest=${3:?DEST}
t0=$(date +%s) rc=2
while [ $(( $(date +%s) - t0 )) -lt "$max" ]; do
  if grep -q " all .*done" "$chain/steps.txt" 2>/dev/null; then rc=0; break; fi
  sleep 5
done
mkdir -p "$dest"
tar -C "$chain" --exclude='*.pt.trace.json*' --exclude='traces/*/*.json.gz' -cf - . \
  | tar -C "$dest" -xf -
cat "$chain/steps.txt" 2>/dev/null
exit $rc
