"""CuTe DSL attention stage: the ahead-of-time build (a real sm_90a compile, no GPU needed) and the
Python side of loading (manifest checks: stale sources, wrong arch, missing or altered library)."""
from __future__ import annotations

import ctypes
import glob
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from msa_bench.kernels.base import BackendUnavailable, get_backend
from msa_bench.kernels.cute import manifest as mf
from msa_bench.kernels.cute.build import dsl_unavailable_reason

needs_dsl = pytest.mark.skipif(dsl_unavailable_reason() is not None,
                               reason=f"CuTe DSL not installed: {dsl_unavailable_reason()}")


def _cli(*args, env=None):
    code = "import sys; from msa_bench.cli import main; sys.argv = ['msa-bench'] + sys.argv[1:]; main()"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=600)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Every sweep configuration compiled for sm_90a through the CLI, PTX kept for inspection."""
    if dsl_unavailable_reason():
        pytest.skip(f"CuTe DSL not installed: {dsl_unavailable_reason()}")
    import shutil
    from msa_bench.kernels.cute.build import cuda_home
    if not (cuda_home() / "include" / "cuda_runtime_api.h").is_file() or not shutil.which("g++"):
        pytest.skip(f"linking the CuTe libraries needs g++ and CUDA 13 headers at {cuda_home()} (or $CUDA_HOME)")
    out = tmp_path_factory.mktemp("cute")
    dump = tmp_path_factory.mktemp("ptx")
    proc = _cli("build-kernels", "--arch", "sm_90a", "--out", str(out),
                env={"CUTE_DSL_KEEP": "ptx", "CUTE_DSL_DUMP_DIR": str(dump)})
    assert proc.returncode == 0, proc.stderr
    return out, dump


@needs_dsl
def test_build_writes_every_config_and_manifest(built):
    out, _ = built
    data = json.loads((out / mf.MANIFEST_NAME).read_text())
    assert data["arch"] == "sm_90a" and data["source_hash"] == mf.source_hash()
    assert data["dsl_version"] == "4.8.1" and data["cuda_version"].startswith("13.")
    names = {e["name"] for e in data["configs"]}
    assert names == {c.name for c in mf.sweep_configs() + mf.knockout_configs()}
    for cfg in mf.sweep_configs() + mf.knockout_configs():
        path, reason = mf.find_library(cfg, out, "sm_90a")
        assert reason is None and path.stat().st_size > 10_000


@needs_dsl
def test_manifest_entries_name_their_kernel_generation(built):
    out, _ = built
    data = json.loads((out / mf.MANIFEST_NAME).read_text())
    versions = {e["variant"]: e["kernel_version"] for e in data["configs"]}
    assert set(versions) == set(mf.VARIANTS) | set(mf.KNOCKOUT_VARIANTS) | set(mf.TRACE_VARIANTS)
    assert versions["v22tr"] == f"{versions['v22']}-trace"
    for base in mf.KNOCKOUT_BASES:
        for piece in mf.KNOCKOUTS:
            assert versions[f"{base}ko-{piece}"] == f"{versions[base]}-knockout-{piece}"
    assert versions["v2"].startswith("v2-") and versions["v3"].startswith("v3-")
    assert versions["v4"].startswith("v4-") and versions["v7"].startswith("v7-") and versions["v9"].startswith("v9-")
    assert versions["v10"].startswith("v10-")
    assert all(v in data["kernel_version"] for v in versions.values())


@needs_dsl
def test_v3_kernel_is_pipelined_with_named_barriers(built):
    """The v3 PTX: its own kernel (attention_sm90_pipe), 128-thread named barriers for the decoupled
    warpgroups, cp.async groups kept in flight (a wait for all of them, no per-copy waits), wgmma."""
    _, dump = built
    pipe = [Path(p).read_text() for p in glob.glob(str(dump / "*.ptx")) if "sm90_pipe" in p]
    assert pipe, "no PTX of the v3 (attention_sm90_pipe) kernel"
    for text in pipe:
        assert "wgmma.mma_async" in text and "cp.async.commit_group" in text
        assert "bar.sync" in text and ", 128;" in text


@needs_dsl
def test_v4_kernel_is_warp_specialized_with_tma(built):
    """The v4 PTX: its own kernel (attention_sm90_ws), 384 threads with setmaxnreg moving registers from
    the producer warpgroup to the consumers, K/V by TMA (2-D tensor copies completing on an mbarrier
    with expect_tx), Q by cp.async with an mbarrier arrive, parity waits (with the watchdog trap), wgmma."""
    _, dump = built
    ws = [Path(p).read_text() for p in glob.glob(str(dump / "*.ptx")) if "sm90_ws" in p]
    assert len(ws) >= 2, "no PTX of the v4 (attention_sm90_ws) kernel for both dtypes"
    for text in ws:
        assert ".reqntid 384" in text
        assert "setmaxnreg.dec.sync.aligned.u32" in text and "setmaxnreg.inc.sync.aligned.u32" in text
        assert "cp.async.bulk.tensor.2d" in text and "mbarrier::complete_tx::bytes" in text
        assert "mbarrier.arrive.expect_tx" in text and "cp.async.mbarrier.arrive.noinc" in text
        assert "mbarrier.try_wait.parity" in text and "trap;" in text
        assert "wgmma.mma_async" in text and "fence.proxy.async" in text
        assert "cp.async.wait_group" in text                       # the producer drains before exit


@needs_dsl
def test_v7_v9_v10_store_o_by_tma_and_v9_v10_overlap_wgmma_groups(built):
    """The v7, v9 and v10 PTX store O from shared memory by TMA (2-D bulk tensor copies to global
    memory, committed as bulk groups, the staging buffer reused only after the previous group has read
    it); v4 does not. v9 and v10 wait for their S group while the P V group stays in flight
    (wait_group 1). v10's softmax takes row maxima with max.f32 where v9's NaN-aware max lowers to
    setp.nan + setp + selp."""
    _, dump = built
    kinds = {"TmaStore_": [], "Pipelined_": [], "WarpSpecialized_": [], "TreeSoftmax_": []}     # attention_sm90_ws
    for path in glob.glob(str(dump / "*.ptx")):
        for kind in kinds:
            if f"sm90_wsKvOuterAttentionSm90{kind}" in path:
                kinds[kind].append(Path(path).read_text())
    assert all(len(texts) == 2 for texts in kinds.values()), {k: len(v) for k, v in kinds.items()}
    for text in kinds["TmaStore_"] + kinds["Pipelined_"] + kinds["TreeSoftmax_"]:
        assert "cp.async.bulk.tensor.2d.global.shared::cta" in text
        assert "cp.async.bulk.commit_group" in text and re.search(r"cp\.async\.bulk\.wait_group\.read\s+0;", text)
    for text in kinds["WarpSpecialized_"]:
        assert "cp.async.bulk.tensor.2d.global.shared::cta" not in text
    pending_one = re.compile(r"wgmma\.wait_group\.sync\.aligned\s+1;")
    for text in kinds["Pipelined_"] + kinds["TreeSoftmax_"]:
        assert pending_one.search(text)
    for text in kinds["TreeSoftmax_"]:
        assert re.search(r"\bmax\.f32\b", text) and "setp.nan.f32" not in text
    for text in kinds["Pipelined_"]:
        assert "setp.nan.f32" in text
    for text in kinds["TmaStore_"]:
        assert not pending_one.search(text)


@needs_dsl
def test_v15_fp8_p_v_reads_p_from_registers(built):
    """v15 (fp8 only): the P V wgmma takes its A operand from four registers (k32 e4m3 fragment), so
    P is no longer written to shared memory; v10's fp8 P V reads both operands by descriptor."""
    _, dump = built
    regs_a = re.compile(r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3 \{[^}]*\}, \{%r\d+, %r\d+, %r\d+, %r\d+\}")
    v15 = [Path(p).read_text() for p in glob.glob(str(dump / "*.ptx")) if "Sm90Fp8RegP_" in p]
    v10_fp8 = [Path(p).read_text() for p in glob.glob(str(dump / "*.ptx"))
               if "Sm90TreeSoftmax_" in p and "Float8E4M3" in p]
    assert len(v15) == 1 and len(v10_fp8) == 1
    assert regs_a.search(v15[0]) and not regs_a.search(v10_fp8[0])


