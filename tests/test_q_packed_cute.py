"""q-packed-cute on the CPU: the sm_90a build of kernels/cute/q_packed_sm90.py (a real DSL compile, export and
link, no GPU), what its PTX and SASS hold per schedule option, the library's C ABI against the kernel's
signature, the manifest checks, and the backend's wiring (availability, argument packing). The GPU checks
are tests/test_q_packed_cute_gpu.py."""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from msa_bench.harness.measure.check import edge_case_workload  # sets TRITON_INTERPRET first
from msa_bench.kernels.base import get_backend
from msa_bench.kernels.cute import manifest as mf
from msa_bench.kernels.cute.build import dsl_unavailable_reason
from msa_bench.kernels.cute.loader import pack_arguments
from msa_bench.kernels.cute.manifest import fp8_v_key_order
from msa_bench.kernels.q_packed import cute_backend as cb
from msa_bench.kernels.q_packed.schedule import PackedSchedule
from msa_bench.scenarios.workload import AttnShape

CUTE_DIR = Path(mf.__file__).parent
ALL = mf.q_packed_configs("all")


def _cli(*args, env=None):
    code = "import sys; from msa_bench.cli import main; sys.argv = ['msa-bench'] + sys.argv[1:]; main()"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=900)


# ---- options, names, ABI ----------------------------------------------------------------------------

def test_options_name_their_libraries():
    plain = cb.QPackedCuteBackend.from_option("plain")
    assert plain.flags == (False, False)
    both = cb.QPackedCuteBackend.from_option("sa+pp")
    assert both.flags == (True, True)
    for bad in ("x", "pp+pp", "pp+", ""):
        with pytest.raises(ValueError, match=r"pp\|plain .* sa\|plain .* p8\|p12"):
            cb.QPackedCuteBackend.from_option(bad)
    with pytest.raises(KeyError, match="q-packed-cute options"):
        get_backend("q-packed-cute@p16")
    with pytest.raises(KeyError, match="neither pp nor sa"):
        get_backend("q-packed-cute@p12+pp")
    wide = get_backend("q-packed-cute@p12")
    assert wide.configs_for("fp8") == [mf.wide_config("fp8")] and wide.flags is None
    assert wide.configs_for("bf16") == [mf.wide_config("bf16")]
    names = [c.name for c in ALL]
    assert len(set(names)) == 12 and all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", n) for n in names)
    assert {c.option for c in ALL} == {"", "pp", "sa", "pp+sa"}
    assert {(c.option, c.dtype, c.pairs, c.tile_tokens) for c in mf.q_packed_configs("default")} == {
        ("", "bf16", False, 8), ("pp+sa", "fp8", False, 8), ("sa", "fp8", False, 8), ("", "bf16", True, 8),
        ("", "fp8", True, 8), ("", "bf16", False, 12), ("", "fp8", False, 12)}
    assert mf.wide_config("fp8").name == "qpk_attn_fp8_p12g16d128b128_ms"       # its row sums by wgmma
    assert mf.wide_config("bf16").name == "qpk_attn_bf16_p12g16d128b128"
    # a default plan may run the wide library, named options keep theirs
    assert mf.wide_config("fp8") in get_backend("q-packed-cute").configs_for("fp8")
    assert mf.wide_config("fp8") not in get_backend("q-packed-cute@pp+sa").configs_for("fp8")
    assert mf.wide_config("fp8") not in get_backend("q-packed-cute@p8").configs_for("fp8")
    assert mf.QPackedConfig("fp8", pairs=True).name == "qpk_attn_fp8_p8g16d128b128_pairs"
    assert mf.q_packed_configs("none") == []
    b = get_backend("q-packed-cute@pp+sa")
    assert b.config_for("fp8") == mf.QPackedConfig("fp8", True, True) and b.name == "q-packed-cute@pp+sa"
    assert get_backend("q-packed-cute").config_for("bf16").name == "qpk_attn_bf16_p8g16d128b128"
    assert get_backend("q-packed-cute").config_for("fp8").name == "qpk_attn_fp8_p8g16d128b128_pp_sa"
    assert get_backend("q-packed-cute@plain").config_for("bf16").name == "qpk_attn_bf16_p8g16d128b128"
    for cfg in (c for c in ALL if not c.pairs and c.tile_tokens == 8):      # a library's option names it back
        assert get_backend(f"q-packed-cute@{cfg.option or 'plain'}").config_for(cfg.dtype) == cfg


