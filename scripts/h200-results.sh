#!/usr/bin/env bash
# The committed H200 runs (results/h200/<scenario>/), made on an offline GPU host in time-capped steps.
# Usage, from the repository root on the GPU host (after `bash scripts/stamp-commit.sh` on the machine
# with git, and with the checkout copied over):
#     bash scripts/h200-results.sh ROOT STEP [STEP ...]
# ROOT holds one run folder per scenario; an existing folder is resumed, so a later step or a later
# host continues what an earlier one left (copy ROOT along). Each STEP is KIND:SCENARIO:SECONDS:
#   time:S:T     msa-bench sweep --scenario S, stopped after T s
#   count:S:T    msa-bench sweep --scenario S --resume --counters: ncu counters for its timed units
# MSA_BACKENDS (comma-separated) replaces the scenario's backends, e.g.
#     MSA_BACKENDS=kv-outer,kv-outer-cute,flashinfer,msa-scatter
# A time cap stops a sweep with SIGINT: every finished unit (and every finished ncu chunk) is already on
# disk, and the next step resumes it. ROOT is packed into $OUT/h200.tgz after each step when OUT is set.
export PYTHONUNBUFFERED=1
R=${1:?usage: h200-results.sh ROOT STEP...}; shift
mkdir -p "$R"
source scripts/gpu-setup.sh > "$R/setup.log" 2>&1 || tail -5 "$R/setup.log"
grep -i "up to date\|rebuild\|commit" "$R/setup.log" | head -3
pack() { [ -n "${OUT:-}" ] && tar czf "$OUT/h200.tgz" -C "$(dirname "$R")" "$(basename "$R")"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
for step in "$@"; do
    IFS=: read -r kind scen secs <<< "$step"
    dir=$R/$scen; args=(--scenario "$scen")
    [ -n "${MSA_BACKENDS:-}" ] && args+=(--backend "$MSA_BACKENDS")
    case $kind in
        time)  ;;
        count) args+=(--counters) ;;
        *) echo "unknown step $step"; continue ;;
    esac
    [ -f "$dir/run.json" ] && args+=(--resume)
    t0=$(date +%s)
    timeout -s INT -k 15 "$secs" msa-bench sweep --out "$dir" "${args[@]}" >> "$dir.log" 2>&1
    rc=$?
    n=$(ls "$dir/units" 2>/dev/null | wc -l)
    c=$(grep -l '"counters": "ncu"' "$dir"/units/*/status.json 2>/dev/null | wc -l)
    echo "$step rc=$rc in $(( $(date +%s) - t0 )) s: $n units, $c with counters; $(tail -c 300 "$dir.log" | tr '\n' ' ' | tail -c 160)"
    pack
done