@needs_dsl
def test_v17_v18_store_o_by_stmatrix(built):
    """v17 and v18 write O to the staging buffer with stmatrix (eight per warp and tile), v16 with
    4-byte shared stores."""
    _, dump = built
    texts = {k: [Path(p).read_text() for p in glob.glob(str(dump / "*.ptx")) if f"Sm90{k}_" in p]
             for k in ("JointRows", "Stmatrix", "ProducerAhead")}
    assert all(len(t) == 2 for t in texts.values()), {k: len(t) for k, t in texts.items()}
    for k in ("Stmatrix", "ProducerAhead"):
        assert all("stmatrix.sync.aligned" in t for t in texts[k])
    assert not any("stmatrix.sync.aligned" in t for t in texts["JointRows"])


def _ptx(dump: Path, kernel: str, dtype: str) -> str:
    """The PTX of one kernel class (its name in the dump file) for one dtype."""
    tag = {"bf16": "BFloat16", "fp8": "Float8E4M3"}[dtype]
    texts = [Path(p).read_text() for p in glob.glob(str(dump / "*.ptx")) if f"Sm90{kernel}_" in p and tag in p]
    assert len(texts) == 1, (kernel, dtype, len(texts))
    return texts[0]


@needs_dsl
def test_v21_v22_store_o_per_warp_and_v22_folds_the_output_scale(built):
    """v21 stages and stores O per warp: no named barrier in the kernel beyond the launch's one, one TMA
    store per warp (v18: a warpgroup barrier before and after staging, four stores by one thread).
    v22 (bf16) drops the 64 multiplies per thread and tile that scale O."""
    _, dump = built
    named = re.compile(r"\bbar(?:rier)?\.sync(?:\.aligned)?\s+\S+,\s*\d+;")    # with a thread count
    tma_store = "cp.async.bulk.tensor.2d.global.shared"
    for dtype in ("bf16", "fp8"):
        v18, v21 = _ptx(dump, "ProducerAhead", dtype), _ptx(dump, "WarpStore", dtype)
        assert named.search(v18) and not named.search(v21)
        assert v21.count(tma_store) < v18.count(tma_store)
    v21, v22 = _ptx(dump, "WarpStore", "bf16"), _ptx(dump, "FoldedScale", "bf16")
    # the loop's and the last tile's 64 O multiplies each are gone; the scale's log2 (once) adds a few
    assert v21.count("mul.f32") - v22.count("mul.f32") >= 2 * 64 - 8
    assert v22.count("ex2.approx") == v21.count("ex2.approx")


