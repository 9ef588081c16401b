"""CuTe DSL attention stage: the ahead-of-time build (a real sm_90a compile, no GPU needed) and the
Python side of loading (manifest checks: stale sources, wrong arch, missing or altered library)."""
from __future__ import annotations

import ctypes
import glob
import hashlib
import json
import os
import re
import struct
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
    """`msa-bench build-kernels` as it runs by default: every library the sweep can select, compiled for
    sm_90a, PTX kept for inspection."""
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
def test_build_writes_every_library_the_sweep_can_select_and_the_manifest(built):
    out, _ = built
    data = json.loads((out / mf.MANIFEST_NAME).read_text())
    assert data["arch"] == "sm_90a" and data["source_hash"] == mf.source_hash()
    assert data["dsl_version"] == "4.8.1" and data["cuda_version"].startswith("13.") and data["cxx_version"]
    configs = mf.library_configs() + mf.q_packed_configs()
    assert {e["name"] for e in data["configs"]} == {c.name for c in configs} and len(configs) <= 16
    for cfg in configs:
        path, reason = mf.find_library(cfg, out, "sm_90a")
        assert reason is None and path.stat().st_size > 10_000
    for e in data["configs"]:
        if e["kind"] == "kv-outer":
            k = mf.KERNELS[e["kernel"]]
            assert e["class"] == k.cls and e["options"] == k.options and e["ctas_per_sm"] == k.ctas_per_sm
        else:
            assert e["class"] == mf.QPackedConfig.kernel_class and e["kernel_version"].startswith("qp2-")
            assert e["options"] == {flag: e[flag] for flag in (*mf.OPTION_FLAGS.values(), "pairs", "residual", "mma_sum")}


# sha256 of the device code of every library build-kernels makes by default: the sm_90a cubin the DSL
# compiles and build-kernels embeds, unchanged, in each library. v23 and v28 in bf16 and fp8 (bf16's default
# is v23, fp8's v28) as built at commit 9821365, and q-packed's per-dtype defaults (bf16 plain, fp8 pp+sa
# with four K/V stages, each warpgroup walking its own tokens' blocks, the direct path of one-token tiles),
# fp8's library where the warpgroups skip (s_ahead, five stages) and decode pairs (four) as built on
# 2026-12-02, and the 12-token tiles on three consumer warpgroups, each walking its third of the union (bf16's O staged in
# Q), as built on 2026-12-04: the
# builds measured on the H200. The rest of a library is host code (the DSL compiles its
# launcher for the build machine's CPU, AVX-512 where it has it; g++ links the shim), so its bytes differ
# from machine to machine and are not held. A change of structure keeps the cubins byte-identical; a
# kernel whose cubin moves must be checked and timed again on the GPU.
DEFAULT_DEVICE_CODE_SHA256 = {
    "kvo_attn_bf16_q8g16d128b128_c1_v23": "c52b37be8d20604abe79a70e222fd242c44ac05fc69b648e6001df234582a1fd",
    "kvo_attn_fp8_q8g16d128b128_c1_v23": "1a2722750fc52061cf281d3782882de51a0e404df8bd793048515d5bc09274a7",
    "kvo_attn_bf16_q8g16d128b128_c1_v28": "f37112912ed207db1518ae45f85d28a1aa4dcc9273b5884967ce2b51a4761e31",
    "kvo_attn_fp8_q8g16d128b128_c1_v28": "36284f162c7de29418bc98ad86748026daadee10e1bcbb186f563fb4d2c5cf4f",
    "qpk_attn_bf16_p8g16d128b128": "cdde6042f4c48ef56c08fce7c2e9caf1c105ca13be26c7d794449918ab8a444b",
    "qpk_attn_fp8_p8g16d128b128_pp_sa": "dbc40e89315c54cd9f206e6a525113d793d83c4dafb6d07c2f998bd333998eac",
    "qpk_attn_fp8_p8g16d128b128_sa": "7f4e1b8a8706e8adb79b5111418161234680d4f9699bdb927e8c9096fa6ddb7f",
    "qpk_attn_bf16_p8g16d128b128_pairs": "e36fb44deb35a6dab0339a51e3c462b5f7191275c7670a63445c1f564d803ffe",
    "qpk_attn_fp8_p8g16d128b128_pairs": "dd474e2c5a1b42e5c35f98e6c3e720936907347d3078d29643581073d7abce5e",
    # fp8's wide tile with its row sums by wgmma (mma_sum), as measured on the H200 on 2026-12-04
    "qpk_attn_fp8_p12g16d128b128_ms": "005cdb44bf359b46c78840f99bcce507b95b1cfa771fba975851dcfcf9847427",
    "qpk_attn_bf16_p12g16d128b128": "9eed9d2f777b6a4efed9096fe186904ecfa993d285824ed05fa5f2a0ddae7e1f",
    # the hybrid's residual merged in the epilogue, its partials' rows at 64-bit offsets (H200, 2026-12-04)
    "qpk_attn_bf16_p12g16d128b128_res": "a3334be3489d56d351920aa432348c5324aeb437cc70a7d45f8dfba12355e139",
    "qpk_attn_bf16_p8g16d128b128_res": "fa0918ac91c506c1d6aa2308e2ec116bef50b1f81b72c61e1ff237873d4c44ce",
    "qpk_attn_fp8_p12g16d128b128_res_ms": "f3d6e92c0e2badb4dc94442b3c9cdb3ae670b084b2d5e40ff6ead889f0c38231",
    "qpk_attn_fp8_p8g16d128b128_pp_sa_res": "cdd910e411161fb3a610776b194b355e369886de35576a7aa223280b705b2b0e",
    "qpk_attn_fp8_p8g16d128b128_sa_res": "001e38661356b2253d4858acf8b1e41e895b5722e1030daf33be7882f7870d51",
}
DEVICE_CODE_DSL_VERSION = "4.8.1"      # the DSL's own NVVM and ptxas compile the device code
EM_CUDA = 190


