"""Interleaved rounds (sweep --timer eager --rounds R): a point's units take their samples in turns, each
round in an order rotated by one, a unit that raises drops out while the others go on, and the runs carry
the setting."""
import pytest

from msa_bench.errors import UserError
from msa_bench.harness.measure.timing import EAGER, MODULE, PLAN, TimingConfig, time_rounds
from msa_bench.harness.store.results import load_run
from msa_bench.kernels.base import get_backend

GRID = ["--scenario", "smoke", "--backend", "reference,q-outer-torch", "--dtype", "fp32", "--reuse", "0.5",
        "--reps", "3", "--no-causal", "--generator", "synthetic", "--tokens", "16", "--context", "256"]


def logged_plans(workload, names, log, fail=None):
    """Plans of the reference backend under `names`; every call of a plan's first stage appends its name to
    `log`, and the plan named fail[0] raises on its fail[1]-th call."""
    plans = {}
    for name in names:
        plan = get_backend("reference").plan(workload)
        stages = list(plan.stages.items())
        first_name, first = stages[0]
        calls = [0]

        def first_logged(first=first, name=name, calls=calls):
            calls[0] += 1
            if fail and fail[0] == name and calls[0] == fail[1]:
                raise RuntimeError(f"{name} broke")
            log.append(name)
            first()
        plan.stages = {first_name: first_logged, **dict(stages[1:])}
        plans[name] = plan
    return plans


def config(**kw):
    base = dict(cpu_warmup=1, cpu_reps=6, cpu_max_reps=6, cv_target=10.0, timer=EAGER, rounds=3)
    return TimingConfig(**{**base, **kw})


def test_each_round_takes_every_units_share_in_a_rotated_order(small_workload):
    log = []
    out = time_rounds(logged_plans(small_workload(), "abc", log), config(), "cpu")
    warm, timed = log[:3], "".join(log[3:])
    assert warm == list("abc")
    assert timed == "aabbcc" + "bbccaa" + "ccaabb"
    for name in "abc":
        assert len(out[name][MODULE].seconds) == 6 and out[name][MODULE].converged
        assert len(out[name][PLAN].seconds) == 1


def test_a_unit_that_raises_drops_out_and_the_others_finish(small_workload):
    log = []
    out = time_rounds(logged_plans(small_workload(), "abc", log, fail=("b", 4)), config(), "cpu")
    assert isinstance(out["b"], RuntimeError) and "b broke" in str(out["b"])
    assert "".join(log[3:]) == "aabbcc" + "ccaa" + "ccaa"    # b's third call (round 1) raised
    assert len(out["a"][MODULE].seconds) == len(out["c"][MODULE].seconds) == 6


def test_more_rounds_while_a_units_cv_is_over_the_target(small_workload):
    log = []
    out = time_rounds(logged_plans(small_workload(), "ab", log), config(cv_target=1e-12, cpu_max_reps=9), "cpu")
    for name in "ab":
        assert len(out[name][MODULE].seconds) == 9 and not out[name][MODULE].converged
    assert len(log) == 2 + 18


@pytest.mark.parametrize("kw, words", [
    (dict(rounds=0, timer=EAGER), "rounds must be at least 1"),
    (dict(rounds=2), "rounds interleave the eager timer's units"),
])
def test_bad_rounds_are_refused(kw, words):
    with pytest.raises(UserError, match=words):
        TimingConfig.from_dict({}, **kw)


@pytest.mark.parametrize("extra, words", [
    (["--rounds", "2"], "rounds interleave the eager timer's units"),
    (["--rounds", "2", "--timer", "eager", "--gpus", "2"], "--rounds times a point's units together"),
])
def test_rounds_where_they_cannot_apply_are_one_line(tmp_path, cli, one_error_line, extra, words):
    code, _, err = cli("sweep", *GRID, *extra, "--out", tmp_path / "r")
    assert code == 2 and words in one_error_line(err)


def test_a_sweep_in_rounds_checks_and_writes_every_unit(tmp_path, cli):
    code, _, err = cli("sweep", *GRID, "--timer", "eager", "--rounds", "2", "--out", tmp_path / "r")
    assert code == 0, err
    run = load_run(tmp_path / "r")
    assert run.meta["timing"]["rounds"] == 2 and "--rounds 2" in run.meta["resume_command"]
    assert set(run.status["status"]) == {"ok"} and len(run.status) >= 2
    for _, units in run.status.groupby("point_key"):
        assert sorted(units["nth_on_workload"]) == [0, 1]
    n = run.value("n_reps")
    assert set(n[n["stage"] == MODULE]["value"]) == {4.0}          # reps 3 in 2 rounds: 2 a round
    assert (run.status["max_rel_err"] <= run.status["tol"]).all()
