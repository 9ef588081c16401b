"""The sweep end to end on CPU: smoke grid (reference backend, fp32, one reuse), interruption and
--resume, shard + merge, and bad input giving one clear line and a non-zero exit."""
import json
import shutil

import pytest

from msa_bench.harness.store.results import finished_units, load_run, write_meta
from msa_bench.harness.running.sweep import INTERRUPT_HOOK

GRID = ["--backend", "reference", "--dtype", "fp32", "--reuse", "0.5", "--reps", "3"]
N_POINTS = 6        # smoke with dtype fp32 and reuse 0.5: synthetic 2 causal x (skew 0, skew 1) + 2 indexer


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory, cli):
    """A smoke sweep interrupted after two units, then resumed to completion. No --scenario: on a
    CPU the sweep must pick `smoke` and say so."""
    run = tmp_path_factory.mktemp("sweep") / "run"
    code, _, err = cli("sweep", *GRID, "--out", run, env={INTERRUPT_HOOK: "2"})
    assert code == 130, err
    first = sorted(finished_units(run))
    assert len(first) == 2
    assert json.loads((run / "run.json").read_text())["complete"] is False
    stamps = {u: (run / "units" / u / "status.json").stat().st_mtime_ns for u in first}
    code, out, err = cli("sweep", *GRID, "--out", run, "--resume")
    assert code == 0, err
    return {"run": run, "first": first, "stamps": stamps, "out": out, "err": err}


def test_resume_completes_without_redoing_finished_units(smoke_run):
    run = smoke_run["run"]
    assert len(finished_units(run)) == N_POINTS
    for u in smoke_run["first"]:
        assert (run / "units" / u / "status.json").stat().st_mtime_ns == smoke_run["stamps"][u]
    assert "2 of 6 units already finished" in " ".join(smoke_run["err"].split())   # rich wraps at any width
    meta = json.loads((run / "run.json").read_text())
    assert meta["complete"] is True and meta["scenario"] == "smoke"


def test_cpu_run_is_labelled_and_picks_smoke(smoke_run):
    text = " ".join((smoke_run["out"] + smoke_run["err"]).split())       # rich wraps the notes
    assert "NOT GPU timings" in text and "`smoke` scenario" in text
    r = load_run(smoke_run["run"])
    assert r.timer == "cpu" and "NOT GPU timings" in r.meta["note"]
    timed = r.samples[r.samples["stage"] != "plan"]
    assert set(timed["timer"]) == {"cpu"} and set(r.stats.loc[r.stats["stage"] != "plan", "timer"]) == {"cpu"}
    assert set(r.samples.loc[r.samples["stage"] == "plan", "timer"]) == {"host"}   # plan() is host work


def test_results_tables(smoke_run):
    r = load_run(smoke_run["run"])
    assert (r.status["status"] == "ok").all()
    assert (r.status["max_rel_err"] <= r.status["tol"]).all()
    assert r.status["telemetry"].eq("unavailable").all()
    assert {"plan", "attention", "combine", "module"} == set(r.stats["stage"])
    module = r.value("median_s")
    assert len(module) == N_POINTS and (module["value"] > 0).all()
    assert len(r.value("tflops")) == N_POINTS and len(r.value("tflops", "attention")) == N_POINTS
    # raw samples: reps per timed stage, one for plan
    per = r.samples.groupby(["point_key", "stage"]).size()
    assert (per.xs("module", level="stage") == 3).all() and (per.xs("plan", level="stage") == 1).all()
    prov = r.meta["provenance"]
    for key in ("device_name", "torch", "triton", "flashinfer", "git_commit", "git_dirty", "source_sha256",
                "command", "scenario_sha256", "time_utc", "hostname"):
        assert key in prov, key
    assert prov["scenario_sha256"] and len(prov["scenario_sha256"]) == 64


def test_shard_and_merge_equal_unsharded(smoke_run, tmp_path, cli):
    shards = []
    for i in range(2):
        out = tmp_path / f"shard{i}"
        code, _, err = cli("sweep", "--scenario", "smoke", *GRID, "--shard", f"{i}/2", "--out", out)
        assert code == 0, err
        shards.append(out)
    assert not finished_units(shards[0]) & finished_units(shards[1])
    merged = tmp_path / "merged"
    code, out, err = cli("merge", merged, *shards)
    assert code == 0, err
    assert finished_units(merged) == finished_units(smoke_run["run"])
    assert json.loads((merged / "run.json").read_text())["complete"] is True
    assert len(load_run(merged).status) == N_POINTS