def test_pack_checks_the_tensors():
    """(The ABI against the kernel's signature and the shim: tests/test_cute_build.py.)"""
    meta = torch.device("meta")
    cfg = mf.QPackedConfig("bf16")
    with pytest.raises(ValueError, match="expected 18 tensors"):
        pack_arguments(cfg, [torch.empty(1, device=meta)] * 13, meta)
    with pytest.raises(ValueError, match="int32"):
        pack_arguments(cfg, [torch.empty(1, device=meta)] * 3 + [torch.empty(2 ** 31, device=meta)]
                       + [torch.empty(1, device=meta)] * 14, meta)


def test_source_hash_covers_the_kernel_and_what_it_imports():
    from msa_bench.kernels.cute.manifest import source_files
    text = (CUTE_DIR / "q_packed_sm90.py").read_text()
    imported = set(re.findall(r"^from \.(\w+) import", text, re.M))
    assert {f"{m}.py" for m in imported} | {"q_packed_sm90.py"} <= set(source_files())
    assert len(mf.source_hash()) == 16


def test_find_library_says_what_to_rebuild(tmp_path):
    cfg = mf.QPackedConfig("bf16")                                # bf16's default
    path, why = mf.find_library(cfg, tmp_path, "sm_90a")
    assert path is None and "no CuTe build" in why and "--no-kv-outer --q-packed default" in why
    lib = tmp_path / cfg.library
    lib.write_bytes(b"not really a library")
    mf.write_manifest(tmp_path, "sm_90a", dict(dsl_version="4.8.1", cuda_version="13.0", cxx_version="test"),
                      [mf.config_entry(cfg, lib, "qp2")])
    assert mf.find_library(cfg, tmp_path, "sm_90a") == (lib, None)
    assert "is for sm_90a, this GPU is sm_100a" in mf.find_library(cfg, tmp_path, "sm_100a")[1]
    other = mf.QPackedConfig("bf16", pingpong=True)
    assert re.search(r"has no qpk_attn_bf16_p8g16d128b128_pp\b", mf.find_library(other, tmp_path, "sm_90a")[1])
    assert "--q-packed all" in mf.find_library(other, tmp_path, "sm_90a")[1]
    lib.write_bytes(b"altered")
    assert "checksum" in mf.find_library(cfg, tmp_path, "sm_90a")[1]
    data = json.loads((tmp_path / mf.MANIFEST_NAME).read_text())
    data["source_hash"] = "0" * 16
    (tmp_path / mf.MANIFEST_NAME).write_text(json.dumps(data))
    assert "stale" in mf.find_library(cfg, tmp_path, "sm_90a")[1]


# ---- backend wiring -----------------------------------------------------------------------------------

def test_backend_says_first_that_it_needs_the_gpu():
    """Without a GPU, the GPU is named before any dtype: it is what the user must change first."""
    b = get_backend("q-packed-cute")
    for dtype in ("fp16", "bf16"):
        assert b.unavailable_reason(dtype, "cpu") == "q-packed-cute runs only on a CUDA GPU (sm_90a)"
    if torch.cuda.is_available():
        assert b.unavailable_reason("fp16", "cuda").startswith("q-packed-cute does not support dtype fp16")


