"""What a new user meets at the command line: a GPU scenario on a CPU, options of every command that
makes a workload, the plan `check` prints, help that states defaults and names every schedule."""
import tomllib
from pathlib import Path

import pytest
import torch
import typer

from msa_bench.cli import app
from msa_bench.harness.measure.check import plan_lines
from msa_bench.harness.running.request import SweepRequest, resolve_scenario, resume_command
from msa_bench.harness.measure.timing import MIN_GPU_REPS, TimingConfig
from msa_bench.harness.store.results import UnreadableFile, damaged_units

ROOT = Path(__file__).resolve().parents[1]
SCHEDULES = ("KV-outer", "token-packed", "hybrid", "auto", "FlashInfer", "MSA-style scatter", "dense")


def _help(command: str, option: str) -> str:
    cmd = typer.main.get_command(app).commands[command]
    return next(p.help for p in cmd.params if p.name == option)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal applies where no GPU is visible")
def test_a_shipped_gpu_scenario_is_refused_on_a_cpu_unless_cpu_ok(tmp_path, cli, one_error_line):
    code, _, err = cli("sweep", "--scenario", "real-prefill", "--out", tmp_path / "r")
    line = one_error_line(err)
    assert code == 2 and "--scenario smoke" in line and "under a minute" in line and "--cpu-ok" in line
    assert not (tmp_path / "r").exists()
    code, _, err = cli("sweep", "--scenario", "real-prefill", "--cpu-ok", "--dtype", "fp64", "--out", tmp_path / "r")
    warning, error = err.strip().splitlines()
    assert warning.startswith("warning: no GPU here") and "--scenario smoke" in warning
    assert code == 2 and "unknown dtype 'fp64'" in error       # past the refusal, stopped by the bad dtype


def test_share_group_errors_name_share_group(cli, one_error_line):
    code, _, err = cli("workload", "--share", "0.5", "--share-group", "0")
    assert code == 2 and one_error_line(err).startswith("error: --share-group: ")


def test_sweep_takes_share_and_share_group_and_resumes_with_them():
    req = SweepRequest(scenario="smoke", reuse=[1.5], share=[0.5], share_group=[4], dtypes=["fp32"])
    scenario, overrides = resolve_scenario(req, torch.device("cpu"), [])
    synthetic = [p for p in scenario.points if p.generator == "synthetic"]
    assert synthetic and all(p.share == 0.5 and p.share_group == 4 for p in synthetic)
    assert overrides["share"] == [0.5] and overrides["share_group"] == [4]
    assert "--share 0.5 --share-group 4" in resume_command(req, "smoke", Path("r"))


def test_check_takes_share_and_prints_the_plan_as_named_lines(cli):
    code, out, err = cli("check", "--backend", "reference", "--share", "1", "--share-group", "4")
    assert code == 0, err
    assert "share=1 group=4" in out.splitlines()[0]
    assert "{" not in out and "\nplan:\n  compute_dtype    float32\n" in out


def test_plan_lines_name_each_entry_within_80_columns():
    info = {"attention_impl": "triton", "config": {f"option_{i}": i for i in range(20)}, "tile_rows": 16}
    lines = plan_lines(info)
    assert lines[0] == "  attention_impl   triton" and lines[-1] == "  tile_rows        16"
    assert len(lines) > 4 and all(len(line) <= 80 for line in lines)
    assert lines[1].startswith("  config           option_0 0, option_1 1")


def test_sweep_reps_help_states_its_defaults():
    text = _help("sweep", "reps")
    assert f"else {TimingConfig.reps} on a GPU, {TimingConfig.cpu_reps} on a CPU" in text
    assert TimingConfig.reps == MIN_GPU_REPS


def test_top_level_help_and_package_description_name_every_schedule():
    description = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["description"]
    for text in (app.info.help, description):
        missing = [s for s in SCHEDULES if s not in text]
        assert not missing, (missing, text)


# ---- bad input gets one line and exit 2, never an internal error or a silent default -----------------

