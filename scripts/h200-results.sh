#!/usr/bin/env bash
# The H200 results calls (issue 7). Usage, from the repo root on the GPU host:
#     bash scripts/h200-results.sh ROOT STEP [STEP ...]
# ROOT holds one run folder per scenario (an existing ROOT is resumed, so a later call continues what
# an earlier one left; carry it in the repo to reach a fresh host). Each STEP is KIND:SCENARIO:SECONDS:
#   time:S:T     msa-bench sweep --scenario S (bf16 and fp8, all three schedules), stopped after T s
#   count:S:T    msa-bench sweep --scenario S --resume --counters: ncu counters for its timed units
#   cute:S:T     the scenario with kv-outer-cute next to kv-outer (issue 8), with counters, folder S-cute
# A time cap stops a sweep with SIGINT: every finished unit (and every finished ncu chunk) is already
# on disk, and the next call's step resumes it. ROOT is packed into $OUT/h200.tgz after each step.
export PYTHONUNBUFFERED=1
R=${1:?usage: h200-results.sh ROOT STEP...}; shift
mkdir -p "$R"
source scripts/gpu-setup.sh > "$R/setup.log" 2>&1 || tail -5 "$R/setup.log"
grep -i "up to date\|rebuild\|commit" "$R/setup.log" | head -3
pack() { tar czf "$OUT/h200.tgz" -C "$(dirname "$R")" "$(basename "$R")"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
for step in "$@"; do
    IFS=: read -r kind scen secs <<< "$step"
    dir=$R/$scen; args=(--scenario "$scen")
    case $kind in
        time)  ;;
        count) args+=(--counters) ;;
        cute)  dir=$R/$scen-cute; args+=(--backend kv-outer,kv-outer-cute --dtype bf16,fp8 --counters) ;;
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
