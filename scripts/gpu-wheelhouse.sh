#!/usr/bin/env bash
# Copied into the repository from the workspace's shared/tools/gpu-wheelhouse.sh, unchanged apart from
# these three lines, the usage path below and safetensors (selection traces) in the download.
# Build an offline wheelhouse for a GPU host that has no package index
# (CPython 3.12, manylinux x86_64, torch/triton/pandas/matplotlib/nvidia-ml-py/typer
# already installed there). FlashInfer's wheel is slimmed to the parts that the
# attention kernels need so that the whole folder stays well under 64 MiB.
#
#   bash scripts/gpu-wheelhouse.sh OUT_DIR
#   # on the GPU host:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site OUT_DIR/*.whl
#   export PYTHONPATH=/tmp/site:$PYTHONPATH
set -euo pipefail
out=${1:?usage: gpu-wheelhouse.sh OUT_DIR}
mkdir -p "$out"
tmp=$(mktemp -d)
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plat[@]}" -d "$tmp" flashinfer-python==0.7.2.post1 apache-tvm-ffi==0.1.15.post2 cuda-tile==1.7.0 \
  safetensors==0.8.0
python3 - "$tmp" "$out" <<'PY'
import pathlib, shutil, sys, zipfile
src, out = map(pathlib.Path, sys.argv[1:])
drop = ("flashinfer/data/csrc/cake_sampling/", "flashinfer/data/csrc/cake_dsv4/",
        "flashinfer/data/csrc/fused_moe/", "flashinfer/data/csrc/kda/", "flashinfer/data/csrc/gdn/",
        "flashinfer/data/csrc/experimental/", "flashinfer/data/csrc/cake_trtllm_moe_allreduce_union/",
        "flashinfer/data/csrc/cake_mamba_ssd_combined/", "flashinfer/data/csrc/alphamoe_nvfp4_sm100.cu",
        "flashinfer/experimental/b12x/", "flashinfer/moe_ep/kernel_src/")
for whl in src.glob("*.whl"):
    if not whl.name.startswith("flashinfer_python"):
        shutil.copy(whl, out / whl.name); continue
    with zipfile.ZipFile(whl) as zin, zipfile.ZipFile(out / whl.name, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        for info in zin.infolist():
            if not info.filename.startswith(drop):
                zout.writestr(info, zin.read(info.filename), compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
PY
rm -rf "$tmp"
du -sh "$out"; ls -l "$out"