@pytest.mark.parametrize("command", [["workload"], ["check", "--backend", "reference"], ["sweep", "--scenario", "smoke"]])
def test_a_reuse_that_overflows_is_infeasible_not_an_internal_error(command, tmp_path, cli, one_error_line):
    code, _, err = cli(*command, "--reuse", "1e308", *(["--out", tmp_path / "r"] if command[0] == "sweep" else []))
    line = one_error_line(err)
    assert code == 2 and "reuse 1e+308 is infeasible" in line and "feasible reuse is" in line
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("key,value", [("hbm_bytes_per_s", "NaN"), ("hbm_bytes_per_s", "Infinity"),
                                       ("l2_bytes_per_s", "NaN"), ("l2_bytes_per_s", "-Infinity"),
                                       ("l2_bytes_per_s", "0"), ("mma_flops", '{"bf16": NaN}'),
                                       ("mma_flops", '{"bf16": 1e15, "fp8": Infinity}')])
def test_a_device_profile_with_a_rate_that_is_not_a_positive_number_is_refused(key, value, tmp_path, cli,
                                                                                one_error_line):
    fields = {"name": '"x"', "hbm_bytes_per_s": "4e12", "l2_bytes_per_s": "8e12", "mma_flops": '{"bf16": 8e14}',
              "l2_bytes": "62914560", "sms": "132", key: value}
    path = tmp_path / "profile.json"
    path.write_text("{" + ", ".join(f'"{k}": {v}' for k, v in fields.items()) + "}")
    code, out, err = cli("roofline", "--device", path)
    line = one_error_line(err)
    assert code == 2 and key in line and "positive finite" in line and not out


def test_roofline_device_that_is_a_directory_says_so(tmp_path, cli, one_error_line):
    (tmp_path / "profile.json").write_text("{}")
    code, _, err = cli("roofline", "--device", tmp_path)
    line = one_error_line(err)
    assert code == 2 and "is a directory, not a profile file" in line and str(tmp_path / "profile.json") in line


def test_sweep_refuses_a_non_empty_folder_that_holds_no_run(tmp_path, cli, one_error_line):
    (tmp_path / "notes.txt").write_text("mine")
    code, _, err = cli("sweep", "--scenario", "smoke", "--out", tmp_path)
    line = one_error_line(err)
    assert code == 2 and f"--out {tmp_path} exists and is not empty" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_slurm_refuses_a_backend_name_as_sweep_does(tmp_path, cli, one_error_line):
    code, _, err = cli("sweep", "--scenario", "smoke", "--backend", "nosuch", "--out", tmp_path / "r")
    refused = one_error_line(err)
    code2, out, err = cli("slurm", "smoke", "--backend", "nosuch")
    assert code == code2 == 2 and one_error_line(err) == refused and "unknown backend 'nosuch'" in refused
    assert not out


@pytest.mark.parametrize("option", ["delay-5", "delaynan", "delay1e9", "delay0", "delay5+v28"])
def test_a_bad_delay_option_says_what_the_delay_takes(option, cli, one_error_line):
    code, _, err = cli("slurm", "smoke", "--backend", f"kv-outer@{option}")
    line = one_error_line(err)
    assert code == 2 and "takes no @option" not in line
    assert f"'{option}'" in line and "delayP" in line and "(0, 1000]" in line and "last word" in line


def test_a_serving_step_too_large_blames_the_option_that_made_it(cli, one_error_line):
    code, _, err = cli("workload", "--generator", "mixed", "--requests", "4", "--chunks", "1000000")
    line = one_error_line(err)
    assert code == 2 and line.startswith("error: --chunks: the step's N = 1000000 chunk(s) x 16384 tokens + 4 ")
    code, _, err = cli("workload", "--generator", "decode", "--requests", "1000000000", "--context", "4096")
    assert code == 2 and one_error_line(err).startswith("error: --requests: ")


def _text_params():
    """(command, its click parameter) for every text option and argument of every command."""
    commands = typer.main.get_command(app).commands
    return [(name, p) for name, cmd in sorted(commands.items()) for p in cmd.params
            if p.type_descriptor.annotation in (str, list[str])]


@pytest.mark.parametrize("command,param", _text_params(), ids=lambda v: v if isinstance(v, str) else v.name)
def test_an_empty_text_value_is_refused_not_read_as_not_given(command, param, cli, one_error_line):
    cmd = typer.main.get_command(app).commands[command]
    args = [command]
    for p in cmd.params:
        if p.param_type_name == "argument":
            args.append("" if p.name == param.name else "x")
    if param.param_type_name == "option":
        args += [max(param.opts, key=len), ""]
    code, out, err = cli(*args)
    line = one_error_line(err)
    named = max(param.opts, key=len) if param.param_type_name == "option" else param.name.upper()
    assert code == 2 and line.startswith(f"error: {named} is empty: ") and not out