def _embedded_cubins(data: bytes) -> list[bytes]:
    """The CUDA ELF images (64-bit, e_machine EM_CUDA) inside a host library, each cut at the end of its
    section or program header table, whichever is later."""
    found, at = [], data.find(b"\x7fELF", 1)
    while at != -1:
        if data[at + 4] == 2 and struct.unpack_from("<H", data, at + 18)[0] == EM_CUDA:
            phoff, shoff = struct.unpack_from("<QQ", data, at + 32)
            phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, at + 54)
            found.append(data[at:at + max(shoff + shnum * shentsize, phoff + phnum * phentsize)])
        at = data.find(b"\x7fELF", at + 1)
    return found


@needs_dsl
def test_default_libraries_embed_the_measured_device_code(built):
    out, _ = built
    data = json.loads((out / mf.MANIFEST_NAME).read_text())
    if data["dsl_version"] != DEVICE_CODE_DSL_VERSION:
        pytest.skip(f"built with DSL {data['dsl_version']}; the recorded cubins are of DSL {DEVICE_CODE_DSL_VERSION}")
    cubins = {e["name"]: _embedded_cubins((out / f"lib{e['name']}.so").read_bytes()) for e in data["configs"]}
    assert all(len(c) == 1 for c in cubins.values()), {name: len(c) for name, c in cubins.items()}
    assert {name: hashlib.sha256(c[0]).hexdigest() for name, c in cubins.items()} == DEFAULT_DEVICE_CODE_SHA256


def test_embedded_cubin_is_found_whole_between_host_bytes():
    """The extractor skips a host ELF and returns a CUDA image exactly, headers past its sections."""
    cubin = bytearray(256)
    cubin[:5] = b"\x7fELF\x02"
    struct.pack_into("<H", cubin, 18, EM_CUDA)
    struct.pack_into("<QQ", cubin, 32, 64, 128)          # program headers at 64, section headers at 128
    struct.pack_into("<HHHH", cubin, 54, 56, 1, 64, 2)   # ends at 128 + 2 x 64 = 256
    host = b"\x7fELF\x02" + bytes(13) + b"\x3e\x00"     # x86-64 ELF header start: not a cubin
    data = b"\x7fELF" + bytes(100) + host + bytes(50) + bytes(cubin) + b"trailing host bytes"
    assert _embedded_cubins(data) == [bytes(cubin)]


