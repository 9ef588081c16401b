#!/usr/bin/env bash
# `sweep --gpus all` against the same sweep on one of the GPUs: wall times, the same units, compare.
# Usage, from the repository root on a GPU host with 2 or more GPUs of one model:
#     bash scripts/multi-gpu-check.sh ROOT STEP [SCENARIO]
# STEP: one (the sweep on GPU 0 alone, into ROOT/one), all (--gpus all, into ROOT/all), check (the
# unit ids of both runs, each unit checked, the wall-time ratio against the 0.6 target, and
# `msa-bench compare ROOT/one ROOT/all`). SCENARIO defaults to co-selection. An interrupted step
# resumes on the next call. Wall times go to ROOT/<step>.seconds. MSA_GPUS replaces `all` (on a CPU: a
# count of CPU workers).
set -euo pipefail
R=${1:?usage: multi-gpu-check.sh ROOT one|all|check [SCENARIO]}; step=${2:?step: one, all or check}
scen=${3:-co-selection}
mkdir -p "$R"
sweep() {   # DIR ARGS...: a sweep, resumed when DIR holds one, timed into DIR.seconds (added up over resumes)
    local dir=$1; shift
    local args=(--scenario "$scen" --out "$dir" "$@")
    [ -f "$dir/run.json" ] && args+=(--resume)
    local t0; t0=$(date +%s.%N)
    local rc=0; msa-bench sweep "${args[@]}" || rc=$?
    python3 -c "import sys; p='$dir.seconds'; import os; old=float(open(p).read()) if os.path.exists(p) else 0.0; \
open(p,'w').write(f'{old + float(sys.argv[2]) - float(sys.argv[1]):.1f}\n')" "$t0" "$(date +%s.%N)"
    return $rc
}
case $step in
    one) gpu0=${CUDA_VISIBLE_DEVICES:-0}; CUDA_VISIBLE_DEVICES=${gpu0%%,*} sweep "$R/one" ;;
    all) sweep "$R/all" --gpus "${MSA_GPUS:-all}" ;;
    check)
        python3 - "$R" <<'PY'
import sys
from pathlib import Path
from msa_bench.harness.store.results import load_run
root = Path(sys.argv[1])
one, all_ = load_run(root / "one"), load_run(root / "all")
ids_one, ids_all = sorted(one.status["unit"]), sorted(all_.status["unit"])
unchecked = all_.status[(all_.status["status"] == "ok") & ~(all_.status["max_rel_err"] <= all_.status["tol"])]
t_one, t_all = (float((root / f"{n}.seconds").read_text()) for n in ("one", "all"))
gpus = sorted(set(all_.status.get("gpu_uuid", [])) - {None})
print(f"units: one GPU {len(ids_one)}, --gpus all {len(ids_all)} on {len(gpus)} GPU(s); same ids: {ids_one == ids_all}; "
      f"complete: {one.meta['complete']} / {all_.meta['complete']}; ok units without a passed check: {len(unchecked)}")
print(f"status --gpus all: {all_.status['status'].value_counts().to_dict()}")
print(f"wall time: one GPU {t_one:.0f} s, --gpus all {t_all:.0f} s, ratio {t_all / t_one:.3f} (target <= 0.6)")
PY
        msa-bench compare "$R/one" "$R/all" ;;
    *) echo "step must be one, all or check" >&2; exit 2 ;;
esac
