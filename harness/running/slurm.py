"""`msa-bench slurm`: one sweep across hosts as a Slurm job array, then a dependent merge and the gate.

The script it writes is its own submitter: run by hand (`bash SCRIPT`) it submits itself as an array
of SHARDS tasks (`sbatch --array=0-(SHARDS-1)`), each `msa-bench sweep --shard
$SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT` into RUN/shards/<i>, then itself once more as the merge
job, which waits for all of them (afterany: a shard with a failed unit still holds data) and runs
`msa-bench merge`, `report` and, with a baseline, `compare`. MSA_BENCH_STEP tells a job which step it
is. A requeued shard resumes its folder. Slurm does the scheduling; nothing here waits or retries.
"""
from __future__ import annotations

import shlex

STEP_ENV = "MSA_BENCH_STEP"


def sbatch_script(scenario: str, shards: int, run: str, sweep_args: list[str], gpus_per_shard: int = 1,
                  baseline: str | None = None) -> str:
    q = shlex.quote
    gpus = ["--gpus", "all"] if gpus_per_shard > 1 else []
    return f"""#!/bin/bash
# A sweep of scenario {scenario} as a Slurm job array of {shards} shard(s), written by `msa-bench slurm`.
# Submit it with: bash THIS_FILE   (it submits the shards, then the merge job that waits for them)
# Add your site's #SBATCH lines (partition, account, time limit) below; they apply to both jobs.
#SBATCH --job-name=msa-bench-{scenario.replace('/', '_')}
set -euo pipefail

MSA_BENCH=${{MSA_BENCH:-msa-bench}}
SCENARIO={q(scenario)}
RUN={q(run)}
SHARDS={shards}
BASELINE={q(baseline or '')}
SWEEP_ARGS=({' '.join(q(a) for a in sweep_args + gpus)})

case "${{{STEP_ENV}:-submit}}" in
submit)
  mkdir -p "$RUN/logs"
  shards_job=$(sbatch --parsable --array=0-$((SHARDS - 1)) --gres=gpu:{gpus_per_shard} \\
    --output="$RUN/logs/shard-%a.out" --export=ALL,{STEP_ENV}=shard "$0")
  shards_job=${{shards_job%%;*}}
  merge_job=$(sbatch --parsable --dependency=afterany:"$shards_job" --output="$RUN/logs/merge.out" \\
    --export=ALL,{STEP_ENV}=merge "$0")
  echo "submitted shards $shards_job (array 0-$((SHARDS - 1))) and merge ${{merge_job%%;*}}; results in $RUN/merged"
  ;;
shard)
  i=$SLURM_ARRAY_TASK_ID
  dir="$RUN/shards/$i"
  resume=()
  if [ -f "$dir/run.json" ]; then resume=(--resume); fi     # a requeued task continues its shard
  "$MSA_BENCH" sweep --scenario "$SCENARIO" ${{SWEEP_ARGS[@]+"${{SWEEP_ARGS[@]}}"}} \\
    --shard "$i/${{SLURM_ARRAY_TASK_COUNT:-$SHARDS}}" --out "$dir" ${{resume[@]+"${{resume[@]}}"}}
  ;;
merge)
  rm -rf "$RUN/merged"                                       # rebuilt from the shards
  "$MSA_BENCH" merge "$RUN/merged" "$RUN"/shards/*
  "$MSA_BENCH" report "$RUN/merged"
  if [ -n "$BASELINE" ]; then "$MSA_BENCH" compare "$BASELINE" "$RUN/merged"; fi
  ;;
*)
  echo "error: {STEP_ENV} must be submit, shard or merge, got ${{{STEP_ENV}}}" >&2
  exit 2
  ;;
esac
"""