@needs_dsl
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_v23_runs_three_consumer_warpgroups_without_pipelining(built, dtype):
    """v23: 512 threads, registers moved 72 / 144 between producer and consumers, one S and one P V
    wgmma group per half tile (no group issued ahead), per-warp O stores and no named barrier."""
    _, dump = built
    v23, v22 = _ptx(dump, "ThreeConsumers", dtype), _ptx(dump, "FoldedScale" if dtype == "bf16" else "ProducerAhead", dtype)
    assert ".reqntid 512, 1, 1" in v23 and ".reqntid 384, 1, 1" in v22
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+72;", v23)
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+144;", v23)
    assert v23.count("wgmma.commit_group") == 2 and not re.search(r"wgmma\.wait_group\.sync\.aligned\s+1;", v23)
    assert re.search(r"wgmma\.wait_group\.sync\.aligned\s+1;", v22)
    assert v23.count("wgmma.mma_async") * 2 == v22.count("wgmma.mma_async")   # v22 also has the last tile's P V
    assert not re.search(r"\bbar(?:rier)?\.sync(?:\.aligned)?\s+\S+,\s*\d+;", v23)
    assert "stmatrix.sync.aligned" in v23


@needs_dsl
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_v24_moves_a_quarter_of_the_exponentials_to_the_fma_pipe(built, dtype):
    """v24 keeps three of every four MUFU exponentials of v22 (fp8: v21) and computes the rest with
    the shifter, a cubic and an exponent-field add; the MMAs are unchanged."""
    _, dump = built
    v24, base = _ptx(dump, "FmaExp", dtype), _ptx(dump, "FoldedScale" if dtype == "bf16" else "WarpStore", dtype)
    assert 4 * v24.count("ex2.approx") == 3 * base.count("ex2.approx") > 0
    assert v24.count("mad.lo.u32") - base.count("mad.lo.u32") == base.count("ex2.approx") // 4
    assert "0f4B400000" in v24 and "0f4B400000" not in base
    assert v24.count("wgmma.mma_async") == base.count("wgmma.mma_async")


@needs_dsl
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_v28_marks_its_tma_streams_evict_first(built, dtype):
    """v28 gives v23's O stores and K/V loads the evict-first L2 policy; v23 passes the DSL's default
    policy operand (0) everywhere, and the MMAs and Q copies are v23's. The policy is a 64-bit operand of
    every TMA copy, moved into a register as a decimal constant."""
    _, dump = built
    v23, v28 = _ptx(dump, "ThreeConsumers", dtype), _ptx(dump, "ThreeConsumersEvictFirst", dtype)
    policy = re.compile(r"mov\.b64\s+%rd\d+, " + str(0x12F0000000000000) + ";")
    kv_loads = v28.count("cp.async.bulk.tensor.2d.shared::cta.global")
    assert len(policy.findall(v23)) == 0
    assert len(policy.findall(v28)) == 1 + kv_loads and kv_loads >= 2      # one O store site
    assert v28.count("wgmma.mma_async") == v23.count("wgmma.mma_async")
    assert v28.count("cp.async.ca") + v28.count("cp.async.cg") == v23.count("cp.async.ca") + v23.count("cp.async.cg")