class _Library:
    """Stands in for the loaded library: records what the stage hands it (the launch itself needs a GPU)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.loaded = False
        self.launches = []

    def load_module(self):
        self.loaded = True

    def pack(self, tensors, device):
        packed = pack_arguments(self.cfg, tensors, device)
        self.ptrs, self.rows = [p or 0 for p in packed[0]], list(packed[1])
        return packed

    def launch(self, packed, *args):
        self.launches.append(args)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_stage_hands_the_schedule_buffers_to_the_library(dtype, monkeypatch):
    shape = AttnShape(hq=64, hkv=4, head_dim=128, block=128, topk=16)
    w = edge_case_workload(shape, dtype, [700, 300], [13, 6], True, pad=0.3, seed=2)
    sch = PackedSchedule(w, 8)
    out = torch.empty(w.n_tokens, 64, 128, dtype=torch.bfloat16)
    lse = torch.empty(w.n_tokens, 64)
    monkeypatch.setattr(cb, "num_ctas", lambda device, tiles: min(132, tiles))
    lib = _Library(mf.QPackedConfig(dtype))
    stage = cb.QPackedCuteAttention(w, sch, out, lse, lib.cfg, library=lib)
    assert lib.loaded
    b = sch.buffers
    v = stage.v
    expect = [w.q, w.k_cache, v, b["tile_tok0"], b["tile_ntok"], b["tile_count"], b["tile_page"], b["tile_limit"],
              b["tile_split"], w.pages, w.selection, w.q_limit, out, lse]
    assert lib.ptrs[:14] == [t.data_ptr() for t in expect]
    assert all(t.numel() == 0 for t in stage.keep[14:])      # no residual: empty placeholders the shim drops
    pages, sel = w.num_pages, 4 * w.n_tokens * 16
    assert lib.rows == [w.n_tokens * 64, pages * 4 * 128, pages * 4 * 128, sch.n_token_tiles, sch.n_token_tiles,
                        4 * sch.n_token_tiles, 4 * sch.n_token_tiles * 128, 4 * sch.n_token_tiles * 128 * 8,
                        4 * sch.n_token_tiles * 2, sel, sel, w.n_tokens, w.n_tokens * 64, w.n_tokens * 64,
                        0, 0, 0, 0]
    assert stage.scalars == (4, sch.n_token_tiles, 128, 4 * sch.n_token_tiles, w.n_tokens, 16, 0,
                             w.sm_scale * w.q_scale * w.k_scale, w.v_scale)
    assert not stage.describe()["direct"]
    # every tile one token (decode): the direct path, and the plan runs no schedule stage
    one = edge_case_workload(shape, dtype, [700, 300, 500], [1, 1, 1], True, pad=0.3, seed=2)
    assert cb.one_token_tiles(one) and not cb.one_token_tiles(w)
    sch1 = PackedSchedule(one, 8)
    direct = cb.QPackedCuteAttention(one, sch1, out[:3], lse[:3], lib.cfg, library=lib, direct=True)
    assert direct.scalars[:2] == (4, 3) and direct.scalars[6] == 1 and direct.describe()["direct"]
    # the pairs library: tile t is tokens 2t and 2t + 1, so 3 tokens make 2 tiles a head
    pairs = _Library(mf.QPackedConfig(dtype, pairs=True))
    two = cb.QPackedCuteAttention(one, sch1, out[:3], lse[:3], pairs.cfg, library=pairs, direct=True)
    assert two.scalars[:4] == (4, 2, 128, 8) and two.num_tiles == 8 and two.describe()["pairs"]
    backend = get_backend("q-packed-cute")
    assert backend.stages_for(one) == ("attention",) and backend.stages_for(w) == ("schedule", "attention")
    # pairs where the one-token tiles outnumber the SMs (4 heads x 3 tokens = 12)
    for sms, expect in ((11, True), (12, False)):
        monkeypatch.setattr(cb, "sm_count", lambda device, n=sms: n)
        assert cb.pairs_path(one) == expect and not cb.pairs_path(w)
    if dtype == "fp8":
        # d-major, and stored key k of every 16 holds the true key fp8_v_key_order()[k]
        order = torch.tensor(fp8_v_key_order())
        true_keys = (torch.arange(128).view(8, 16) // 16 * 16 + order).view(-1)
        assert torch.equal(v.float(), w.v_cache.float()[:, :, true_keys, :].transpose(-1, -2))
    else:
        assert v is w.v_cache


def test_default_plan_runs_the_skip_library_where_warpgroups_skip():
    """walked_ratio is 1 where each half of a tile selects alike (tiny drift keeps most tiles whole) and grows
    with drift; a default plan runs SKIP_OPTIONS past SKIP_RATIO, a named option always its own flags."""
    from msa_bench.scenarios.serving import serving_workload
    shape = AttnShape(hq=16, hkv=1, head_dim=16, block=128, topk=16)     # one KV head: the interpreter runs it
    backend = get_backend("q-packed-cute")
    ratios = {}
    for drift in (0.0, 0.3):
        w = serving_workload(shape, "fp8", "drift", 64, 16384, drift=drift, seed=3, with_tensors=False)
        sch = PackedSchedule(w, 8)
        sch()
        ratios[drift] = backend.walked_ratio(w, sch, float((w.selection >= 0).sum()))
    assert ratios[0.0] == pytest.approx(1.0, abs=0.02) and ratios[0.3] > 1.3, ratios
    assert backend.config_for("fp8", ratios[0.0]) == mf.QPackedConfig("fp8", *mf.DEFAULT_OPTIONS["fp8"])
    assert backend.config_for("fp8", ratios[0.3]) == mf.QPackedConfig("fp8", *mf.SKIP_OPTIONS["fp8"])
    assert backend.config_for("bf16", ratios[0.3]) == backend.config_for("bf16", 1.0)      # bf16 has one default
    named = get_backend("q-packed-cute@pp+sa")
    assert named.config_for("fp8", ratios[0.3]) == named.config_for("fp8") == mf.QPackedConfig("fp8", True, True)
    assert backend.configs_for("fp8") == [mf.QPackedConfig("fp8", True, True), mf.QPackedConfig("fp8", False, True),
                                          mf.wide_config("fp8")]
    assert named.configs_for("fp8") == [mf.QPackedConfig("fp8", True, True)]


def test_default_plan_takes_wide_tiles_only_where_the_rule_holds(monkeypatch):
    """12-token tiles where their warpgroups walk at most WIDE_MAX_RATIO times the 8-token warpgroups'
    entries and there are WIDE_MIN_TILES_PER_SM tiles an SM, in either dtype; never for a named option or p8;
    always for p12."""
    from msa_bench.scenarios.serving import serving_workload
    shape = AttnShape(hq=16, hkv=1, head_dim=16, block=128, topk=4)        # small: the interpreter runs the schedules
    backend, named, p8, p12 = (get_backend(n) for n in ("q-packed-cute", "q-packed-cute@pp+sa", "q-packed-cute@p8",
                                                         "q-packed-cute@p12"))
    # 120 causal tokens: 11 twelve-token tiles (cut where q_limit crosses a multiple of 12)
    sms = 11 / mf.WIDE_MIN_TILES_PER_SM
    monkeypatch.setattr(cb, "sm_count", lambda device: sms)
    cases = {}

    def chosen(b, drift, dtype="fp8"):
        if (drift, dtype) not in cases:
            w = serving_workload(shape, dtype, "drift", 120, 8192, drift=drift, seed=3, with_tensors=False)
            sch = PackedSchedule(w, 8)
            sch()
            selected = float((w.selection >= 0).sum())
            cases[drift, dtype] = w, sch, backend.walked_ratio(w, sch, selected), selected
        wide = b.wide_schedule(*cases[drift, dtype])
        assert wide is None or (wide[0].P == 12 and wide[0].num_tiles == 11 and wide[1] >= 1.0)
        # each of its three warpgroups walks its third's range: at most the whole union for every token of
        # the tile (one KV head here), and all of it where every token selects the same blocks
        whole = float(wide[0].tile_count.double() @ wide[0].tile_ntok.double()) / cases[drift, dtype][3] if wide else 0
        assert wide is None or wide[1] <= whole + 1e-9
        assert wide is None or drift > 0 or wide[1] == pytest.approx(whole)
        return wide is not None

    assert chosen(backend, 0.0) and chosen(p12, 0.0) and chosen(p12, 0.3)
    assert not chosen(backend, 0.3) and chosen(backend, 0.0, "bf16") and not chosen(backend, 0.3, "bf16")
    assert not chosen(named, 0.0) and not chosen(p8, 0.0)
    monkeypatch.setattr(cb, "sm_count", lambda device: sms * 1.1)          # a tile short
    assert not chosen(backend, 0.0) and chosen(p12, 0.0)


def test_wide_tiles_decline_more_loads_and_decode_tokens(monkeypatch):
    """Groups of 8 tokens that share their blocks walk no more on 12-token tiles, but those tiles load two
    groups' blocks; a step with decode tokens (requests of one token) keeps 8-token tiles."""
    from msa_bench.scenarios.coselection import coselected_workload
    from msa_bench.scenarios.serving import serving_workload
    shape = AttnShape(hq=16, hkv=1, head_dim=16, block=128, topk=4)
    backend = get_backend("q-packed-cute")
    monkeypatch.setattr(cb, "sm_count", lambda device: 1e-3)               # tiles enough

    def wide(w):
        sch, selected = ran_schedule(w, 8), float((w.selection >= 0).sum())
        return backend.wide_schedule(w, sch, backend.walked_ratio(w, sch, selected), selected)

    groups = coselected_workload(shape, "fp8", 96, 8192, 0.25, 1.0, group=8, seed=1, with_tensors=False)
    assert backend.walked_ratio(groups, ran_schedule(groups, 12), float((groups.selection >= 0).sum())) == pytest.approx(1.0)
    assert wide(groups) is None
    chunk = serving_workload(shape, "fp8", "drift", 120, 8192, drift=0.0, seed=3, with_tensors=False)
    step = serving_workload(shape, "fp8", "mixed", 120, 8192, requests=4, chunks=1, drift=0.0, seed=3,
                            with_tensors=False)
    assert wide(chunk) is not None and wide(step) is None


