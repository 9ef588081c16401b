"""Selection traces (scenarios/trace.py, trace_workload.py): the format's round trip, one call read alone,
every bad file refused in one line with exit 2, and a trace's calls as scenario points and workloads."""
import json
from pathlib import Path

import pytest
import torch

from msa_bench.harness.running.request import SweepRequest, resolve_scenario, resume_command
from msa_bench.roofline.shape import AttnShape
from msa_bench.scenarios.grid import load_scenario, make_workload
from msa_bench.scenarios.trace import (TraceError, index_entry, read_call, read_index, select_calls, tensor_name,
                                       write_trace)
from msa_bench.scenarios.trace_workload import call_workload

SHAPE = AttnShape(hq=4, hkv=2, head_dim=16, block=16, topk=4)


def causal_call(context: list[int], queries: int, seed: int = 0) -> dict:
    """A valid call: each request's last `queries` tokens, each keeping up to 3 earlier blocks and its own,
    in a scrambled order (own block first) as an engine's top-k may give them."""
    g = torch.Generator().manual_seed(seed)
    sel, req, pos = [], [], []
    for r, c in enumerate(context):
        for p in range(c - queries, c):
            own = p // SHAPE.block
            rows = []
            for _ in range(SHAPE.hkv):
                hist = torch.randperm(own, generator=g)[:SHAPE.topk - 1].tolist()
                rows.append(([own] + hist + [-1] * SHAPE.topk)[:SHAPE.topk])
            sel.append(rows)
            req.append(r)
            pos.append(p)
    return {"selection": torch.tensor(sel, dtype=torch.int32).permute(1, 0, 2).contiguous(),
            "q_request": torch.tensor(req, dtype=torch.int32), "q_position": torch.tensor(pos, dtype=torch.int32),
            "context": torch.tensor(context, dtype=torch.int32)}


def write(path, calls: list[dict], shape=SHAPE, layers=None, provenance=None, meta: dict | None = None) -> Path:
    entries = []
    for i, t in enumerate(calls):
        e = index_entry(i, (layers or [0] * len(calls))[i], i, 1.0, t["selection"], t["context"], shape.block,
                        t.get("page_table"))
        entries.append((e, t))
    path = write_trace(path, shape, entries, provenance or {"model": "test"})
    if meta:
        _edit_metadata(path, meta)
    return path


def _edit_metadata(path: Path, edits: dict) -> None:
    from safetensors.torch import load_file, save_file
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    tensors = load_file(str(path))
    for k, v in edits.items():
        if v is None:
            meta.pop(k)
        else:
            meta[k] = v
    save_file(tensors, str(path), metadata=meta)


def test_round_trip_keeps_every_field_and_the_index(tmp_path):
    calls = [causal_call([100, 70], 5), causal_call([64], 3, seed=1)]
    calls[1]["page_table"] = torch.tensor([[40, 7, 9, 12, 99]], dtype=torch.int32)
    path = write(tmp_path / "t.safetensors", calls, layers=[3, 5], provenance={"model": "m", "engine": "e"})
    info = read_index(path)
    assert info.shape == SHAPE and info.provenance == {"model": "m", "engine": "e"}
    assert [(e.call, e.layer, e.tokens, e.requests, e.context, e.page_table) for e in info.calls] == \
        [(0, 3, 10, 2, 100, False), (1, 5, 3, 1, 64, True)]
    assert info.calls[0].pages == 7 + 5 and info.calls[1].pages == 4
    for e, want in zip(info.calls, calls):
        got = read_call(info, e.call)
        for field, t in want.items():
            assert torch.equal(getattr(got, field), t), field


def test_one_call_is_read_without_the_others(tmp_path, monkeypatch):
    import safetensors
    path = write(tmp_path / "t.safetensors", [causal_call([64], 4, seed=s) for s in range(3)])
    info = read_index(path)
    read = []
    real = safetensors.safe_open

    class Spy:
        def __init__(self, *a, **k):
            self.f = real(*a, **k)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def get_tensor(self, name):
            read.append(name)
            return self.f.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    read_call(info, 1)
    assert read and all(name.startswith("call.000001.") for name in read)


