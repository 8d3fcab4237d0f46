# What the benchmarks/call_sNN_K.sh device scripts share; source it first: `. benchmarks/call_lib.sh`.
#   R       the run log ($OUT/run.log), L the step and shard logs (/tmp/$CALL_LOGS), P pytest on GPU tests
#   pack    the logs into $OUT/logs.tgz, and $OUT/ab (an A/B's results) into $OUT/ab.tgz when present:
#           the device returns at most 8 files from $OUT
#   step NAME LIMIT CMD...   CMD under `timeout LIMIT`, its output and rc appended to $R, then pack
#   shard NAME CMD...        CMD in the background (limit $SHARD_LIMIT, default 170 s), log $L/shard_NAME.log;
#   shards_done              waits for them and appends their last lines to $R
#   gpu_line                 the card, driver and clocks into $R
export PYTHONUNBUFFERED=1
R=$OUT/run.log; L=/tmp/${CALL_LOGS:-calllogs}; mkdir -p "$L"
P="python3 -m pytest -m gpu -q -p no:cacheprovider -rfE"
pack() {
  tar czf "$OUT/logs.tgz" -C "$(dirname "$L")" "$(basename "$L")" 2>/dev/null
  [ -d "$OUT/ab" ] && tar czf "$OUT/ab.tgz" -C "$OUT" ab 2>/dev/null
  return 0
}
step() { local name=$1 limit=$2; shift 2; local t=$SECONDS; echo "=== $name: $*" >>"$R"; timeout "$limit" "$@" >>"$R" 2>&1; echo "=== $name rc=$? $((SECONDS-t))s" >>"$R"; pack; }
shard() { local n=$1; shift; ( t=$SECONDS; timeout "${SHARD_LIMIT:-170}" "$@" >"$L/shard_$n.log" 2>&1; echo "shard $n rc=$? $((SECONDS-t))s $(tail -n1 "$L/shard_$n.log")" >>"$L/shards.txt" ) & }
shards_done() { wait; cat "$L/shards.txt" >>"$R" 2>/dev/null; pack; }
gpu_line() { nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader >>"$R"; }