def _ptx(dump: Path, kernel: str, dtype: str) -> str:
    """The PTX of one kernel (its symbol in the dump file's name) for one dtype."""
    tag = {"bf16": "BFloat16", "fp8": "Float8E4M3"}[dtype]
    symbol = mf.KERNELS[kernel].symbol
    texts = [Path(p).read_text() for p in glob.glob(str(dump / "*.ptx")) if symbol in p and tag in p]
    assert len(texts) == 1, (kernel, dtype, len(texts))
    return texts[0]


@needs_dsl
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_kernel_is_warp_specialized_with_tma_and_mbarrier_rings(built, dtype):
    """512 threads, setmaxnreg moving registers from the producer warpgroup (72) to the three consumer
    warpgroups (144); K/V by TMA (2-D tensor copies completing on an mbarrier with expect_tx), Q by
    cp.async with an mbarrier arrive, parity waits with the watchdog trap, wgmma, and the producer
    draining its copies before it exits."""
    _, dump = built
    text = _ptx(dump, "v23", dtype)
    assert ".target sm_90a" in text and ".reqntid 512, 1, 1" in text
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+72;", text)
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+144;", text)
    assert "cp.async.bulk.tensor.2d.shared::cta.global" in text and "mbarrier::complete_tx::bytes" in text
    assert "mbarrier.arrive.expect_tx" in text and "cp.async.mbarrier.arrive.noinc" in text
    assert "mbarrier.try_wait.parity" in text and "trap;" in text
    assert "fence.proxy.async" in text and "cp.async.wait_group" in text
    assert {"bf16": "f32.bf16.bf16", "fp8": "f32.e4m3.e4m3"}[dtype] in text


@needs_dsl
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_consumers_run_one_half_tile_at_a_time_and_store_o_per_warp(built, dtype):
    """One S and one P V wgmma group per half tile, each waited for at once (no group kept in flight);
    O staged by stmatrix and stored by TMA per warp, with no named barrier in the kernel beyond the
    launch's one."""
    _, dump = built
    text = _ptx(dump, "v23", dtype)
    assert text.count("wgmma.commit_group") == 2 and not re.search(r"wgmma\.wait_group\.sync\.aligned\s+1;", text)
    assert not re.search(r"\bbar(?:rier)?\.sync(?:\.aligned)?\s+\S+,\s*\d+;", text)
    assert "stmatrix.sync.aligned" in text and "cp.async.bulk.tensor.2d.global.shared" in text
    assert re.search(r"cp\.async\.bulk\.wait_group\.read\s+0;", text)


@needs_dsl
def test_fp8_p_v_reads_p_from_registers(built):
    """fp8 P V takes its A operand from four registers (the k32 e4m3 fragment), so P never goes through
    shared memory (V's keys are stored permuted to match: manifest.fp8_v_key_order)."""
    _, dump = built
    regs_a = re.compile(r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3 \{[^}]*\}, \{%r\d+, %r\d+, %r\d+, %r\d+\}")
    assert regs_a.search(_ptx(dump, "v23", "fp8"))


@needs_dsl
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_evict_first_marks_the_o_stores_and_kv_loads(built, dtype):
    """evict_first (v28) gives the O stores and K/V loads the evict-first L2 policy, where v23 passes the
    DSL's default policy operand; the MMAs and Q copies are v23's. The policy is a 64-bit operand of
    every TMA copy, moved into a register as a decimal constant."""
    _, dump = built
    plain, evict = _ptx(dump, "v23", dtype), _ptx(dump, "v28", dtype)
    policy = re.compile(r"mov\.b64\s+%rd\d+, " + str(0x12F0000000000000) + ";")
    kv_loads = evict.count("cp.async.bulk.tensor.2d.shared::cta.global")
    assert len(policy.findall(plain)) == 0
    assert len(policy.findall(evict)) == 1 + kv_loads and kv_loads >= 2      # one O store site
    assert evict.count("wgmma.mma_async") == plain.count("wgmma.mma_async")
    assert (evict.count("cp.async.ca") + evict.count("cp.async.cg")
            == plain.count("cp.async.ca") + plain.count("cp.async.cg"))