def test_merge_refuses_other_scenario_grid_unless_forced(smoke_run, tmp_path, cli, one_error_line):
    other = tmp_path / "other"
    code, _, err = cli("sweep", "--scenario", "smoke", "--backend", "reference", "--dtype", "fp32",
                       "--reuse", "1", "--generator", "synthetic", "--causal", "--reps", "1", "--out", other)
    assert code == 0, err
    code, _, err = cli("merge", tmp_path / "m1", smoke_run["run"], other)
    assert code == 2 and "different scenario grid" in one_error_line(err)
    code, _, err = cli("merge", tmp_path / "m2", smoke_run["run"], other, "--force")
    assert code == 0, err


def test_a_run_timed_after_another_l2_flush_is_not_resumed_or_merged(smoke_run, tmp_path, cli, one_error_line):
    from msa_bench.harness.measure.timing import l2_flush_of
    legacy = tmp_path / "legacy"
    shutil.copytree(smoke_run["run"], legacy)
    meta = json.loads((legacy / "run.json").read_text())
    assert l2_flush_of(meta) == "write+read"
    del meta["timing"]["l2_flush"]               # as recorded before the protocol was named
    write_meta(legacy, meta)
    assert l2_flush_of(meta) == "write" and l2_flush_of({"timing": {"cold_l2": False}}) == "none"
    code, _, err = cli("sweep", "--scenario", "smoke", *GRID, "--out", legacy, "--resume")
    assert code == 2 and "L2 flush 'write'" in one_error_line(err)
    code, _, err = cli("merge", tmp_path / "m", smoke_run["run"], legacy)
    assert code == 2 and "L2 flush" in one_error_line(err)
    code, out, err = cli("compare", legacy, smoke_run["run"])
    assert "different L2 flush" in out + err


def test_existing_run_needs_resume_and_same_grid(smoke_run, cli, one_error_line):
    code, _, err = cli("sweep", *GRID, "--out", smoke_run["run"])
    assert code == 2 and "--resume" in one_error_line(err)
    code, _, err = cli("sweep", *GRID[:-2], "--reps", "3", "--reuse", "1", "--out", smoke_run["run"], "--resume")
    assert code == 2 and "different grid" in one_error_line(err)


@pytest.mark.parametrize("args, needle", [
    (["--backend", "no-such-backend"], "unknown backend 'no-such-backend'"),
    (["--backend", "kv-outer-cute@v99"], "kv-outer-cute has no kernel 'v99'"),
    (["--backend", "kv-outer@fast"], "backend 'kv-outer' takes no @option"),
    (["--scenario", "no-such-scenario"], "unknown scenario 'no-such-scenario'"),
    (["--reuse", ","], "--reuse is empty"),
    (["--reuse", "a,b"], "--reuse must be a comma-separated list"),
    (["--reuse", "1,,2"], "--reuse has an empty item in '1,,2'"),
    (["--backend", "kv-outer,"], "--backend has an empty item"),
    (["--shard", "3/2"], "--shard"),
    (["--dtype", "fp64"], "unknown dtype 'fp64'"),
])
def test_bad_sweep_input_is_one_line(tmp_path, args, needle, cli, one_error_line):
    code, _, err = cli("sweep", "--scenario", "smoke", *args, "--out", tmp_path / "r")
    assert code == 2
    assert needle in one_error_line(err)


def test_unusable_paths_exit_2_with_one_line(smoke_run, tmp_path, cli, one_error_line):
    """A file where a folder must go, a path under a file, a path that cannot be created: bad input."""
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for args in (["sweep", "--scenario", "smoke", "--out", a_file], ["sweep", "--scenario", "smoke", "--out", a_file / "run"],
                 ["sweep", "--scenario", "smoke", "--out", "/proc/no-such-run"], ["report", smoke_run["run"], "--out", a_file],
                 ["merge", a_file, smoke_run["run"]], ["merge", a_file / "merged", smoke_run["run"]]):
        code, _, err = cli(*args)
        assert code == 2 and "cannot use" in one_error_line(err), args


