#!/usr/bin/env bash
# A GPU's calibration and runs, made on an offline GPU host in time-capped steps (scripts/h200-results.sh
# for any GPU, with the calibration as its first step). From the repository root on the GPU host (after
# `bash scripts/stamp-commit.sh` on the machine with git, and with the checkout copied over):
#     bash scripts/gpu-results.sh ROOT STEP [STEP ...]
# ROOT holds one run folder per scenario and calibration/; an existing run folder is resumed. STEP is
#   calibrate:T        msa-bench calibrate (into results/<gpu>/calibration, where every command finds it;
#                      copied to ROOT/calibration), stopped after T s; its wall time is printed
#   time:S:T[:i/n]     msa-bench sweep --scenario S (with the profile found for this GPU), stopped after T s;
#                      i/n runs that shard of the points only (a trimmed run on a GPU with less time)
#   eager:S:T[:i/n]    the same with --timer eager (the stages launched from Python) into ROOT/S-eager
#   beside:S           msa-bench report ROOT/S-eager --beside ROOT/S: module time graph | eager | eager/graph
#                      per unit both timed, into ROOT/S-eager/report
#   warm:T             FlashInfer's JIT kernels built in the background (msa-bench check of each FlashInfer
#                      backend and dtype), so a later step does not wait on the first build
# MSA_BACKENDS (comma-separated) replaces the scenarios' backends; MSA_EAGER_BACKENDS, where set, those of
# the eager steps (e.g. auto@eager next to auto). ROOT is packed into $OUT/runs.tgz after
# each step when OUT is set. A time cap stops with SIGINT: every finished unit is on disk.
export PYTHONUNBUFFERED=1
R=${1:?usage: gpu-results.sh ROOT STEP...}; shift
mkdir -p "$R"
source scripts/gpu-setup.sh > "$R/setup.log" 2>&1 || tail -5 "$R/setup.log"
grep -i "up to date\|rebuild\|commit\|ready" "$R/setup.log" | head -4
pack() { [ -n "${OUT:-}" ] && tar czf "$OUT/runs.tgz" --exclude='*.log.tmp' -C "$(dirname "$R")" "$(basename "$R")"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu --format=csv,noheader
for step in "$@"; do
    IFS=: read -r kind a b c <<< "$step"
    t0=$(date +%s)
    case $kind in
        warm)
            ( for be in flashinfer flashinfer-packed; do for dt in bf16 fp8; do
                timeout "$a" msa-bench check --backend $be --dtype $dt > "$R/warm-$be-$dt.log" 2>&1
              done; done; echo "warm done in $(( $(date +%s) - t0 )) s" >> "$R/warm.log" ) &
            echo "$step: started in the background"; continue ;;
        calibrate)
            timeout -s INT -k 15 "$a" msa-bench calibrate > "$R/calibrate.log" 2>&1
            rc=$?
            # the folder calibrate names in its last line ("wrote DIR/profile.json in ...")
            dir=$(sed -n 's|^wrote \(.*\)/profile\.json in .*|\1|p' "$R/calibrate.log" | tail -1)
            [ -n "$dir" ] && rm -rf "$R/calibration" && cp -r "$dir" "$R/calibration"
            echo "$step rc=$rc in $(( $(date +%s) - t0 )) s ($dir): $(grep '^wrote\|^\[' "$R/calibrate.log" | tr '\n' ' ' | tail -c 600)" ;;
        time|eager)
            dir=$R/$a; args=(--scenario "$a"); backends=${MSA_BACKENDS:-}
            if [ "$kind" = eager ]; then
                dir=$R/$a-eager; args+=(--timer eager); backends=${MSA_EAGER_BACKENDS:-$backends}
            fi
            [ -n "$backends" ] && args+=(--backend "$backends")
            [ -n "$c" ] && args+=(--shard "$c")
            [ -f "$dir/run.json" ] && args+=(--resume)
            timeout -s INT -k 15 "$b" msa-bench sweep --out "$dir" "${args[@]}" >> "$dir.log" 2>&1
            rc=$?
            n=$(ls "$dir/units" 2>/dev/null | wc -l)
            echo "$step rc=$rc in $(( $(date +%s) - t0 )) s: $n units; $(tail -c 300 "$dir.log" | tr '\n' ' ' | tail -c 200)" ;;
        beside)
            msa-bench report "$R/$a-eager" --beside "$R/$a" > "$R/$a-beside.log" 2>&1
            echo "$step rc=$? in $(( $(date +%s) - t0 )) s: $(tail -c 200 "$R/$a-beside.log" | tr '\n' ' ')" ;;
        *) echo "unknown step $step"; continue ;;
    esac
    pack
done