@needs_dsl
def test_built_library_exports_the_shim(built):
    out, _ = built
    try:
        ctypes.CDLL("libcudart.so.13", mode=ctypes.RTLD_GLOBAL)
    except OSError:
        pytest.skip("libcudart.so.13 not loadable here")
    for cfg in mf.library_configs() + mf.q_packed_configs():
        lib = ctypes.CDLL(str(out / cfg.library))
        assert getattr(lib, f"{cfg.name}_load") and getattr(lib, f"{cfg.name}_launch")


@pytest.mark.parametrize("cfg", [mf.CuteConfig("v23", "bf16"), mf.QPackedConfig("fp8"),
                                 mf.QPackedConfig("fp8", residual=True)], ids=lambda c: c.name)
def test_library_abi_follows_the_kernel_signature_and_the_shim(cfg):
    """Each kind's Abi is its kernel's __call__ signature (read from the source: importing the module needs
    the DSL), and its shim packs the tensors and passes the scalars in that order with those C types; the
    tensors a configuration leaves out (compiled as None) are in neither its shim's packing nor its call."""
    import ast
    from msa_bench.kernels.cute.shim_template import shim_source
    module, _, cls = cfg.kernel_class.rpartition(".")
    tree = ast.parse((Path(mf.__file__).parent / f"{module}.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    call = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__call__")
    params = [a.arg for a in call.args.args[1:]]
    tensors, scalars = cfg.abi.tensor_names, [name for name, _ in cfg.abi.scalars]
    assert params == [*tensors, *scalars, "stream"]
    shim = shim_source(cfg.kind, cfg.name, cfg.omitted)
    kept = [(a, i) for i, a in enumerate(tensors) if a not in cfg.omitted]
    assert len(kept) == len(tensors) - (4 if cfg.kind == "q-packed" and not cfg.residual else 0)
    assert [(a, int(i)) for a, i in re.findall(r"_TENSOR\((\w+), (\d+)\)", shim)] == kept
    wrapper = re.search(r"wrapper\(&\w+_module, (.*?)\);", shim, re.S).group(1)
    assert [a.strip().lstrip("&") for a in wrapper.split(",")] == [a for a, _ in kept] + [*scalars,
                                                                                           "(cudaStream_t)stream"]
    launch = re.search(rf"{cfg.name}_launch\(void \*const \*ptrs, const int32_t \*rows, (.*?)\)", shim, re.S)
    ctype = {"i32": "int32_t", "f32": "float"}
    assert [" ".join(p.split()) for p in launch.group(1).split(",")] == \
        [f"{ctype[kind]} {name}" for name, kind in cfg.abi.scalars] + ["void *stream"]


# ---- manifest checks (no DSL needed) -----------------------------------------------------------

BF16, FP8 = mf.CuteConfig("v23", "bf16"), mf.CuteConfig("v28", "fp8")


def _fake_build(tmp_path: Path, arch="sm_90a", source_hash=None, dtypes=("bf16", "fp8")) -> Path:
    entries = []
    for cfg in mf.library_configs(dtypes):
        lib = tmp_path / cfg.library
        lib.write_bytes(b"not really a library: " + cfg.name.encode())
        entries.append(mf.config_entry(cfg, lib))
    mf.write_manifest(tmp_path, arch, dict(dsl_version="4.8.1", cuda_version="13.0", cxx_version="test"), entries)
    if source_hash:
        data = json.loads((tmp_path / mf.MANIFEST_NAME).read_text())
        data["source_hash"] = source_hash
        (tmp_path / mf.MANIFEST_NAME).write_text(json.dumps(data))
    return tmp_path


def test_matching_build_is_found(tmp_path):
    _fake_build(tmp_path)
    path, reason = mf.find_library(FP8, tmp_path, "sm_90a")
    assert reason is None and path == tmp_path / FP8.library


def test_stale_sources_refused(tmp_path):
    _fake_build(tmp_path, source_hash="0123456789abcdef")
    path, reason = mf.find_library(BF16, tmp_path, "sm_90a")
    assert path is None and "stale" in reason and "msa-bench build-kernels" in reason


def test_wrong_arch_refused(tmp_path):
    _fake_build(tmp_path, arch="sm_80")
    path, reason = mf.find_library(BF16, tmp_path, "sm_90a")
    assert path is None and "sm_80" in reason and "sm_90a" in reason


def test_missing_build_and_missing_library(tmp_path):
    path, reason = mf.find_library(BF16, tmp_path, "sm_90a")
    assert path is None and "no CuTe build" in reason and "--out" in reason
    _fake_build(tmp_path)
    (tmp_path / BF16.library).unlink()
    path, reason = mf.find_library(BF16, tmp_path, "sm_90a")
    assert path is None and "missing" in reason


def test_build_of_an_older_manifest_format_refused(tmp_path):
    """A build made before one manifest held both kinds of library (format 2) asks for a rebuild."""
    _fake_build(tmp_path)
    data = json.loads((tmp_path / mf.MANIFEST_NAME).read_text())
    (tmp_path / mf.MANIFEST_NAME).write_text(json.dumps({**data, "format": 2}))
    path, reason = mf.find_library(BF16, tmp_path, "sm_90a")
    assert path is None and "format 2, expected 3" in reason and "build-kernels" in reason


def test_altered_library_refused(tmp_path):
    _fake_build(tmp_path)
    (tmp_path / FP8.library).write_bytes(b"something else")
    path, reason = mf.find_library(FP8, tmp_path, "sm_90a")
    assert path is None and "checksum" in reason


def test_unbuilt_config_and_manifest_merge(tmp_path):
    _fake_build(tmp_path, dtypes=("bf16",))
    path, reason = mf.find_library(FP8, tmp_path, "sm_90a")
    assert path is None and "no kvo_attn_fp8" in reason
    _fake_build(tmp_path, dtypes=("fp8",))            # building fp8 keeps bf16 in the manifest
    for dtype in ("bf16", "fp8"):
        assert mf.find_library(mf.CuteConfig(mf.default_kernel(dtype), dtype), tmp_path, "sm_90a")[1] is None


def test_library_configs_build_each_kernel_in_each_of_its_dtypes():
    cfgs = mf.library_configs()
    names = [c.name for c in cfgs]
    assert len(set(names)) == len(names) <= 8
    assert {(c.kernel, c.dtype) for c in cfgs} == {(k, d) for k, spec in mf.KERNELS.items() for d in spec.dtypes}
    assert mf.CuteConfig("v23", "bf16").name == "kvo_attn_bf16_q8g16d128b128_c1_v23"     # the measured libraries' names
    assert [c.name for c in mf.library_configs(("fp8",), ("v28",))] == ["kvo_attn_fp8_q8g16d128b128_c1_v28"]


def test_each_dtype_has_one_default_kernel():
    assert mf.default_kernel("bf16") == "v23" and mf.default_kernel("fp8") == "v28"
    for dtype in mf.DTYPES:
        assert sum(dtype in k.default_for for k in mf.KERNELS.values()) == 1
    assert mf.default_kernel("fp16") == "v23"                  # a dtype without one: bf16's


def test_kernel_table_names_classes_that_exist():
    """Each KERNELS class is defined in its module with every option it is given as a keyword of its
    constructor (read from the source: importing the module needs the DSL)."""
    import ast
    here = Path(mf.__file__).parent
    for name, k in mf.KERNELS.items():
        module, _, cls = k.cls.rpartition(".")
        tree = ast.parse((here / f"{module}.py").read_text())
        node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), None)
        assert node is not None, (name, k.cls)
        init = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
        keywords = {a.arg for a in init.args.args + init.args.kwonlyargs}
        assert set(k.options) | {"symbol"} <= keywords, (name, k.options)
        assert k.symbol and re.fullmatch(r"[A-Za-z0-9_]+", k.symbol)
    assert len({k.symbol for k in mf.KERNELS.values()}) == len(mf.KERNELS)