def test_bad_scenario_files_are_one_line(tmp_path, cli, one_error_line):
    bad_key = tmp_path / "bad_key.toml"
    bad_key.write_text('description = "x"\nbackends = ["reference"]\nbogus = 1\n'
                       '[grid]\ngenerator = "synthetic"\ntokens = 64\ncontext = 512\nreuse = 0.5\n')
    code, _, err = cli("sweep", "--scenario", bad_key, "--out", tmp_path / "r1")
    assert code == 2 and "unknown key 'bogus'" in one_error_line(err)
    empty = tmp_path / "empty.toml"
    empty.write_text('description = "x"\nbackends = ["reference"]\n'
                     '[grid]\ngenerator = "synthetic"\ntokens = 64\ncontext = 512\nreuse = []\n')
    code, _, err = cli("sweep", "--scenario", empty, "--out", tmp_path / "r2")
    assert code == 2 and "empty" in one_error_line(err)


def test_corrupt_results_file_is_one_line(smoke_run, tmp_path, cli, one_error_line):
    import shutil
    broken = tmp_path / "broken"
    shutil.copytree(smoke_run["run"], broken)
    victim = next((broken / "units").iterdir()) / "stats.parquet"
    victim.write_bytes(b"not a parquet file")
    for args in (["report", broken], ["compare", smoke_run["run"], broken]):
        code, _, err = cli(*args)
        assert code == 2 and "corrupt results file" in one_error_line(err), args
    code, _, err = cli("report", tmp_path / "missing")
    assert code == 2 and "no run folder" in one_error_line(err)


def test_unavailable_backend_is_recorded_and_the_sweep_goes_on(tmp_path, cli):
    out = tmp_path / "r"
    code, text, err = cli("sweep", "--scenario", "smoke", "--backend", "reference,flashinfer", "--dtype", "fp32",
                          "--reuse", "0.5", "--generator", "synthetic", "--no-causal", "--reps", "1", "--out", out)
    assert code == 0, err
    st = load_run(out).status
    ref, fi = st[st["backend"] == "reference"], st[st["backend"] == "flashinfer"]
    assert len(ref) == len(fi) > 0
    assert (ref["status"] == "ok").all()
    assert (fi["status"] == "unavailable").all() and fi["reason"].str.len().gt(0).all()
    assert "unavailable here (" in text and "needs a CUDA GPU and FlashInfer" in text
    # each unit names its place among the units run on its point's workload
    assert (ref["nth_on_workload"] == 0).all() and (fi["nth_on_workload"] == 1).all()


def test_backend_option_names_its_rows_and_keeps_its_schedule(tmp_path, cli):
    """kv-outer-cute@v23 is one CuTe kernel as its own backend: its units, status rows and report carry
    the whole name, and the roofline treats it as KV-outer (on a CPU it is unavailable, with the reason
    recorded)."""
    out = tmp_path / "r"
    code, text, err = cli("sweep", "--scenario", "smoke", "--backend", "reference,kv-outer-cute@v23", "--dtype", "fp32",
                          "--reuse", "0.5", "--generator", "synthetic", "--no-causal", "--reps", "1", "--out", out)
    assert code == 0, err
    st = load_run(out).status
    cute = st[st["backend"] == "kv-outer-cute@v23"]
    assert len(cute) > 0 and (cute["status"] == "unavailable").all()
    assert (cute["schedule"] == "kv-outer").all()
    from msa_bench.kernels.base import get_backend
    b = get_backend("kv-outer-cute@v23")
    assert b.name == "kv-outer-cute@v23" and b.kernel_for("bf16") == b.kernel_for("fp8") == "v23"


