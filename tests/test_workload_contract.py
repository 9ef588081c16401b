"""Every workload is validated where it is built (Python API included), and the workload command
refuses what a scenario file refuses, in one line."""
import json

import pytest
import torch
from typer.testing import CliRunner

from msa_bench.cli import app
from msa_bench.scenarios.workload import AttnShape, WorkloadError, build_workload

SHAPE = AttnShape(hq=4, hkv=2, head_dim=8, block=4, topk=4)
N = 3


def build(selection, causal=False, q_limit=None, page_table=None):
    """One request of 8 blocks (32 tokens); non-causal queries see all of it, causal ones sit at 29-31."""
    sel = torch.tensor(selection, dtype=torch.int32)
    if q_limit is None:
        q_limit = torch.arange(29, 32) if causal else torch.full((N,), 31)
    table = torch.arange(8).view(1, 8) if page_table is None else page_table
    return build_workload(SHAPE, "fp32", sel, table.int(), torch.zeros(N, dtype=torch.int32),
                          q_limit.int(), 8, causal)


def good_rows(causal=False):
    row = [3, 5, 1, 7] if causal else [0, 5, 2, -1]
    return [[list(row) for _ in range(N)] for _ in range(SHAPE.hkv)]


def with_row(causal, head, token, row):
    sel = good_rows(causal)
    sel[head][token] = row
    return sel


@pytest.mark.parametrize("causal, row, why, slot", [
    (False, [0, 5, 5, -1], "repeats block 5", 2),
    (False, [0, -1, 2, -1], "valid id after -1 padding", 2),
    (False, [0, 5, -3, -1], "id -3 below -1", 2),
    (False, [0, 5, 8, -1], "block 8", 2),                         # past the request's 8 blocks
    (True, [3, 5, 7, 6], "does not end with the query's local block 7", 3),
    (True, [7, 3, -1, -1], "does not end with the query's local block 7", 1),
])
def test_build_workload_rejects_each_violation_naming_head_token_slot(causal, row, why, slot):
    with pytest.raises(WorkloadError) as exc:
        build(with_row(causal, 1, 2, row), causal)
    assert why in str(exc.value) and f"(head 1, token 2, slot {slot})" in str(exc.value), str(exc.value)


def test_future_blocks_and_empty_rows_are_rejected_in_causal_mode():
    q_limit = torch.tensor([20, 21, 31])             # token 0 sees up to block 5 (position 20)
    sel = good_rows(True)
    sel[0][0] = [3, 7, 1, 5]                          # block 7 starts at 28 > 20: a future block
    with pytest.raises(WorkloadError, match=r"block 7 at \(head 0, token 0, slot 1\), which starts after"):
        build(sel, True, q_limit)
    sel = good_rows(True)
    sel[1][1] = [-1, -1, -1, -1]
    with pytest.raises(WorkloadError, match=r"no block at \(head 1, token 1\)"):
        build(sel, True)


def test_a_block_missing_from_the_page_table_is_a_workload_error_not_an_index_error():
    table = torch.tensor([[0, 1, 2, 3, 4, 5, -1, -1]])           # the request holds 6 blocks
    with pytest.raises(WorkloadError, match=r"block 7 at \(head 0, token 0, slot 1\), past the blocks"):
        build(with_row(False, 0, 0, [0, 7, -1, -1]), page_table=table)
    with pytest.raises(WorkloadError, match="past the blocks"):
        build(with_row(False, 0, 0, [0, 9, -1, -1]))              # past the page table's width


def test_valid_workloads_still_build():
    assert build(good_rows(False)).n_tokens == N
    assert build(good_rows(True), True).causal
    masked = good_rows(False)                                   # not causal: a wholly masked block is allowed
    w = build(masked, q_limit=torch.tensor([31, 31, 10]))
    assert int(w.selection[0, 2, 1]) == 5


runner = CliRunner()


def test_workload_refuses_options_its_generator_does_not_use(cli, one_error_line, tmp_path):
    case = "prefill_4469427d069d9467c4ec"
    for option in (["--tokens", "5"], ["--context", "4096"], ["--reuse", "1"], ["--causal"], ["--skew", "1"]):
        code, _, err = cli("workload", "--generator", "real-prefill", "--case", case, *option)
        assert code == 2 and f"{option[0]} does not apply to --generator real-prefill" in one_error_line(err)
    code, _, err = cli("workload", "--generator", "indexer", "--reuse", "1")
    assert code == 2 and "--reuse does not apply to --generator indexer" in one_error_line(err)
    # a scenario grid refuses the same thing
    toml = tmp_path / "s.toml"
    toml.write_text(f'description = "x"\nbackends = ["reference"]\n[grid]\ngenerator = "real-prefill"\n'
                    f'cases = ["{case}"]\ntokens = 5\n')
    code, _, err = cli("sweep", "--scenario", toml, "--out", tmp_path / "r")
    assert code == 2 and "tokens does not apply to generator real-prefill" in one_error_line(err)


@pytest.mark.parametrize("args, needle", [
    (["--seed", str(2**64)], "--seed: seed must be in [0, 2^63)"),
    (["--seed", "-1"], "--seed: seed must be in [0, 2^63)"),
    (["--tokens", "2000000000", "--context", "2000000000"], "overflow int32 indices"),
    (["--generator", "indexer", "--tokens", "1024", "--context", "65536", "--head-dim", str(2**20)],
     "GiB, more than the"),                                      # the indexer draws Q/K/V: 400+ GiB
])
def test_workload_sizes_that_cannot_be_built_are_one_line(cli, one_error_line, args, needle):
    code, _, err = cli("workload", *args)
    assert code == 2 and needle in one_error_line(err)


def test_real_prefill_case_ids_are_listed_where_the_error_points():
    res = runner.invoke(app, ["workload", "--generator", "real-prefill"])
    assert "`msa-bench scenarios --cases`" in str(res.exception)
    res = runner.invoke(app, ["scenarios", "--cases"])
    assert res.exit_code == 0 and "prefill_c17ccf7fbbb5d1ee5648" in res.output and "prefill_4469427d069d" in res.output


def _help(command: str) -> str:
    res = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    return " ".join(res.output.replace("│", " ").split())


def test_check_help_shows_the_real_defaults():
    text = _help("check")
    assert "(default: 40 on CPU, 4096 on a GPU)." in text and "on a GPU). [default: 0]" not in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback applies where no GPU is visible")
def test_roofline_and_workload_default_to_one_device_rule():
    roof = runner.invoke(app, ["roofline", "--json"])
    work = runner.invoke(app, ["workload", "--json", "--tokens", "1024", "--context", "65536"])
    device = json.loads(roof.output)["device"]
    assert device == json.loads(work.output)["device"] and device.startswith("h200")   # its calibrated profile where one is committed
    for command in ("roofline", "workload"):
        assert "without a GPU, h200" in " ".join(_help(command).split())