def test_q_packed_kv_stages_name_a_library_of_their_own():
    """A K/V ring other than the kernel's own count is a constructor flag and a library name of its own; the
    default libraries keep their names and flags."""
    default, five = mf.QPackedConfig("fp8", False, True), mf.QPackedConfig("fp8", False, True, kv_stages=4)
    assert default.name == "qpk_attn_fp8_p8g16d128b128_sa" and "kv_stages" not in default.kernel_options
    assert five.name == default.name + "_kv4" and five.kernel_options == dict(default.kernel_options, kv_stages=4)
    assert five.options == default.options


def test_source_hash_tracks_kernel_sources():
    files = mf.source_files()
    assert {"kv_outer_sm90.py", "producer.py", "mma.py", "softmax.py", "build.py", "shim_template.py",
            "manifest.py"} <= set(files)
    assert not set(files) & set(mf.HOST_ONLY_FILES)
    assert len(mf.source_hash()) == 16 and mf.source_hash() == mf.source_hash()


def test_fp8_v_key_order_is_a_permutation_within_16():
    order = mf.fp8_v_key_order()
    assert sorted(order) == list(range(16)) and order[:4] == [0, 1, 8, 9]


# ---- backend and CLI surface -------------------------------------------------------------------

def test_backend_says_first_that_it_needs_the_gpu():
    """Without a GPU, the GPU is named before any dtype: it is what the user must change first."""
    b = get_backend("kv-outer-cute")
    for dtype in ("fp16", "bf16"):
        assert b.unavailable_reason(dtype, "cpu") == "kv-outer-cute runs only on a CUDA GPU (sm_90a)"
    if torch.cuda.is_available():
        assert b.unavailable_reason("fp16", "cuda").startswith("kv-outer-cute does not support dtype fp16")