def ran_schedule(w, tokens_per_tile):
    """The q-packed schedule of `w` at that tile size, after its stage ran."""
    sch = PackedSchedule(w, tokens_per_tile)
    sch()
    return sch


def test_stage_skips_an_empty_schedule(monkeypatch):
    shape = AttnShape(hq=64, hkv=4, head_dim=128, block=128, topk=16)
    w = edge_case_workload(shape, "bf16", [300], [4], True, seed=0)
    sch = PackedSchedule(w, 8)
    sch.n_token_tiles = 0
    lib = _Library(mf.QPackedConfig("bf16"))
    stage = cb.QPackedCuteAttention(w, sch, torch.empty(4, 64, 128, dtype=torch.bfloat16), torch.empty(4, 64),
                                    lib.cfg, library=lib)
    stage()
    assert stage.grid == 0 and lib.launches == []


def test_other_geometry_is_unavailable():
    from msa_bench.kernels.base import BackendUnavailable
    w = edge_case_workload(AttnShape(hq=8, hkv=2, head_dim=32, block=32, topk=4), "bf16", [100], [5], True)
    assert "G 16, D 128, block 128" in cb.cute_shape_reason(w, "q-packed-cute")
    backend = cb.QPackedCuteBackend()
    backend.unavailable_reason = lambda dtype, device: None       # as where the libraries are built
    with pytest.raises(BackendUnavailable, match="G 16, D 128, block 128"):
        backend.plan(w)