def test_fma_exp2_matches_exp2_in_fp32_arithmetic():
    """_exp2_fma's steps replayed in float32 numpy (clamp, 1.5 x 2^23 shifter, cubic, exponent add):
    relative error under 2e-4 from -126 to 12, finite and non-negative below (masked keys)."""
    import numpy as np
    poly = [np.float32(c) for c in mf_exp2_poly()]
    x = np.concatenate([np.linspace(-140, 12, 400001, dtype=np.float32), np.array([-np.inf], np.float32)])
    xc = np.maximum(x, np.float32(-126.0))
    xi = (xc + np.float32(12582912.0)).astype(np.float32)
    f = (xc - (xi - np.float32(12582912.0)).astype(np.float32)).astype(np.float32)
    p = np.full_like(f, poly[0])
    for c in poly[1:]:
        p = (p * f + c).astype(np.float32)
    bits = (xi.view(np.uint32).astype(np.uint64) * 8388608 + p.view(np.uint32)) % 2 ** 32
    r = bits.astype(np.uint32).view(np.float32)
    ok = x >= -126
    assert np.all(np.isfinite(r)) and np.all(r >= 0)
    assert np.max(np.abs(r[ok] - np.exp2(x[ok].astype(np.float64))) / np.exp2(x[ok].astype(np.float64))) < 2e-4


def mf_exp2_poly():
    """EXP2_POLY from the kernel source (the module itself needs the DSL to import)."""
    import ast
    src = (Path(mf.__file__).parent / "attention_sm90_ws.py").read_text()
    node = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Assign)
                and getattr(n.targets[0], "id", "") == "EXP2_POLY")
    return ast.literal_eval(node.value)


@needs_dsl
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("stem", ["ProducerAhead", "ThreeConsumers", "ThreeConsumersEvictFirst"])  # manifest.KNOCKOUT_BASES
def test_knockouts_remove_only_their_piece(built, dtype, stem):
    """Each knock-out keeps the base generation's MMAs and staging and loses only its piece."""
    _, dump = built
    base = _ptx(dump, stem, dtype)
    ko = {piece: _ptx(dump, f"{stem}KnockOut{piece.title().replace('-', '')}", dtype) for piece in mf.KNOCKOUTS}
    tma_store, wgmma = "cp.async.bulk.tensor.2d.global.shared", "wgmma.mma_async"
    for text in ko.values():
        assert text.count(wgmma) == base.count(wgmma) and text.count("stmatrix") == base.count("stmatrix")
    assert ko["o-store"].count(tma_store) == ko["bare"].count(tma_store) == 0 < base.count(tma_store)
    assert ko["o-store"].count("ex2.approx") == base.count("ex2.approx") > 0
    assert ko["exp"].count("ex2.approx") == 0 and ko["exp"].count("max.f32") == base.count("max.f32")
    for piece in ("softmax", "bare"):
        assert ko[piece].count("ex2.approx") == 0 and ko[piece].count("max.f32") == 0
    assert ko["exp"].count(tma_store) == ko["softmax"].count(tma_store) == base.count(tma_store)
    # o-half: v18 stores a warpgroup's slots in an unrolled loop, so half of its store sites remain; v23
    # and v28 store per warp at one site, which only even warps reach
    half = ko["o-half"]
    assert half.count("ex2.approx") == base.count("ex2.approx") and half.count("max.f32") == base.count("max.f32")
    if stem == "ProducerAhead":
        assert 2 * half.count(tma_store) == base.count(tma_store)
    else:
        odd = re.compile(r"and\.b32\s+%r\d+, %r\d+, 1;")                  # the warp's parity
        assert half.count(tma_store) == base.count(tma_store) and len(odd.findall(half)) == len(odd.findall(base)) + 1


@needs_dsl
def test_trace_builds_read_the_clock_at_each_phase(built):
    """A trace build reads %clock once at the consumers' start and once per phase, with the base's MMAs."""
    _, dump = built
    for kernel, base, dtype in (("FoldedScaleTrace", "FoldedScale", "bf16"), ("ProducerAheadTrace", "ProducerAhead", "fp8")):
        traced, plain = _ptx(dump, kernel, dtype), _ptx(dump, base, dtype)
        assert traced.count("%clock;") == 1 + len(mf.TRACE_PHASES) and "%clock" not in plain
        assert traced.count("wgmma.mma_async") == plain.count("wgmma.mma_async")


