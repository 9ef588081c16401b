"""The recorder (msa_bench.capture): its sampling limits, off costs nothing, and real capture of a small
MSA-style indexer on random weights, loaded back as workloads that pass the float64 check."""
import subprocess
import sys

import pytest
import torch

from msa_bench.capture import ENV, Recorder
from msa_bench.capture.msa_indexer import TinyMSAModel, smooth_hidden
from msa_bench.roofline.shape import AttnShape
from msa_bench.scenarios.trace import read_call, read_index
from msa_bench.scenarios.trace_workload import call_workload

SHAPE = AttnShape(hq=4, hkv=2, head_dim=16, block=16, topk=4)


def one_call(n: int = 4, context: int = 64) -> tuple:
    pos = torch.arange(context - n, context, dtype=torch.int32)
    own = (pos // SHAPE.block).view(1, -1, 1).expand(SHAPE.hkv, n, 1)
    hist = torch.arange(SHAPE.topk - 1, dtype=torch.int32).view(1, 1, -1).expand(SHAPE.hkv, n, -1)
    return torch.cat([hist, own.int()], -1), pos


def test_every_kth_step_and_chosen_layers_only(tmp_path):
    sel, pos = one_call()
    rec = Recorder(tmp_path / "t.safetensors", SHAPE, every=3, layers={1})
    for _ in range(7):
        rec.step()
        for layer in range(3):
            rec.record(layer, sel, pos)
    info = read_index(rec.close())
    assert [(e.step, e.layer, e.weight) for e in info.calls] == [(0, 1, 3.0), (3, 1, 3.0), (6, 1, 3.0)]
    assert info.provenance["recorder"] == {"every": 3, "max_bytes": 256 << 20, "layers": [1], "steps": 7,
                                           "dropped": 0}


def test_the_byte_cap_stops_recording_and_counts_what_it_dropped(tmp_path):
    sel, pos = one_call()
    size = (sel.numel() + 2 * pos.numel()) * 4          # selection, requests, positions (context comes at close)
    rec = Recorder(tmp_path / "t.safetensors", SHAPE, max_bytes=2 * size + size // 2)
    kept = [rec.record(0, sel, pos) for _ in range(4)]
    assert kept == [True, True, False, False] and rec.dropped == 1 and not rec.wants(0)
    assert len(read_index(rec.close()).calls) == 2


def test_off_records_nothing_and_writes_nothing(tmp_path, monkeypatch):
    sel, pos = one_call()
    monkeypatch.delenv(ENV, raising=False)
    for rec in (Recorder(None, SHAPE), Recorder.from_env(SHAPE)):
        rec.step()
        assert not rec.wants(0) and rec.record(0, sel, pos) is False and rec.close() is None
    monkeypatch.setenv(ENV, str(tmp_path / "env.safetensors"))
    rec = Recorder.from_env(SHAPE)
    assert rec.record(0, sel, pos) and rec.close() == tmp_path / "env.safetensors"


def test_token_major_int64_ids_and_contexts_worked_out_at_close(tmp_path):
    sel, pos = one_call(n=3, context=64)
    pos2 = torch.arange(20, 22, dtype=torch.int32)
    sel2 = torch.cat([torch.full((SHAPE.hkv, 2, 1), 0), torch.full((SHAPE.hkv, 2, 3), -9)], -1)
    sel2[..., 0] = 1                                            # position 20-21: own block 1, nothing else
    both = torch.cat([sel, sel2], 1)
    req = torch.tensor([0, 0, 0, 1, 1], dtype=torch.int32)
    rec = Recorder(tmp_path / "t.safetensors", SHAPE)
    rec.record(2, both.transpose(0, 1).long(), torch.cat([pos, pos2]), req, heads_first=False)
    info = read_index(rec.close())
    call = read_call(info, 0)
    assert call.selection.dtype == torch.int32 and int(call.selection.min()) == -1
    assert call.context.tolist() == [64, 22] and info.calls[0].context == 64
    call_workload(info, 0, "fp32", with_tensors=False)          # a valid workload


def test_the_engine_may_reuse_its_buffers_after_record(tmp_path):
    sel, pos = one_call()
    rec = Recorder(tmp_path / "t.safetensors", SHAPE)
    rec.record(0, sel, pos)
    want = sel.clone()
    sel.fill_(-1)                                     # the engine's next step writes over its top-k buffer
    pos.zero_()
    call = read_call(read_index(rec.close()), 0)
    assert torch.equal(call.selection, want) and int(call.q_position.min()) > 0


def test_a_selection_of_the_wrong_shape_is_refused_at_once(tmp_path):
    sel, pos = one_call()
    rec = Recorder(tmp_path / "t.safetensors", SHAPE)
    with pytest.raises(ValueError, match=r"not \[Hkv 2, N, top-k 4\]"):
        rec.record(0, sel[:1], pos)


def capture(tmp_path, steps: int = 3):
    """The small MSA-style model, prefill then decode steps, recorded."""
    model = TinyMSAModel(SHAPE, layers=2, width=32, index_dim=8, seed=0)
    gen = torch.Generator().manual_seed(0)
    ctx = [128, 200]
    hidden = [smooth_hidden(c + steps, 32, 0.95, gen) for c in ctx]
    captured = []
    with Recorder(tmp_path / "m.safetensors", SHAPE, provenance={"model": "tiny"}) as rec:
        rec.step()
        captured += model([h[:c] for h, c in zip(hidden, ctx)], [torch.arange(c - 16, c) for c in ctx], rec)
        for s in range(1, steps):
            rec.step()
            captured += model([h[:c + s] for h, c in zip(hidden, ctx)], [torch.tensor([c + s - 1]) for c in ctx], rec)
    return read_index(tmp_path / "m.safetensors"), captured


def test_capture_of_the_msa_indexer_round_trips_and_passes_the_check(tmp_path):
    from msa_bench.harness.measure.check import check_backend, tolerance
    info, captured = capture(tmp_path)
    assert [(e.layer, e.step, e.tokens) for e in info.calls] == [(0, 0, 32), (1, 0, 32), (0, 1, 2), (1, 1, 2),
                                                                 (0, 2, 2), (1, 2, 2)]
    for e, sel in zip(info.calls, captured):
        assert torch.equal(read_call(info, e.call).selection, sel)
        w = call_workload(info, e.call, "fp32")
        err, tol, _ = check_backend("q-outer-torch", w)
        assert err <= tolerance("fp32"), (e.call, err)


def test_the_indexer_keeps_its_own_block_last_and_only_past_blocks(tmp_path):
    info, captured = capture(tmp_path, steps=1)
    c = read_call(info, 0)
    own = (c.q_position.long() // SHAPE.block).view(1, -1)
    count = (c.selection >= 0).sum(-1)
    assert torch.equal(c.selection.long().gather(-1, (count - 1).unsqueeze(-1)).squeeze(-1), own.expand_as(count))
    assert bool(((c.selection.long() < own.unsqueeze(-1)) | (c.selection < 0)).sum(-1).eq(SHAPE.topk - 1).all())


@pytest.mark.cuda
def test_on_a_gpu_the_copy_goes_through_pinned_staging_memory(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    sel, pos = one_call()
    rec = Recorder(tmp_path / "t.safetensors", SHAPE)
    assert rec.record(0, sel.cuda(), pos.cuda())
    assert rec._stager._ring.is_pinned()
    call = read_call(read_index(rec.close()), 0)
    assert torch.equal(call.selection, sel) and rec._stager is None


def test_an_engine_importing_the_recorder_pulls_in_torch_and_the_format_only():
    probe = ("import sys, msa_bench.capture; print(sorted(m for m in ('pandas', 'triton', 'scipy', 'typer', "
             "'msa_bench.kernels', 'msa_bench.harness', 'msa_bench.scenarios.workload') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