def test_build_kernels_bad_q_packed_is_one_line():
    proc = _cli("build-kernels", "--q-packed", "some")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "--q-packed must be one of default, all, none" in proc.stderr


# ---- the sm_90a build -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Every q-packed configuration compiled for sm_90a through the CLI (no KV-outer libraries), PTX and
    cubin kept for inspection."""
    if dsl_unavailable_reason():
        pytest.skip(f"CuTe DSL not installed: {dsl_unavailable_reason()}")
    from msa_bench.kernels.cute.build import cuda_home
    if not (cuda_home() / "include" / "cuda_runtime_api.h").is_file() or not shutil.which("g++"):
        pytest.skip(f"linking the CuTe libraries needs g++ and CUDA 13 headers at {cuda_home()} (or $CUDA_HOME)")
    out = tmp_path_factory.mktemp("qpk")
    dump = tmp_path_factory.mktemp("qpk_dump")
    proc = _cli("build-kernels", "--arch", "sm_90a", "--out", str(out), "--no-kv-outer", "--q-packed", "all",
                env={"CUTE_DSL_KEEP": "ptx,cubin", "CUTE_DSL_DUMP_DIR": str(dump), "CUTE_DSL_NO_CACHE": "1",
                     "CUTE_DSL_DISABLE_FILE_CACHING": "1"})
    assert proc.returncode == 0, proc.stderr
    return out, dump


def _artifact(dump: Path, cfg: mf.QPackedConfig, ext: str) -> Path:
    tag = (f"QPackedSm90_{cfg.dtype}" + ("_pingpong" if cfg.pingpong else "") + ("_sahead" if cfg.s_ahead else "")
           + ("_pairs" if cfg.pairs else "") + ("_3wg" if cfg.tile_tokens == 12 else "") + ("_msum" if cfg.mma_sum else ""))
    paths = [p for p in glob.glob(str(dump / f"*{tag}_FakeTensor*.{ext}"))]
    assert len(paths) == 1, (tag, ext, paths)
    return Path(paths[0])


def test_build_writes_every_config_and_its_manifest(built):
    out, _ = built
    data = json.loads((out / mf.MANIFEST_NAME).read_text())
    assert data["arch"] == "sm_90a" and data["source_hash"] == mf.source_hash() and data["dsl_version"] == "4.8.1"
    assert {e["kind"] for e in data["configs"]} == {"q-packed"}          # --no-kv-outer
    assert {e["name"] for e in data["configs"]} == {c.name for c in ALL}
    versions = {e["name"]: e["kernel_version"] for e in data["configs"]}
    for cfg in ALL:
        path, why = mf.find_library(cfg, out, "sm_90a")
        assert why is None and path.stat().st_size > 10_000
        assert versions[cfg.name].startswith("qp2-") and ("pingpong" in versions[cfg.name]) == cfg.pingpong
        assert ("s-ahead" in versions[cfg.name]) == cfg.s_ahead and ("pairs" in versions[cfg.name]) == cfg.pairs


@pytest.mark.parametrize("cfg", ALL, ids=[c.name for c in ALL])
def test_ptx_holds_the_pipeline_of_each_option(built, cfg):
    """384 threads, registers moved 56 -> 224 from the producer warpgroup to the consumers (12-token tiles:
    512 threads, 32 -> 160 for three consumer warpgroups), K/V by TMA
    into mbarrier stages (fp8: one box per 128-byte row; bf16: two), Q by cp.async with a noinc arrive,
    O by stmatrix and TMA stores, the deadlock watchdog; one S and one P V wgmma group per block
    (s-ahead: twice, the loop's and the prologue/epilogue's, with S waited while P V runs); pingpong:
    named barriers of the two consumer warpgroups (256 threads), none otherwise."""
    _, dump = built
    ptx = _artifact(dump, cfg, "ptx").read_text()
    wide = cfg.tile_tokens == 12
    assert (".reqntid 512, 1, 1" if wide else ".reqntid 384, 1, 1") in ptx
    assert re.search(rf"setmaxnreg\.dec\.sync\.aligned\.u32\s+{32 if wide else 56};", ptx)
    assert re.search(rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{160 if wide else 224};", ptx)
    boxes = 2 if cfg.dtype == "bf16" else 1
    # K and V of a block, at each of the producer's walks: the schedule's tile list and one token's
    # entries, or a pair's alone
    walks = 1 if cfg.pairs else 2
    assert ptx.count("cp.async.bulk.tensor.2d.shared::cta.global") == walks * 2 * boxes
    assert ptx.count("cp.async.bulk.tensor.2d.global.shared::cta") == 2          # (16, 128) bf16 O: two boxes
    assert "mbarrier.arrive.expect_tx" in ptx and "cp.async.mbarrier.arrive.noinc" in ptx
    # a tile's Q rows, 16 bytes a copy over the 64 gathering threads
    assert ptx.count("cp.async.cg.shared.global") == (32 if cfg.dtype == "bf16" else 16) * cfg.tile_tokens // 8
    assert "stmatrix.sync.aligned" in ptx and "trap;" in ptx
    groups = 4 if cfg.s_ahead else 2
    k_steps = 8 if cfg.dtype == "bf16" else 4
    # mma_sum: each P V group also multiplies P by the ones, one N 8 wgmma per k step
    mmas = groups * k_steps + (groups // 2 * k_steps if cfg.mma_sum else 0)
    assert ptx.count("wgmma.commit_group") == groups and ptx.count("wgmma.mma_async") == mmas
    assert bool(re.search(r"wgmma\.wait_group\.sync\.aligned\s+1;", ptx)) == cfg.s_ahead
    assert ptx.count("ex2.approx") == (2 if cfg.s_ahead else 1) * 66   # 64 P and 2 alpha per softmax site
    named = re.findall(r"\b(?:bar|barrier)(?:\.cta)?\.(sync|arrive)(?:\.aligned)?\s+(\S+),\s*(\d+);", ptx)
    if cfg.pingpong:
        assert {kind for kind, _, n in named if n == "256"} == {"sync", "arrive"}
    else:
        assert named == []


def _nvdisasm() -> str | None:
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import triton
    except ImportError:
        return None
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    return str(bundled) if bundled.is_file() else None


@pytest.mark.parametrize("cfg", ALL, ids=[c.name for c in ALL])
def test_sass_keeps_the_wgmma_groups_asynchronous(built, cfg):
    """ptxas serializes every wgmma of a kernel when it finds too few registers (C7512): then each GMMA
    carries its own scoreboard and waits. Here only the last GMMA of each group does, so S and P V run
    asynchronously (s-ahead: S(j + 1) under the softmax of j needs that)."""
    tool = _nvdisasm()
    if tool is None:
        pytest.skip("nvdisasm not found (CUDA toolkit or Triton's bundled copy)")
    _, dump = built
    sass = subprocess.run([tool, "-c", str(_artifact(dump, cfg, "cubin"))], capture_output=True, text=True,
                          check=True).stdout
    gmma = [line for line in sass.splitlines() if re.search(r"\b[HQ]GMMA\.", line)]
    k_steps = 8 if cfg.dtype == "bf16" else 4
    groups = 4 if cfg.s_ahead else 2
    assert len(gmma) == groups * k_steps + (groups // 2 * k_steps if cfg.mma_sum else 0)
    assert sum("gsb0" in line for line in gmma) == groups