@needs_dsl
def test_built_kernels_are_sm90a_wgmma(built):
    _, dump = built
    ptx = [Path(p).read_text() for p in glob.glob(str(dump / "*.ptx"))]
    assert len(ptx) >= len(mf.DTYPES)          # dump files are named per kernel, not per config
    for text in ptx:
        assert ".target sm_90a" in text
        assert "wgmma.mma_async" in text and "cp.async" in text
    kinds = {"bf16": "f32.bf16.bf16", "fp8": "f32.e4m3.e4m3"}
    for dtype, frag in kinds.items():
        assert any(frag in t for t in ptx), f"no {dtype} wgmma in the PTX"


# sha256 of the default kernels' libraries (the ones the defaults of both dtypes load, v23 and v28 in each
# dtype) as built at commit 9821365, the builds measured on the H200, with the toolchain below. A change
# of structure keeps them byte-identical; a library that moves must be checked and timed again on the GPU.
DEFAULT_LIBRARY_SHA256 = {
    "kvo_attn_bf16_q8g16d128b128_c1_v23": "44c2ab0a41f43015d0ec10dd9f68f235489eaaa21a7f31a67de3c7f9afc9ccfb",
    "kvo_attn_fp8_q8g16d128b128_c1_v23": "3e06aae820cd5bfdefb0dc793eda6bc6246a304cc967fa0c6afc37768d60164d",
    "kvo_attn_bf16_q8g16d128b128_c1_v28": "33e61b40c8bf946a56f54b0591964658f84dcdeac19d7e0f10b9bc595845425f",
    "kvo_attn_fp8_q8g16d128b128_c1_v28": "d27290cb7c8115e3eecc26f59f24fdaafb27d01d12f03d3b6b224dc472db21eb",
}
SHA256_TOOLCHAIN = {"dsl_version": "4.8.1", "cuda_version": "13.0", "cxx": "g++ (Debian 12.2.0-14+deb12u1) 12.2.0"}


def _cxx_version() -> str:
    import shutil
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    return subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[0].strip()


@needs_dsl
def test_default_libraries_are_byte_identical_to_the_measured_builds(built):
    out, _ = built
    data = json.loads((out / mf.MANIFEST_NAME).read_text())
    toolchain = dict(dsl_version=data["dsl_version"], cuda_version=data["cuda_version"], cxx=_cxx_version())
    if toolchain != SHA256_TOOLCHAIN:
        pytest.skip(f"built with {toolchain}; the recorded sha256 are of builds with {SHA256_TOOLCHAIN}")
    got = {e["name"]: e["sha256"] for e in data["configs"] if e["name"] in DEFAULT_LIBRARY_SHA256}
    assert got == DEFAULT_LIBRARY_SHA256


@needs_dsl
def test_built_library_exports_the_shim(built):
    out, _ = built
    try:
        ctypes.CDLL("libcudart.so.13", mode=ctypes.RTLD_GLOBAL)
    except OSError:
        pytest.skip("libcudart.so.13 not loadable here")
    for cfg in mf.sweep_configs():
        lib = ctypes.CDLL(str(out / cfg.library))
        assert getattr(lib, f"{cfg.name}_load") and getattr(lib, f"{cfg.name}_launch")


# ---- manifest checks (no DSL needed) -----------------------------------------------------------

def _fake_build(tmp_path: Path, arch="sm_90a", source_hash=None, dtypes=("bf16", "fp8")) -> Path:
    entries = []
    for cfg in mf.sweep_configs(dtypes):
        lib = tmp_path / cfg.library
        lib.write_bytes(b"not really a library: " + cfg.name.encode())
        entries.append(mf.config_entry(cfg, lib))
    mf.write_manifest(tmp_path, arch, "4.8.1", "13.0", "test", entries)
    if source_hash:
        data = json.loads((tmp_path / mf.MANIFEST_NAME).read_text())
        data["source_hash"] = source_hash
        (tmp_path / mf.MANIFEST_NAME).write_text(json.dumps(data))
    return tmp_path


def test_matching_build_is_found(tmp_path):
    _fake_build(tmp_path)
    path, reason = mf.find_library(mf.CuteConfig("fp8"), tmp_path, "sm_90a")
    assert reason is None and path == tmp_path / mf.CuteConfig("fp8").library


def test_stale_sources_refused(tmp_path):
    _fake_build(tmp_path, source_hash="0123456789abcdef")
    path, reason = mf.find_library(mf.CuteConfig("bf16"), tmp_path, "sm_90a")
    assert path is None and "stale" in reason and "msa-bench build-kernels" in reason


