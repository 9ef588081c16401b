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
                         r"model within 25 % at (\d+) of (\d+) units", lines[3])
    assert total and int(total[2]) == 24 + 14 and int(total[1]) <= 38 and int(total[4]) <= int(total[5])
    assert float(total[3]) == max(float(decode[3]), float(cosel[4]))
    assert decode[0] == "decode" and int(decode[1]) == 24 and cosel[:2] == ["co-selection", "(fit)"]
    # every share is a percentage and every worst ratio at least 1
    for cols in (decode, cosel[1:]):
        assert all(c.endswith("%") and 0 <= int(c[:-1]) <= 100 for c in (cols[2], cols[5], cols[8]))
        assert float(cols[3]) >= 1 and float(cols[6]) >= 1


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


def test_fitting_one_backend_keeps_the_others_and_names_the_commit_that_ran_it(tmp_path, monkeypatch, capsys,
                                                                               load_script):
    """scripts/fit-achieved.py --backend: the other backends' fractions and sources stay (q-packed's fit
    leaves q-packed-cute's), and the source names the run's commit and every update's that re-ran the
    backend."""
    import json
    import shutil
    from msa_bench.harness.store.results import write_meta
    from msa_bench.roofline.devices import CALIBRATION_FILES
    mod = load_script("fit-achieved")
    profile = tmp_path / CALIBRATION_FILES["h200"]
    profile.parent.mkdir(parents=True)
    shutil.copy(ROOT / CALIBRATION_FILES["h200"], profile)
    before = json.loads(profile.read_text())
    monkeypatch.setattr(mod, "PACKAGE_ROOT", tmp_path)
    # the committed run, with q-packed-cute's units said to come from a later sweep (pack-run.py --from)
    run = tmp_path / "co-selection"
    shutil.copytree(ROOT / "results" / "h200" / "co-selection", run, ignore=shutil.ignore_patterns("report"))
    meta = json.loads((run / "run.json").read_text())
    measured = meta["provenance"]["git_commit"][:7]
    meta["updated_from"] = [{"backends": ["q-packed-cute"], "commit": "abcdef0123456789", "units": 14}]
    write_meta(run, meta)
    run = str(run)
    assert mod.main([run, "--backend", "q-packed", "--write"]) == 0
    assert mod.main([run, "--backend", "q-packed-cute", "--write"]) == 0
    after = json.loads(profile.read_text())
    assert {k: v for k, v in after["achieved"].items() if not k.startswith("q-packed")} == \
        {k: v for k, v in before["achieved"].items() if not k.startswith("q-packed")}
    sources = after["achieved_source"].split("; ")
    fitted = [s for s in sources if mod._fitted(s) == "q-packed"]
    assert len(fitted) == 1 and fitted[0].endswith(f"--backend q-packed (commit {measured})")
    assert [s for s in sources if mod._fitted(s) == "q-packed-cute"][0].endswith(f"(commits {measured}, abcdef0)")
    capsys.readouterr()
    # a whole-run fit replaces what the run holds and keeps the `--backend` fits of backends it lacks
    assert mod.main([run, "--write"]) == 0
    whole = json.loads(profile.read_text())
    lacked = {k: v for k, v in before["achieved"].items() if k.split("/")[0] in ("dense-masked", "q-packed-cute@p12")}
    assert len(lacked) == 4 and lacked.items() <= whole["achieved"].items()
    sources = whole["achieved_source"].split("; ")
    assert sorted(mod._fitted(s) for s in sources if mod._fitted(s)) == ["dense-masked", "q-packed-cute@p12"]
    assert sources[-1].startswith(f"scripts/fit-achieved.py {run} (commits {measured}, abcdef0)")
    capsys.readouterr()
