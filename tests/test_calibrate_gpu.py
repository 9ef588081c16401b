"""`msa-bench calibrate --quick` on a GPU: the whole profile in one pass, found by `auto` afterwards."""
import json

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_calibrate_quick_round_trip_and_auto_plans_with_the_profile_it_wrote(tmp_path, monkeypatch, cli):
    from msa_bench.roofline import devices
    from msa_bench.roofline.devices import CALIBRATION_DIR, gpu_slug, resolve_profile
    monkeypatch.chdir(tmp_path)              # results/<gpu>/calibration under this working directory
    monkeypatch.setattr(devices, "PACKAGE_ROOT", tmp_path / "no-checkout")
    code, out, err = cli("calibrate", "--quick")
    assert code == 0, err
    folder = tmp_path / CALIBRATION_DIR.format(slug=gpu_slug(torch.cuda.get_device_name()))
    data = json.loads((folder / "profile.json").read_text())
    for step in ("[1/4]", "[2/4]", "[3/4]", "[4/4]"):
        assert step in out
    assert data["hbm_bytes_per_s"] == pytest.approx(data["measured"]["hbm"]["bytes_per_s"])
    assert data["fixed_costs"]["stages"] and data["achieved"]
    assert data["fitted"]["prefill"]["runs"] and (folder / "prefill-fit" / "run.json").is_file()
    choice = resolve_profile(None)
    assert choice.origin == "calibration" and choice.profile.achieved == data["achieved"]
    # `auto` plans with it: its predictions use the calibrated fractions and fixed costs
    from msa_bench.kernels.base import get_backend
    from msa_bench.scenarios.grid import make_workload, point_from_options
    from msa_bench.scenarios.workload import AttnShape
    w = make_workload(point_from_options("synthetic", AttnShape(), "bf16", tokens=2048, context=16384, reuse=0.25),
                      torch.device("cuda"))
    cands, _ = get_backend("auto").candidates(w)
    used = {name: u for name, (_, _, u) in cands.items()}
    assert any(u.get("achieved") == data["achieved"].get(f"{n}/bf16") for n, u in used.items())