def test_wrong_arch_refused(tmp_path):
    _fake_build(tmp_path, arch="sm_80")
    path, reason = mf.find_library(mf.CuteConfig("bf16"), tmp_path, "sm_90a")
    assert path is None and "sm_80" in reason and "sm_90a" in reason


def test_missing_build_and_missing_library(tmp_path):
    path, reason = mf.find_library(mf.CuteConfig("bf16"), tmp_path, "sm_90a")
    assert path is None and "no CuTe build" in reason and "--out" in reason
    _fake_build(tmp_path)
    (tmp_path / mf.CuteConfig("bf16").library).unlink()
    path, reason = mf.find_library(mf.CuteConfig("bf16"), tmp_path, "sm_90a")
    assert path is None and "missing" in reason


def test_altered_library_refused(tmp_path):
    _fake_build(tmp_path)
    (tmp_path / mf.CuteConfig("fp8").library).write_bytes(b"something else")
    path, reason = mf.find_library(mf.CuteConfig("fp8"), tmp_path, "sm_90a")
    assert path is None and "checksum" in reason


def test_unbuilt_config_and_manifest_merge(tmp_path):
    _fake_build(tmp_path, dtypes=("bf16",))
    path, reason = mf.find_library(mf.CuteConfig("fp8"), tmp_path, "sm_90a")
    assert path is None and "no kvo_attn_fp8" in reason
    _fake_build(tmp_path, dtypes=("fp8",))            # building fp8 keeps bf16 in the manifest
    for dtype in ("bf16", "fp8"):
        assert mf.find_library(mf.CuteConfig(dtype), tmp_path, "sm_90a")[1] is None


def test_sweep_configs_name_each_generation():
    cfgs = mf.sweep_configs()
    names = [c.name for c in cfgs]
    assert len(set(names)) == len(names)
    assert mf.CuteConfig("bf16").name == "kvo_attn_bf16_q8g16d128b128_c2"          # v2 names unchanged
    assert mf.CuteConfig("bf16", ctas_per_sm=1, variant="v3").name.endswith("_c1_v3")
    assert mf.CuteConfig("fp8", ctas_per_sm=1, variant="v4").name.endswith("_c1_v4")
    assert {(c.variant, c.dtype) for c in cfgs if c.variant == "v4"} == {("v4", "bf16"), ("v4", "fp8")}
    for c in cfgs:
        assert c.ctas_per_sm in mf.VARIANT_CTAS[(c.variant, c.dtype)]
    assert {(c.variant, c.dtype) for c in cfgs} == {k for k, ctas in mf.VARIANT_CTAS.items() if ctas}


def test_knockouts_are_built_but_not_selectable():
    """Knock-out builds have C-identifier names and parse back to (base, piece); the harness's backend
    refuses them, since their outputs are not attention."""
    from msa_bench.kernels.cute.backend import KVOuterCuteBackend
    from msa_bench.kernels.kv_outer.backend import ATTENTION_IMPLS
    cfgs = [c for c in mf.knockout_configs() if c.variant in mf.KNOCKOUT_VARIANTS]
    for c in mf.knockout_configs():
        assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", c.name) and c.variant not in mf.VARIANTS
    for c in cfgs:
        assert mf.knockout_piece(c.variant) == tuple(c.variant.split("ko-"))
        assert mf.knockout_piece(c.variant)[0] in mf.KNOCKOUT_BASES
    assert len(cfgs) == len(mf.KNOCKOUT_BASES) * len(mf.KNOCKOUTS) * len(mf.DTYPES)
    assert mf.knockout_piece("v18") is None and mf.knockout_piece("v18ko-store") is None
    assert mf.knockout_piece("v22ko-exp") is None             # a generation without knock-out builds
    assert mf.knockout_piece("v99ko-exp") is None
    for v in mf.KNOCKOUT_VARIANTS + mf.TRACE_VARIANTS:
        with pytest.raises(ValueError, match="no kernel generation"):
            KVOuterCuteBackend.from_option(v)
        assert f"cute-{v}" not in ATTENTION_IMPLS


def test_source_hash_tracks_kernel_sources():
    here = Path(mf.__file__).parent
    assert all((here / f).is_file() for f in mf.SOURCE_FILES)
    assert len(mf.source_hash()) == 16 and mf.source_hash() == mf.source_hash()


# ---- backend and CLI surface -------------------------------------------------------------------

