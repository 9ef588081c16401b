#!/usr/bin/env bash
# The H200 results call (issue 7), in priority order; each step has its own time cap, and every
# finished (point, backend) unit is already on disk when a cap stops a sweep.
export PYTHONUNBUFFERED=1
source scripts/gpu-setup.sh > /tmp/setup.log 2>&1 || tail -5 /tmp/setup.log
grep -i "up to date\|rebuild" /tmp/setup.log | head -3
R=/tmp/h200; mkdir -p $R; cp /tmp/setup.log $R/
pack() { tar czf $OUT/h200.tgz -C /tmp h200; }
step() {  # step NAME SECONDS ARGS...
    local name=$1 secs=$2; shift 2
    local t0=$(date +%s)
    timeout -s INT -k 10 "$secs" msa-bench sweep --out $R/$name "$@" > $R/$name.log 2>&1
    echo "$name rc=$? in $(( $(date +%s) - t0 )) s: $(ls $R/$name/units 2>/dev/null | wc -l) units"; pack
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
step perf-point 60 --scenario default --tokens 16384 --context 131072 --reuse 0.25 --dtype bf16,fp8
step default 120 --scenario default
step perf-point-counters 110 --scenario default --tokens 16384 --context 131072 --reuse 0.25 --dtype bf16 --counters
step real-prefill 90 --scenario real-prefill --dtype bf16
step skew 50 --scenario skew
step long-context 50 --scenario long-context
step reuse-sweep-high 40 --scenario reuse-sweep --tokens 512 --dtype bf16
timeout 40 msa-bench calibrate --out $R/calibration > $R/calibration.log 2>&1; echo "calibrate rc=$?"; tail -3 $R/calibration.log; pack
