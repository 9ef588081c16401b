#!/usr/bin/env bash
# The gate's protocol on the GPU host: NRUNS separate sweep processes of one commit, with planted
# regressions next to the clean backends, for scripts/gate-power.py. From the repository root:
#     source scripts/gpu-setup.sh
#     bash scripts/gate-protocol.sh OUTROOT NRUNS [SECONDS]
# Writes OUTROOT/run-01 .. run-NRUNS (scenario gate-prefill). A finished run is skipped and an
# unfinished one resumed, so the protocol can be spread over several time-capped calls: with SECONDS,
# no new run starts after SECONDS and a running sweep is stopped (SIGINT) when they run out. OUTROOT is
# packed into $OUT/gate.tgz after each run when OUT is set. GATE_BACKENDS replaces the backend list. Then:
#     python3 scripts/gate-power.py OUTROOT --baseline-runs K
# A plain baseline set for compare (no planted backends, checked against itself): msa-bench gate baseline.
export PYTHONUNBUFFERED=1
R=${1:?usage: gate-protocol.sh OUTROOT NRUNS [SECONDS]}
N=${2:?usage: gate-protocol.sh OUTROOT NRUNS [SECONDS]}
CAP=${3:-0}
BACKENDS=${GATE_BACKENDS:-q-packed-cute,kv-outer-cute,hybrid,auto,q-packed-cute@delay5,kv-outer-cute@delay5,q-packed-cute@delay10,kv-outer-cute@delay10}
mkdir -p "$R"
pack() { [ -n "${OUT:-}" ] && tar czf "$OUT/gate.tgz" -C "$(dirname "$R")" "$(basename "$R")"; }
complete() { grep -q '"complete": true' "$1/run.json" 2>/dev/null; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu --format=csv,noheader
t0=$(date +%s)
for i in $(seq 1 "$N"); do
    dir=$(printf '%s/run-%02d' "$R" "$i")
    complete "$dir" && continue
    left=0
    if [ "$CAP" -gt 0 ]; then
        left=$(( CAP - ($(date +%s) - t0) ))
        [ "$left" -le 20 ] && { echo "time cap reached before run $i"; break; }
    fi
    args=(--scenario gate-prefill --backend "$BACKENDS" --out "$dir")
    [ -f "$dir/run.json" ] && args+=(--resume)
    t=$(date +%s)
    if [ "$CAP" -gt 0 ]; then
        timeout -s INT -k 15 "$left" msa-bench sweep "${args[@]}" >> "$dir.log" 2>&1
    else
        msa-bench sweep "${args[@]}" >> "$dir.log" 2>&1
    fi
    rc=$?
    echo "run $i rc=$rc in $(( $(date +%s) - t )) s: $(ls "$dir/units" 2>/dev/null | wc -l) units$(complete "$dir" && echo ', complete')"
    pack
done