@pytest.mark.cuda
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_sweep_times_with_graphs_and_telemetry(tmp_path, cli):
    out = tmp_path / "gpu"
    code, _, err = cli("sweep", "--scenario", "smoke", "--backend", "reference,kv-outer,msa-scatter,flashinfer",
                       "--dtype", "fp16", "--reuse", "0.5", "--generator", "synthetic", "--no-causal", "--out", out)
    assert code == 0, err
    r = load_run(out)
    assert r.timer == "cuda-graph" and r.meta["provenance"]["gpu_name"]
    assert (r.status.loc[r.status["backend"] == "reference", "status"] == "ok").all()
    assert (r.status.loc[r.status["status"] != "ok", "reason"].str.len() > 0).all()
    ok = r.status[r.status["status"] == "ok"]
    assert ok["telemetry"].eq("nvml").all() and ok["sm_clock_mhz_before"].gt(0).all()
    assert (r.value("n_reps")["value"] >= 20).all()     # the GPU floor, though smoke asks for 2


def test_counters_are_added_to_finished_units_once(smoke_run, tmp_path, monkeypatch):
    """The per-point counter step on the units a sweep wrote. collect is replaced by canned
    totals (made-up numbers, not a measurement: ncu needs a GPU): what is checked is how they land."""
    import shutil

    import torch

    from msa_bench.harness.measure import counters

    from msa_bench.harness.store import results

    from msa_bench.harness.running import runner as sweep_runner
    from msa_bench.harness.measure.timing import TimingConfig
    run = tmp_path / "run"
    shutil.copytree(smoke_run["run"], run)
    r = load_run(run)
    key = r.status["point_key"].iloc[0]
    point = counters.point_from_dict(results.read_unit_status(run, results.unit_id(key, "reference")))
    uid = results.unit_id(key, "reference")
    calls = []

    def fake(ncu, items, timeout_s=None):
        calls.append(items)
        return {(0, "reference"): {"attention": {"hbm_bytes": 10.0, "l2_bytes": 20.0},
                                   "module": {"hbm_bytes": 10.0, "l2_bytes": 20.0}}}
    monkeypatch.setattr(counters, "collect", fake)
    runner = sweep_runner.Runner(run, torch.device("cpu"), TimingConfig.from_dict(None), False, [])
    runner.ncu = "ncu"
    assert sweep_runner.wants_counters(results.read_unit_status(run, uid))
    for _ in range(2):                          # a repeated collection replaces, never duplicates
        runner.collect_counters([(point, ["reference"])])
    st = results.read_unit_status(run, uid)
    assert st["counters"] == "ncu" and not sweep_runner.wants_counters(st)
    stats = load_run(run).stats
    mine = stats[(stats["point_key"] == key) & (stats["statistic"] == "hbm_bytes")]
    assert sorted(mine["stage"]) == ["attention", "module"] and (mine["value"] == 10.0).all()
    assert len(stats[stats["statistic"] == "median_s"]) == len(load_run(smoke_run["run"]).stats.query(
        "statistic == 'median_s'"))                                   # timing rows kept

    def failing(*a, **k):
        raise counters.CountersError("ncu failed (exit 1): ==ERROR== no permission")
    monkeypatch.setattr(counters, "collect", failing)
    other = results.unit_id(r.status["point_key"].iloc[1], "reference")
    p2 = counters.point_from_dict(results.read_unit_status(run, other))
    runner.collect_counters([(p2, ["reference"])])
    assert results.read_unit_status(run, other)["counters"].startswith("failed: ncu failed")
    assert sweep_runner.wants_counters(results.read_unit_status(run, other))      # --resume --counters retries it
    runner.collect_counters([(p2, ["reference"])])
    assert runner.ncu is None and "disabled after two failed ncu runs" in runner.notes[-1]


@pytest.mark.cuda
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_counters_attribute_every_stage(tmp_path, cli):
    from msa_bench.harness.measure.counters import find_ncu
    if find_ncu() is None:
        pytest.skip("ncu not installed")
    out = tmp_path / "ncu"
    code, _, err = cli("sweep", "--scenario", "smoke", "--backend", "kv-outer,flashinfer", "--dtype", "fp16",
                       "--reuse", "0.5", "--generator", "synthetic", "--no-causal", "--reps", "1", "--counters",
                       "--out", out)
    assert code == 0, err
    r = load_run(out)
    ok = r.status[r.status["status"] == "ok"]
    assert len(ok) and (ok["counters"] == "ncu").all(), ok[["backend", "counters"]]
    hbm = r.stats[r.stats["statistic"] == "hbm_bytes"]
    kv = hbm[(hbm["backend"] == "kv-outer") & (hbm["point_key"] == hbm["point_key"].iloc[0])]
    kv = kv.set_index("stage")["value"]
    assert {"index_map", "attention", "combine", "module"} <= set(kv.index)
    assert kv["attention"] > 0 and kv["module"] == pytest.approx(kv.drop("module").sum())