def test_report_of_an_interrupted_run_says_what_is_missing_and_the_command_that_resumes_it(tmp_path, cli):
    run = tmp_path / "run"
    code, _, err = cli("sweep", "--scenario", "smoke", "--backend", "reference", "--dtype", "fp32", "--reps", "1",
                       "--out", run, env={"MSA_BENCH_INTERRUPT_AFTER_UNITS": "2"})
    assert code == 130, err
    printed = err.split("resume with: ")[1].strip()
    code, out, err = cli("report", run)
    assert code == 0 and out.startswith("wrote ")
    (line,) = [ln for ln in err.splitlines() if ln.strip()]
    assert line == f"warning: run incomplete: 6 of 8 planned unit(s) missing; resume with: {printed}"
    assert f"- run incomplete: 6 of 8 planned unit(s) missing; resume with: {printed}\n" in \
        (run / "report" / "summary.md").read_text()


# ---- messages that say what is wrong -----------------------------------------------------------------

FIXTURE = ROOT / "results" / "fixtures" / "smoke-run"


def _edited_copy(tmp_path, edit, name="status.json", unit="kv-outer-09cae3838a00b71a"):
    """A copy of the CPU fixture run with one JSON file edited: edit(dict) changes it in place."""
    import json
    import shutil
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    path = run / name if name == "run.json" else run / "units" / unit / name
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    return run, path


@pytest.mark.parametrize("command", ["report", "compare", "merge"])
def test_an_ok_unit_without_max_rel_err_is_named_by_that_field(command, tmp_path, cli, one_error_line):
    run, path = _edited_copy(tmp_path, lambda d: d.pop("max_rel_err"))
    args = {"report": [run], "compare": [FIXTURE, run], "merge": [tmp_path / "m", run]}[command]
    code, _, err = cli(command, *args)
    line = one_error_line(err)
    assert code == 2 and f"{path}: status 'ok' but no field 'max_rel_err'" in line


@pytest.mark.parametrize("edit,said", [(lambda d: d.pop("scenario"), "no field 'scenario' (the name of the scenario"),
                                        (lambda d: d.update(scenario=42), "field 'scenario' must be the scenario's "
                                                                         "name, got 42")])
def test_an_edited_scenario_in_run_json_is_named(edit, said, tmp_path, cli, one_error_line):
    run, path = _edited_copy(tmp_path, edit, name="run.json")
    code, _, err = cli("report", run)
    line = one_error_line(err)
    assert code == 2 and f"{path}: {said}" in line


def test_an_unreadable_results_file_is_not_called_corrupt(tmp_path, cli, one_error_line, monkeypatch):
    import pandas as pd
    run, _ = _edited_copy(tmp_path, lambda d: None)
    locked = run / "units" / "kv-outer-09cae3838a00b71a" / "samples.parquet"
    read = pd.read_parquet

    def read_parquet(path, *args, **kwargs):       # what pyarrow raises for a file without read permission
        if Path(path) == locked:
            raise PermissionError(13, f"Failed to open local file '{path}'. Detail: [errno 13] Permission denied")
        return read(path, *args, **kwargs)
    monkeypatch.setattr(pd, "read_parquet", read_parquet)
    for args in (["report", run], ["compare", FIXTURE, run], ["merge", tmp_path / "m", run]):
        code, _, err = cli(*args)
        line = one_error_line(err)
        assert code == 2 and f"cannot read {locked}: permission denied" in line, args
        assert "corrupt" not in line and "--resume" not in line
    with pytest.raises(UnreadableFile):
        damaged_units(run)              # what `sweep --resume` sets aside: an unreadable unit is not one


def test_compare_against_a_baseline_of_another_scenario_says_so(tmp_path, cli, one_error_line, fake_run):
    base = fake_run(tmp_path / "base", {"kv-outer": [1e-3] * 5, "flashinfer": [1e-3] * 5}, scenario="default")
    new = fake_run(tmp_path / "new", {"kv-outer": [1e-3] * 5}, scenario="smoke")
    code, _, err = cli("compare", base, new)
    line = one_error_line(err)
    assert code == 2 and "different scenarios (baseline 'default', new 'smoke')" in line