def test_config_for_other_geometry_is_unavailable():
    from msa_bench.scenarios.workload import AttnShape
    from msa_bench.kernels.cute.backend import cute_config_for

    class W:
        dtype = "bf16"
        shape = AttnShape(hq=32, hkv=4)
    with pytest.raises(BackendUnavailable, match="TILE_Q \\* G = 128"):
        cute_config_for(W(), 8)
    W.shape = AttnShape()
    assert cute_config_for(W(), 8) == mf.CuteConfig("v23", "bf16")            # the dtype's default kernel
    W.dtype = "fp8"
    assert cute_config_for(W(), 8) == mf.CuteConfig("v28", "fp8")
    assert cute_config_for(W(), 8, kernel="v23") == mf.CuteConfig("v23", "fp8")
    with pytest.raises(BackendUnavailable, match="CTAs per SM"):
        cute_config_for(W(), 8, 2, "v23")                # 512 threads, 224 KiB of shared memory: one CTA per SM
    with pytest.raises(BackendUnavailable, match="unknown CuTe kernel 'v22'"):
        cute_config_for(W(), 8, kernel="v22")            # removed (docs/perf-log.md)


def test_backend_options_name_a_kernel_a_tile_order_or_both():
    """@KERNEL runs that kernel in every dtype, @ORDER each dtype's default with that order, @KERNEL+ORDER
    both; anything else is one clear error."""
    from msa_bench.kernels.cute.backend import KVOuterCuteBackend
    default = KVOuterCuteBackend()
    assert default.kernel_for("bf16") == "v23" and default.kernel_for("fp8") == "v28"
    assert default.ctas_for("bf16") == default.ctas_for("fp8") == 1 and default.attention_impl == "cute"
    b = KVOuterCuteBackend.from_option("v23")
    assert b.kernel_for("fp8") == "v23" and b.order is None
    b = KVOuterCuteBackend.from_option("v28+2:p")
    assert b.kernel == "v28" and b.order == "2:p"
    b = KVOuterCuteBackend.from_option("phases")
    assert b.kernel is None and b.order == "phases"
    assert KVOuterCuteBackend.from_option("4:8").order == "4:8"
    with pytest.raises(ValueError, match="has no kernel 'v22'"):
        KVOuterCuteBackend.from_option("v22")
    with pytest.raises(ValueError, match="tile order 'chunks' is not S:k"):
        KVOuterCuteBackend.from_option("v23+chunks")


