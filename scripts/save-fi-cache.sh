#!/usr/bin/env bash
# Pack FlashInfer's JIT cache for the next GPU host:
#     bash scripts/save-fi-cache.sh OUT_DIR        (e.g. "$OUT" on the device host, after a FlashInfer run)
# writes OUT_DIR/flashinfer-jit.tar.xz (xz -9) from ${FLASHINFER_WORKSPACE_BASE:-$HOME}/.cache/flashinfer
# and prints its size. Copy it to .fi-cache/flashinfer-jit.tar.xz in the checkout (ignored by git) and
# carry .fi-cache to the device; scripts/gpu-setup.sh restores it (see the notes there on why the
# restored modules are not rebuilt). --format=posix keeps nanosecond mtimes, which ninja compares.
set -euo pipefail

out=${1:-}
if [ -z "$out" ] || [ $# -ne 1 ]; then
    echo "usage: $0 OUT_DIR" >&2
    exit 2
fi
base=${FLASHINFER_WORKSPACE_BASE:-$HOME}
src="$base/.cache/flashinfer"
if [ ! -d "$src" ]; then
    echo "save-fi-cache: error: no FlashInfer cache at $src (run a FlashInfer benchmark first)" >&2
    exit 1
fi
mkdir -p "$out"
dest="$out/flashinfer-jit.tar.xz"
tmp="$dest.tmp.$$"
trap 'rm -f "$tmp"' EXIT
# lock files and gpu-setup's restore stamp are host state, not cache
tar -C "$base/.cache" --format=posix --exclude='*.lock' --exclude='flashinfer/.msa-restored' -cf - flashinfer \
    | xz -9 -T0 -c > "$tmp"
mv "$tmp" "$dest"
trap - EXIT
modules=$(find "$src" -path '*/cached_ops/*' -name '*.so' | wc -l)
echo "save-fi-cache: $dest: $(stat -c %s "$dest") bytes ($(du -h "$dest" | cut -f1)) from $(du -sh "$src" | cut -f1) in $src, $modules module .so files"
