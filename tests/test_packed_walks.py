"""scripts/packed-walks.py: bad input and a host without a GPU are one line and exit 2 (its walks need the
schedule stage, which runs on the GPU; test_q_packed.py holds the critical walk itself)."""
import pytest
import torch


def test_no_scenario_is_the_usage_line(capsys, load_script):
    assert load_script("packed-walks").main(["out.jsonl"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("python scripts/packed-walks.py OUT.jsonl SCENARIO")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU host's refusal")
def test_a_host_without_a_gpu_is_one_line(tmp_path, capsys, load_script):
    assert load_script("packed-walks").main([str(tmp_path / "w.jsonl"), "drift"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "CUDA GPU" in err[0] and not (tmp_path / "w.jsonl").exists()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_an_unknown_scenario_is_one_line(tmp_path, capsys, load_script):
    assert load_script("packed-walks").main([str(tmp_path / "w.jsonl"), "no-such-scenario"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