def test_backend_reports_unavailable_without_gpu():
    b = get_backend("kv-outer-cute")
    assert b.unavailable_reason("fp16", "cpu").startswith("kv-outer-cute does not support dtype fp16")
    if not torch.cuda.is_available():
        assert "CUDA GPU" in b.unavailable_reason("bf16", "cpu")


def test_config_for_other_geometry_is_unavailable():
    from msa_bench.scenarios.workload import AttnShape
    from msa_bench.kernels.cute.backend import cute_config_for

    class W:
        dtype = "bf16"
        shape = AttnShape(hq=32, hkv=4)
    with pytest.raises(BackendUnavailable, match="TILE_Q \\* G = 128"):
        cute_config_for(W(), 8)
    W.shape = AttnShape()
    assert cute_config_for(W(), 8) == mf.CuteConfig("bf16", ctas_per_sm=1, variant="v23")   # the default generation
    W.dtype = "fp8"
    assert cute_config_for(W(), 8) == mf.CuteConfig("fp8", ctas_per_sm=1, variant="v28")
    W.dtype = "bf16"
    assert cute_config_for(W(), 8, variant="v3") == mf.CuteConfig("bf16", ctas_per_sm=1, variant="v3")
    with pytest.raises(BackendUnavailable, match="CTAs per SM"):
        cute_config_for(W(), 8, 2, "v3")                 # bf16 v3 needs 192 KiB: one CTA per SM
    assert cute_config_for(W(), 8, variant="v4") == mf.CuteConfig("bf16", ctas_per_sm=1, variant="v4")
    with pytest.raises(BackendUnavailable, match="CTAs per SM"):
        cute_config_for(W(), 8, 2, "v4")                 # v4: 384 threads, one CTA per SM
    with pytest.raises(BackendUnavailable, match="unknown CuTe kernel variant"):
        cute_config_for(W(), 8, variant="v8")            # measured and dropped (docs/perf-log.md)


def test_each_generation_registers_an_attention_impl():
    from msa_bench.kernels.cute.backend import KVOuterCuteBackend
    from msa_bench.kernels.kv_outer.backend import ATTENTION_IMPLS
    assert {"cute", "cute-v3", "cute-v4", "cute-v7", "cute-v9", "cute-v10", "cute-v15", "cute-v18", "cute-v21",
            "cute-v22"} <= set(ATTENTION_IMPLS)
    b = KVOuterCuteBackend(variant="v3")
    assert b.attention_impl == "cute-v3" and b.ctas_for("bf16") == 1
    assert KVOuterCuteBackend(variant="v2").attention_impl == "cute" and KVOuterCuteBackend(variant="v2").ctas_for("fp8") == 2
    default = KVOuterCuteBackend()                    # each dtype's default generation
    assert default.attention_impl == "cute-default" and "cute-default" in ATTENTION_IMPLS
    assert default.variant_for("bf16") == "v23" and default.variant_for("fp8") == "v28"
    assert default.ctas_for("bf16") == default.ctas_for("fp8") == 1
    b4 = KVOuterCuteBackend(variant="v4")
    assert b4.attention_impl == "cute-v4" and b4.ctas_for("bf16") == 1


def test_pack_rejects_bad_extents():
    from msa_bench.kernels.cute.loader import CuteAttentionLibrary
    with pytest.raises(ValueError, match="13 tensors"):
        CuteAttentionLibrary.pack([0] * 12, [1] * 12)
    with pytest.raises(ValueError, match="int32"):
        CuteAttentionLibrary.pack([0] * 13, [2 ** 31] + [1] * 12)


@pytest.mark.parametrize("args, msg", [(["--dtype", "fp4"], "--dtype must be one of"),
                                       (["--arch", "sm_100a"], "--arch must be one of")])
def test_build_kernels_bad_input_is_one_line(args, msg):
    proc = _cli("build-kernels", *args)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and msg in proc.stderr


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("variant", [*mf.VARIANTS, None])
def test_cute_stage_matches_reference_on_gpu(variant):
    """Small end-to-end check of each kernel generation, and of the default dispatch (variant None: each
    dtype's default generation), where a GPU and a build (or the DSL) are present."""
    from msa_bench.scenarios.reference import reference_attention, relative_error
    from msa_bench.scenarios.selection import synthetic_workload
    from msa_bench.scenarios.workload import AttnShape
    from msa_bench.kernels.cute.backend import KVOuterCuteBackend
    b = KVOuterCuteBackend(variant=variant)
    reasons = []
    for dtype, tol in (("bf16", 1e-2), ("fp8", 5e-2)):
        if not mf.VARIANT_CTAS[(b.variant_for(dtype), dtype)]:
            continue                                   # a generation that changes one dtype only
        reason = b.unavailable_reason(dtype, "cuda")
        if reason:
            reasons.append(reason)
            continue
        w = synthetic_workload(AttnShape(), dtype, tokens=64, context=4096, reuse=1.0, causal=True,
                               seed=3, device="cuda")
        out = b.plan(w).run()
        ref, _ = reference_attention(w)
        assert relative_error(out, ref) <= tol
    if reasons:
        pytest.skip("; ".join(reasons))