def test_a_call_becomes_a_workload_in_the_contract_order(tmp_path):
    call = causal_call([100, 70], 5)
    info = read_index(write(tmp_path / "t.safetensors", [call]))
    w = call_workload(info, 0, "fp32")
    own = (w.q_limit.long() // SHAPE.block).view(1, -1)
    count = (w.selection >= 0).sum(-1)
    assert torch.equal(w.selection.long().gather(-1, (count - 1).unsqueeze(-1)).squeeze(-1), own.expand_as(count))
    # the same blocks as captured, only reordered
    assert torch.equal(w.selection.sort(-1).values, call["selection"].sort(-1).values)
    assert w.meta["kv_lens"] == [100, 70] and w.num_pages == 7 + 5


def test_a_recorded_page_table_is_renumbered_with_its_sharing_kept(tmp_path):
    call = causal_call([48, 40], 2)
    call["page_table"] = torch.tensor([[900, 31, 5, 77], [900, 31, 6, -5]], dtype=torch.int32)  # a shared prefix
    info = read_index(write(tmp_path / "t.safetensors", [call]))
    w = call_workload(info, 0, "fp32", with_tensors=False)
    assert w.num_pages == 4 == info.calls[0].pages         # 900, 31, 5 and 6
    assert torch.equal(w.page_table[0, :2], w.page_table[1, :2]) and int(w.page_table[0, 3]) == -1


def _bad(tmp_path, case: str) -> Path:
    p = tmp_path / "bad.safetensors"
    good = causal_call([64], 4)
    if case == "missing":
        return tmp_path / "nothing.safetensors"
    if case == "garbage":
        p.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header at all")
        return p
    if case == "not-a-trace":
        from safetensors.torch import save_file
        save_file({"x": torch.zeros(2)}, str(p), metadata={"format": "pt"})
        return p
    if case == "version":
        return write(p, [good], meta={"version": "9"})
    if case == "shape":
        return write(p, [good], meta={"shape": '{"hq": 4, "hkv": 3, "head_dim": 16, "block": 16, "topk": 4}'})
    if case == "no-index":
        return write(p, [good], meta={"index": None})
    if case == "missing-tensor":
        idx = json.loads(json.dumps([index_entry(0, 0, 0, 1.0, good["selection"], good["context"], 16, None),
                                     index_entry(1, 0, 0, 1.0, good["selection"], good["context"], 16, None)]))
        return write(p, [good], meta={"index": json.dumps(idx)})
    t = dict(good)
    if case == "heads":
        t["selection"] = torch.cat([t["selection"]] * 2)      # 4 KV heads in a trace of 2
        return write(p, [t])
    if case == "int64":
        from safetensors.torch import load_file, save_file
        write(p, [t])
        tensors = load_file(str(p))
        tensors[tensor_name(0, "selection")] = tensors[tensor_name(0, "selection")].long()
        from safetensors import safe_open
        with safe_open(str(p), "pt") as f:
            meta = f.metadata()
        save_file(tensors, str(p), metadata=meta)
        return p
    sel = t["selection"].clone()
    if case == "past-context":
        sel[1, 2, 1] = 4                      # a 64-token context holds blocks 0 to 3
    elif case == "future":
        t["context"] = torch.tensor([200], dtype=torch.int32)
        sel[0, 0, 1] = 10                     # after the query's own block 3
    elif case == "no-own-block":
        sel[0, 1, 0] = -1
    elif case == "repeat":
        sel[1, 3, 2] = sel[1, 3, 1]
    elif case == "position":
        t["q_position"] = t["q_position"] + 10
    elif case == "request":
        t["q_request"] = t["q_request"] + 1
    elif case == "below-minus-one":
        sel[0, 0, 3] = -7
    t["selection"] = sel
    return write(p, [t])


BAD = {"missing": "does not exist", "garbage": "not a safetensors file", "not-a-trace": "not a selection trace",
       "version": "version '9'", "shape": "not an attention shape", "no-index": "no 'index'",
       "missing-tensor": "has no tensor call.000001.selection", "heads": "selection is [4, 4, 4]",
       "int64": "selection is torch.int64", "past-context": "past the blocks of its request 0",
       "future": "starts after the query's last visible key", "no-own-block": "does not select its own block",
       "repeat": "repeats block", "position": "outside its request's context", "request": "names request 1",
       "below-minus-one": "holds id -7 below -1"}


@pytest.mark.parametrize("case", BAD)
def test_every_bad_file_is_one_line_and_exit_2(tmp_path, cli, one_error_line, case):
    code, out, err = cli("workload", "--trace", _bad(tmp_path, case))
    line = one_error_line(err)
    assert code == 2 and BAD[case] in line, line


def test_bad_calls_and_options_beside_a_trace_are_refused(tmp_path, cli, one_error_line):
    path = write(tmp_path / "t.safetensors", [causal_call([64], 4), causal_call([64], 2)])
    for args, want in ((("--calls", "0,5"), "(it holds 0-1)"), (("--calls", "x"), "expected call ids"),
                       (("--reuse", "0.5"), "--reuse does not apply to --trace"),
                       (("--hkv", "2"), "--hkv does not apply to --trace")):
        code, _, err = cli("workload", "--trace", path, *args)
        assert code == 2 and want in one_error_line(err)
    code, _, err = cli("workload", "--calls", "0")
    assert code == 2 and "--calls needs --trace" in one_error_line(err)
    code, _, err = cli("check", "--backend", "reference", "--trace", path, "--tokens", "8")
    assert code == 2 and "--tokens does not apply to --trace" in one_error_line(err)


def test_select_calls_takes_ranges_in_trace_order(tmp_path):
    info = read_index(write(tmp_path / "t.safetensors", [causal_call([64], 2, seed=s) for s in range(6)]))
    assert [e.call for e in select_calls(info, "4-5,0,2")] == [0, 2, 4, 5]
    assert len(select_calls(info, None)) == 6
    with pytest.raises(TraceError, match="runs backwards"):
        select_calls(info, "3-1")


def _scenario(tmp_path, grid: str, shape: str = "") -> Path:
    f = tmp_path / "s.toml"
    f.write_text(f'description = "t"\nbackends = ["reference"]\n{shape}\n[grid]\n{grid}\n')
    return f


def test_a_scenario_runs_a_trace_relative_to_its_file(tmp_path):
    (tmp_path / "traces").mkdir()
    write(tmp_path / "traces" / "m.safetensors", [causal_call([64, 48], 3, seed=s) for s in range(3)], layers=[0, 1, 0])
    sc = load_scenario(str(_scenario(tmp_path, 'generator = "trace"\ntrace = "traces/m.safetensors"\n'
                                               'calls = [0, 2]\ndtypes = ["fp32", "fp16"]')))
    assert [p.key() for p in sc.points][:2] == ["trace/m/call.000000/L0/fp32/seed0/hq4-hkv2-d16-b16-top4",
                                                "trace/m/call.000000/L0/fp16/seed0/hq4-hkv2-d16-b16-top4"]
    assert {p.call for p in sc.points} == {0, 2} and all(p.shape == SHAPE for p in sc.points)
    w = make_workload(sc.points[0])
    assert w.n_tokens == 6 and w.meta["layer"] == 0


def test_a_scenario_shape_that_is_not_the_traces_is_refused(tmp_path, cli, one_error_line):
    write(tmp_path / "m.safetensors", [causal_call([64], 3)])
    f = _scenario(tmp_path, 'generator = "trace"\ntrace = "m.safetensors"', "[shape]\nhq = 8\nhkv = 2\nhead_dim = 16\n"
                  "block = 16\ntopk = 4")
    code, _, err = cli("sweep", "--scenario", f, "--out", tmp_path / "r")
    assert code == 2 and "holds shape Hq 4, Hkv 2, D 16, block 16, top-4, the scenario's [shape] says Hq 8" \
        in one_error_line(err)


def test_sweep_trace_takes_the_traces_calls_and_resumes_with_them(tmp_path):
    path = write(tmp_path / "m.safetensors", [causal_call([64], 3, seed=s) for s in range(3)])
    req = SweepRequest(trace=str(path), calls="1-2", dtypes=["fp32"], backends=["reference"])
    scenario, overrides = resolve_scenario(req, torch.device("cpu"), [])
    assert [p.call for p in scenario.points] == [1, 2] and scenario.backends == ["reference"]
    assert overrides["calls"] == "1-2" and overrides["trace"] == str(path.resolve())
    assert f"--trace {path} --calls=1-2" in resume_command(req, "smoke", Path("r"))


def test_sweep_on_a_trace_runs_each_call_and_reports_the_fastest_per_layer(tmp_path, cli):
    path = write(tmp_path / "m.safetensors", [causal_call([64, 40], 4, seed=s) for s in range(3)], layers=[0, 1, 0])
    code, out, err = cli("sweep", "--trace", path, "--backend", "reference,q-outer-torch", "--dtype", "fp32",
                         "--reps", "1", "--out", tmp_path / "run")
    assert code == 0, err
    assert "(6 ok)" in out
    import hashlib
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["traces"] == {str(path.resolve()): hashlib.sha256(path.read_bytes()).hexdigest()}
    code, _, err = cli("report", tmp_path / "run")
    assert code == 0, err
    summary = (tmp_path / "run" / "report" / "summary.md").read_text()
    table = summary.split("## Trace: the fastest backend per layer")[1].split("##")[0]
    rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| 0") or line.startswith("| 1")]
    assert [(r[0].strip(), r[2].strip(), r[3].strip()) for r in rows] == [("0", "2", "2"), ("1", "1", "1")]
    assert all(r[4].strip().endswith("%") for r in rows)


def test_check_trace_checks_every_call(tmp_path, cli):
    path = write(tmp_path / "m.safetensors", [causal_call([64, 40], 4, seed=s) for s in range(2)], layers=[0, 1])
    code, out, err = cli("check", "--backend", "q-outer-torch", "--dtype", "fp32", "--trace", path)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[1].startswith("  call    0 layer   0: N=8 requests=2") and lines[2].startswith("  call    1 layer   1")
    assert lines[-1].endswith("PASS")


def test_the_shipped_example_says_it_is_synthetic():
    sc = load_scenario("trace-example")
    info = read_index(sc.points[0].trace)
    assert "synthetic" in info.provenance and "not a real model" in info.provenance["synthetic"]
    assert info.shape == AttnShape() and Path(info.path).stat().st_size < 1 << 20


def test_workload_trace_prints_80_columns_or_json(tmp_path, cli):
    path = write(tmp_path / "m.safetensors", [causal_call([160, 96], 16, seed=s) for s in range(3)], layers=[0, 1, 0])
    code, out, err = cli("workload", "--trace", path, "--calls", "0-2", "--device", "h200")
    assert code == 0, err
    first, *rest = out.splitlines()
    assert first == f"trace {path}" and max(map(len, rest)) <= 80 and "nearest synthetic" in out
    code, out, err = cli("workload", "--trace", path, "--device", "h200", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert [c["layer"] for c in doc["calls"]] == [0, 1, 0] and doc["shape"]["hkv"] == SHAPE.hkv
    layers = {(d["statistic"], d["layer"]): d["calls"] for d in doc["distributions"]}
    assert layers[("nsb/N", "all")] == 3 and layers[("nsb/N", "0")] == 2
    assert all(c["schedule"] and c["stats"]["union_ratio_p8"] >= 1 for c in doc["calls"])


def test_a_bad_call_stops_sweep_and_check_before_anything_runs(tmp_path, cli, one_error_line):
    bad = _bad(tmp_path, "past-context")
    code, _, err = cli("sweep", "--trace", bad, "--backend", "reference", "--dtype", "fp32", "--out", tmp_path / "r")
    assert code == 2 and BAD["past-context"] in one_error_line(err) and not (tmp_path / "r").exists()
    code, out, err = cli("check", "--backend", "reference", "--dtype", "fp32", "--trace", bad)
    assert code == 2 and BAD["past-context"] in one_error_line(err) and out == ""