def test_empty_unit_folders_are_not_finished_units(smoke_run, tmp_path):
    import shutil

    from msa_bench.harness.store.results import UNITS_DIR
    run = tmp_path / "run"
    shutil.copytree(smoke_run["run"], run)
    (run / UNITS_DIR / "reference-0000000000000000").mkdir()        # what a partial copy can leave
    assert len(finished_units(run)) == N_POINTS and len(load_run(run).status) == N_POINTS


def test_cute_backend_option_takes_a_tile_order():
    """kv-outer-cute@v23+phases: kernel v23 with the scheduler's phased order; @phases: the defaults'
    kernels with it; @v23+2:p and @4:8 grouped orders; anything else after + is one clear
    error."""
    from msa_bench.scenarios.selection import synthetic_workload
    from msa_bench.scenarios.workload import AttnShape
    from msa_bench.kernels.base import get_backend
    b = get_backend("kv-outer-cute@v23+phases")
    assert b.name == "kv-outer-cute@v23+phases" and b.kernel == "v23" and b.order == "phases"
    d = get_backend("kv-outer-cute@phases")
    assert d.kernel is None and d.order == "phases"
    w = synthetic_workload(AttnShape(hq=8, hkv=2, head_dim=64, block=16, topk=2), "fp8", 16, 256, 1.0, seed=0,
                           device="cpu")
    cfg = b.resolved_config(w)
    assert cfg.order_phases and cfg.order_chunk == 0 and cfg.q_ranges == 1
    assert not get_backend("kv-outer-cute@v23").resolved_config(w).order_phases
    two = get_backend("kv-outer-cute@v23+2:p").resolved_config(w)
    assert two.q_ranges == 2 and two.order_phases and two.order_chunk == 0
    four = get_backend("kv-outer-cute@4:8")
    assert four.kernel is None and (four.resolved_config(w).q_ranges, four.resolved_config(w).order_chunk) == (4, 8)
    with pytest.raises(KeyError, match="tile order 'chunks' is not S:k"):
        get_backend("kv-outer-cute@v23+chunks")
    with pytest.raises(KeyError, match="no kernel 'v99'"):
        get_backend("kv-outer-cute@v99+phases")


def test_the_first_unit_on_a_workload_drops_one_timed_plan_before_its_own(tmp_path, cli, monkeypatch):
    """On large decode points the unit timed first on a workload ran 10 % slower than those after it: the
    first unit on each workload builds and times one plan (the fewest samples) and drops it first."""
    from msa_bench.harness.running import runner as sweep_runner
    from msa_bench.harness.measure import timing
    from msa_bench.kernels import base
    made, timed = [], []
    real_plan, real_time = base.Backend.plan, sweep_runner.time_plan

    def plan(self, w):
        made.append(self.name)
        return real_plan(self, w)

    def time_plan(plan, config, *a, **k):
        timed.append((plan.backend, config.cpu_reps))
        return real_time(plan, config, *a, **k)
    monkeypatch.setattr(base.Backend, "plan", plan)
    monkeypatch.setattr(sweep_runner, "time_plan", time_plan)
    monkeypatch.setattr(timing, "time_plan", time_plan)          # warm_plan's
    out = tmp_path / "r"
    code, _, err = cli("sweep", "--scenario", "smoke", "--backend", "reference,q-outer-torch", "--dtype", "fp32",
                       "--reuse", "0.5", "--generator", "synthetic", "--no-causal", "--reps", "3", "--out", out)
    assert code == 0, err
    points = load_run(out).status["point_key"].nunique()
    assert made.count("reference") == 2 * points and made.count("q-outer-torch") == points
    assert timed == [("reference", 1), ("reference", 3), ("q-outer-torch", 3)] * points
    timed_stages = load_run(out).samples.query("stage != 'plan'")            # plan: one host sample
    assert (timed_stages.groupby(["point_key", "backend", "stage"]).size() == 3).all()   # none of the dropped plan's