def test_default_attention_impl_dispatches_on_the_workload_dtype(monkeypatch):
    """kv-outer-cute's default stage builds the dtype's default generation (the stage itself needs a
    GPU; here it is replaced by a recorder, only the dispatch is under test)."""
    from types import SimpleNamespace
    from msa_bench.kernels.cute import backend as cb
    from msa_bench.kernels.kv_outer.backend import ATTENTION_IMPLS
    made = []
    monkeypatch.setattr(cb, "CuteAttentionStage", lambda w, b, cfg, variant: made.append((w.dtype, variant)))
    for dtype in ("bf16", "fp8"):
        ATTENTION_IMPLS["cute-default"](SimpleNamespace(dtype=dtype), {}, None)
    assert made == [("bf16", "v23"), ("fp8", "v28")]


def test_diagnostic_builds_name_their_base_and_bind_to_its_plan(monkeypatch):
    """A knock-out or trace build's base generation, and its stage made on the base plan's buffers and
    configuration (the stage itself needs a GPU; here it is a recorder)."""
    from types import SimpleNamespace
    from msa_bench.kernels.cute import backend as cb
    assert mf.diagnostic_base("v18ko-exp") == "v18" and mf.diagnostic_base("v22tr") == "v22"
    assert mf.diagnostic_base("v22") is None and mf.diagnostic_base("triton") is None
    monkeypatch.setattr(cb, "CuteAttentionStage", lambda w, buffers, config, variant: (w, buffers, config, variant))
    plan = SimpleNamespace(buffers={"o_part": 1}, stages={"attention": SimpleNamespace(config="cfg")})
    assert cb.diagnostic_stage(plan, "w", "v18ko-exp") == ("w", {"o_part": 1}, "cfg", "v18ko-exp")


def test_default_tile_order_groups_queries_only_when_a_heads_q_outgrows_its_share_of_l2():
    """No order given: key order while one KV head's Q rows fit 16 MiB (real prefill's short cases) or
    the selected blocks average fewer than 128 queries (high reuse: K/V reloads), else the fewest
    power-of-two query ranges that fit, dealt in phases (N 16384: bf16 4, fp8 2). An order or a config
    given is kept."""
    from msa_bench.scenarios.selection import synthetic_workload
    from msa_bench.scenarios.workload import AttnShape
    from msa_bench.kernels.cute.backend import KVOuterCuteBackend
    from msa_bench.kernels.kv_outer.config import grouped_tile_order
    key = dict(q_ranges=1, order_chunk=0, order_phases=False)
    assert grouped_tile_order(1649, 16, 128, 2, 226.5) == key                # 6.4 MiB
    assert grouped_tile_order(16384, 16, 128, 2, 256) == dict(q_ranges=4, order_chunk=0, order_phases=True)
    assert grouped_tile_order(16384, 16, 128, 1, 256) == dict(q_ranges=2, order_chunk=0, order_phases=True)
    assert grouped_tile_order(8192, 16, 128, 1, 256) == key                  # exactly 16 MiB
    assert grouped_tile_order(8476, 16, 128, 1, 247.5)["q_ranges"] == 2
    assert grouped_tile_order(8192, 16, 128, 2, 64) == key                   # nsb/N 1: reloads
    shape = AttnShape(hq=16, hkv=1, head_dim=128, block=128, topk=16)
    big = synthetic_workload(shape, "fp8", 12000, 262144, 0.1, seed=0, device="cpu")   # Q 22.5 MiB, fan-in 160
    cfg = KVOuterCuteBackend().resolved_config(big)
    assert (cfg.q_ranges, cfg.order_phases) == (2, True)
    assert KVOuterCuteBackend(order="1:0").resolved_config(big).q_ranges == 1
    spread = synthetic_workload(shape, "fp8", 12000, 262144, 0.15, seed=0, device="cpu")   # fan-in 107
    assert KVOuterCuteBackend().resolved_config(spread).q_ranges == 1
    small = synthetic_workload(shape, "fp8", 512, 8192, 0.05, seed=0, device="cpu")
    assert KVOuterCuteBackend().resolved_config(small).q_ranges == 1
