"""scripts/auto-validation.py --fit-fixed --write-profile: the fitted costs become a preset's fixed-costs file."""
import importlib.util
import json
from pathlib import Path

from msa_bench.roofline import devices
from msa_bench.roofline.devices import PRESETS, load_device

ROOT = Path(__file__).resolve().parents[1]
RUN = str(ROOT / "results" / "h200" / "baseline")


def script():
    spec = importlib.util.spec_from_file_location("auto_validation", ROOT / "scripts" / "auto-validation.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_written_fixed_costs_are_what_the_h200_preset_loads(tmp_path, monkeypatch, capsys):
    path = tmp_path / "h200.json"
    assert script().main([RUN, "--fit-fixed", RUN, "--write-profile", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {path}" in out and "no fixed costs fitted for (auto skips them): " in out
    data = json.loads(path.read_text())
    assert "--fit-fixed on " + RUN in data["source"] and data["fixed_costs"]["stages"]
    monkeypatch.setattr(devices, "PACKAGE_ROOT", tmp_path)
    monkeypatch.setitem(devices.CALIBRATION_FILES, "h200", "h200.json")
    got = load_device("h200")
    assert got.fixed_costs == data["fixed_costs"] and got.achieved == PRESETS["h200"].achieved


def test_write_profile_without_a_fit_is_refused(tmp_path, capsys):
    assert script().main([RUN, "--write-profile", str(tmp_path / "x.json")]) == 2
    assert "--fit-fixed" in capsys.readouterr().err and not (tmp_path / "x.json").exists()