def test_pack_rejects_bad_extents():
    from msa_bench.kernels.cute.loader import pack_arguments
    meta = torch.device("meta")
    with pytest.raises(ValueError, match="13 tensors"):
        pack_arguments(BF16, [torch.empty(1, device=meta)] * 12, meta)
    with pytest.raises(ValueError, match="int32"):
        pack_arguments(BF16, [torch.empty(1, device=meta)] * 3 + [torch.empty(2 ** 31, device=meta)]
                       + [torch.empty(1, device=meta)] * 9, meta)
    with pytest.raises(BackendUnavailable, match="contiguous tensors"):
        pack_arguments(BF16, [torch.empty(4, 2).t()] + [torch.empty(1)] * 12, torch.device("cpu"))


@pytest.mark.parametrize("args, msg", [(["--dtype", "fp4"], "--dtype: unknown dtype 'fp4'"),
                                       (["--arch", "sm_100a"], "--arch must be one of"),
                                       (["--kernel", "v22"], "--kernel must be one of")])
def test_build_kernels_bad_input_is_one_line(args, msg):
    proc = _cli("build-kernels", *args)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and msg in proc.stderr


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernel", [*mf.KERNELS, None])
def test_cute_stage_matches_reference_on_gpu(kernel):
    """Small end-to-end check of each kernel, and of the default dispatch (kernel None: each dtype's
    default kernel), where a GPU and a build (or the DSL) are present."""
    from msa_bench.scenarios.reference import reference_attention, relative_error
    from msa_bench.scenarios.selection import synthetic_workload
    from msa_bench.scenarios.workload import AttnShape
    from msa_bench.kernels.cute.backend import KVOuterCuteBackend
    b = KVOuterCuteBackend(kernel=kernel)
    reasons = []
    for dtype, tol in (("bf16", 1e-2), ("fp8", 5e-2)):
        reason = b.unavailable_reason(dtype, "cuda")
        if reason:
            reasons.append(reason)
            continue
        w = synthetic_workload(AttnShape(), dtype, tokens=64, context=4096, reuse=1.0, causal=True,
                               seed=3, device="cuda")
        plan = b.plan(w)
        assert plan.info["cute_kernel"] == b.kernel_for(dtype)
        out = plan.run()
        ref, _ = reference_attention(w)
        assert relative_error(out, ref) <= tol
    if reasons:
        pytest.skip("; ".join(reasons))


def test_attention_stage_runs_the_backends_kernel_or_the_dtypes_default(monkeypatch):
    """kv-outer's attention stage "cute" runs the dtype's default kernel; the backend's own stage the kernel
    its option names (the stage itself needs a GPU; here it is replaced by a recorder, only the dispatch
    is under test)."""
    from types import SimpleNamespace
    from msa_bench.kernels.cute import backend as cb
    from msa_bench.kernels.kv_outer.backend import ATTENTION_IMPLS
    made = []
    monkeypatch.setattr(cb, "CuteAttentionStage",
                        lambda w, b, cfg, kernel=None: made.append((w.dtype, kernel or mf.default_kernel(w.dtype))))
    for dtype in ("bf16", "fp8"):
        ATTENTION_IMPLS["cute"](SimpleNamespace(dtype=dtype), {}, None)
        cb.KVOuterCuteBackend().attention_stage(SimpleNamespace(dtype=dtype), {}, None)
        cb.KVOuterCuteBackend(kernel="v23").attention_stage(SimpleNamespace(dtype=dtype), {}, None)
    assert made == [("bf16", "v23")] * 3 + [("fp8", "v28"), ("fp8", "v28"), ("fp8", "v23")]


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
