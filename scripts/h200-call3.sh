#!/usr/bin/env bash
# One H200 call: Triton variant sweep, CuTe stage, FlashInfer timing (+ JIT cache), a first GPU sweep.
export PYTHONUNBUFFERED=1
source scripts/gpu-setup.sh > /tmp/setup.log 2>&1 || tail -5 /tmp/setup.log
R=/tmp/r; mkdir -p $R/k $R/c $R/fi; cp /tmp/setup.log $R/
pack() { tar czf $OUT/r.tgz -C /tmp r; }
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
timeout 140 python3 benchmarks/kernels_gpu.py --out $R/k --quick --sweep-s 45 > $R/k/stdout.txt 2>&1; echo "kernels rc=$?"
tail -24 $R/k/stdout.txt; pack
timeout 230 python3 benchmarks/flashinfer_gpu.py --out $R/fi > $R/fi/stdout.txt 2>&1; echo "fi rc=$?"
tail -16 $R/fi/stdout.txt; bash scripts/save-fi-cache.sh $OUT; pack
timeout 80 python3 benchmarks/cute_gpu.py --out $R/c --quick > $R/c/stdout.txt 2>&1; echo "cute rc=$?"
tail -14 $R/c/stdout.txt; pack
timeout 100 msa-bench sweep --scenario default --tokens 2048 --reuse 0.25 --dtype bf16 --counters --out $R/sweep > $R/sweep.txt 2>&1; echo "sweep rc=$?"
tail -12 $R/sweep.txt; pack
