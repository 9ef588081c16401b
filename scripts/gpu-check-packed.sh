#!/usr/bin/env bash
# H200: check and time the token-packed Q-outer backends (flashinfer-packed, dense-gather) in one command:
#     source scripts/gpu-setup.sh && bash scripts/gpu-check-packed.sh
# 1. `msa-bench check` (synthetic workload, the gate of issue 23) for flashinfer-packed on both routes,
#    bf16 and fp8; its output goes to $OUT/msa-bench-check.log, one summary line each here;
# 2. python3 -m msa_bench.harness.packed_gpu_check: the same gate on synthetic (causal too), indexer,
#    real-prefill batch 1 and multi-request workloads for every route, tile size and dense-gather kernel,
#    then the timings on prefill_c17ccf7fbbb5d1ee5648: $OUT/packed_gpu_check.{log,json}.
# About 5 minutes on an H200 with FlashInfer's FA2 modules in the JIT cache (scripts/gpu-setup.sh restores
# .fi-cache/), about 1.5 more to build them (bf16 and fp8-KV) on the first check of each dtype. The whole
# stays under 8 minutes: step 2 gets what is left of 470 s and skips (and logs) what does not fit.
# Exit status: non-zero if any check failed or was skipped.
export PYTHONUNBUFFERED=1
OUT=${OUT:-results/packed-gpu-check}
mkdir -p "$OUT"
DEADLINE=470
rc=0
for dtype in bf16 fp8; do
    for backend in flashinfer-packed flashinfer-packed@bsr; do
        left=$((DEADLINE - SECONDS - 200))   # leave step 2 at least 200 s
        [ $left -gt 150 ] && left=150
        if [ $left -lt 20 ]; then echo "msa-bench check --backend $backend --dtype $dtype: skipped (time)"; rc=1; continue; fi
        timeout $left msa-bench check --backend "$backend" --dtype "$dtype" >> "$OUT/msa-bench-check.log" 2>&1
        r=$?
        [ $r -ne 0 ] && rc=1
        echo "msa-bench check --backend $backend --dtype $dtype: exit $r; $(tail -1 "$OUT/msa-bench-check.log")"
    done
done
left=$((DEADLINE - SECONDS))
timeout $((left + 5)) python3 -m msa_bench.harness.packed_gpu_check --out "$OUT" --budget-s $((left - 10))
r=$?
[ $r -ne 0 ] && rc=1
echo "packed_gpu_check: exit $r (124: timed out); $OUT/packed_gpu_check.json"
exit $rc
