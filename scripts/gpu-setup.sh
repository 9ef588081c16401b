# Set up the offline GPU host for msa-bench. Source it from anywhere:
#     source scripts/gpu-setup.sh
# - installs the FlashInfer wheelhouse (.whl-gpu/, built by scripts/gpu-wheelhouse.sh) into
#   $MSA_WHEEL_SITE (default /tmp/site), once per wheelhouse content;
# - installs this checkout as the package msa_bench into $MSA_PKG_SITE (default /tmp/msa-site),
#   afresh on every source (about 2 s, offline, setuptools from the host), so re-source after
#   changing code;
# - exports PYTHONPATH, PATH (the msa-bench console script) and FLASHINFER_CUDA_ARCH_LIST=9.0a;
# - first of all, restores FlashInfer's JIT cache from .fi-cache/flashinfer-jit.tar.xz when present
#   (made by scripts/save-fi-cache.sh on an earlier host), so the kernels are not rebuilt (~70 s FA2,
#   ~165 s FA3 on a fresh host).
# No `set -e`: this file is sourced; a failure prints one line and returns non-zero.
#
# FlashInfer's JIT cache, as read in flashinfer-python 0.7.2.post1 (flashinfer/jit/env.py, core.py, cpp_ext.py):
# - Location: ${FLASHINFER_WORKSPACE_BASE:-$HOME}/.cache/flashinfer/<version>/<archs>/ (here
#   0.7.2.post1/90a, from FLASHINFER_CUDA_ARCH_LIST=9.0a): generated/<module>/ holds the rendered .cu
#   sources, cached_ops/<module>/ the build.ninja, objects, <module>.so and ninja's .ninja_log/.ninja_deps.
#   There is no separate JIT-dir variable; FLASHINFER_CUBIN_DIR only moves downloaded cubins.
# - No source hash: for a JIT module (the .so is not an AOT artifact in flashinfer/data/aot or a
#   flashinfer-jit-cache wheel) build_and_load() always calls build(): it re-renders the sources and
#   build.ninja with write_if_different (unchanged content keeps the file and its mtime) and runs
#   `ninja -C cached_ops/<module>`. Ninja alone decides: it rebuilds when an output is missing, when the
#   command line's hash differs from .ninja_log (absolute paths: this cache dir, $MSA_WHEEL_SITE, CUDA
#   home, nvcc flags), or when any input is newer than the output, inputs including every header listed
#   in .ninja_deps (flashinfer/data/{include,csrc,cutlass,cccl,spdlog} and tvm_ffi's headers).
# - The catch: pip does not keep the wheel's file times, so a fresh wheelhouse install gives all those
#   headers "now" as mtime, newer than every restored object, and ninja would rebuild everything. Hence
#   after the install the non-Python files of flashinfer/ and tvm_ffi/ are set to a fixed old time
#   (2000-01-01 UTC; their content is fixed by the wheel, so no real change is hidden; .py files are
#   left alone so Python's .pyc caches stay valid). The tarball is written with --format=posix, which
#   keeps nanosecond mtimes, and GNU tar restores mtimes by default, so objects, .so files, sources and
#   ninja's logs keep the times ninja recorded.
# - The cache only hits on the same paths (HOME or FLASHINFER_WORKSPACE_BASE, MSA_WHEEL_SITE, CUDA home),
#   the same FlashInfer version and the same flags; otherwise ninja rebuilds, which is correct, just slow.
#   After restoring, `ninja -n` is asked for each cached module and the count that is up to date is printed.
# - The tarball reaches the host only if .fi-cache/ is copied there with the checkout (.fi-cache/ is
#   ignored by git via .git/info/exclude).
# - The run folders' provenance names the sender's commit when .gpu-commit/ is copied along (written
#   by scripts/stamp-commit.sh just before the copy; ignored by git too).

_msa_repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_msa_wheels=${MSA_WHEEL_SITE:-/tmp/site}
_msa_pkg=${MSA_PKG_SITE:-/tmp/msa-site}
_msa_pip=(python3 -m pip install -q --disable-pip-version-check --no-index --no-deps)
export PIP_ROOT_USER_ACTION=ignore

_msa_fi_base=${FLASHINFER_WORKSPACE_BASE:-$HOME}
_msa_fi_tar="$_msa_repo/.fi-cache/flashinfer-jit.tar.xz"

_msa_fi_restore() {
    # extract the JIT cache tarball into $_msa_fi_base/.cache once per tarball (a stamp records which)
    [ -f "$_msa_fi_tar" ] || return 0
    local stamp="$_msa_fi_base/.cache/flashinfer/.msa-restored" want
    want=$(stat -c '%s %Y' "$_msa_fi_tar")
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
        echo "gpu-setup: FlashInfer JIT cache already restored from $_msa_fi_tar"
        return 0
    fi
    mkdir -p "$_msa_fi_base/.cache" \
        && tar -C "$_msa_fi_base/.cache" -xJf "$_msa_fi_tar" \
        || { echo "gpu-setup: warning: could not extract $_msa_fi_tar (FlashInfer will JIT-build)" >&2; return 0; }
    echo "$want" > "$stamp"
    echo "gpu-setup: restored FlashInfer JIT cache ($(du -h "$_msa_fi_tar" | cut -f1) tarball, $(du -sh "$_msa_fi_base/.cache/flashinfer" | cut -f1) unpacked) into $_msa_fi_base/.cache/flashinfer"
}

_msa_fi_settle() {
    # give the installed headers a fixed old mtime so ninja does not see them as newer than the cache
    local d dirs=()
    for d in "$_msa_wheels/flashinfer" "$_msa_wheels/tvm_ffi"; do [ -d "$d" ] && dirs+=("$d"); done
    [ ${#dirs[@]} -gt 0 ] || return 0
    find "${dirs[@]}" ! -name '*.py' ! -name '*.pyc' ! -type l -newermt @946684801 \
        -exec touch -h -d @946684800 {} + 2>/dev/null \
        || echo "gpu-setup: warning: could not reset FlashInfer header mtimes (JIT modules may rebuild)" >&2
    [ -d "$_msa_fi_base/.cache/flashinfer" ] || return 0
    command -v ninja >/dev/null || return 0
    local f total=0 fresh=0 stale=()
    for f in "$_msa_fi_base"/.cache/flashinfer/*/*/cached_ops/*/build.ninja; do
        [ -f "$f" ] || continue
        total=$((total + 1))
        if ninja -n -C "${f%/build.ninja}" -f "$f" 2>/dev/null | grep -q "no work to do"; then
            fresh=$((fresh + 1))
        else
            stale+=("$(basename "${f%/build.ninja}")")
        fi
    done
    [ $total -gt 0 ] && echo "gpu-setup: FlashInfer JIT cache: $fresh/$total modules up to date for ninja${stale[*]:+ (will rebuild: ${stale[*]})}"
    return 0
}

_msa_setup() {
    local whl_dir="$_msa_repo/.whl-gpu" stamp="$_msa_wheels/.msa-wheelhouse" want
    _msa_fi_restore
    if ls "$whl_dir"/*.whl >/dev/null 2>&1; then
        want=$(cd "$whl_dir" && ls -l *.whl | awk '{print $5, $NF}')
        if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
            echo "gpu-setup: installing the wheelhouse into $_msa_wheels"
            "${_msa_pip[@]}" --upgrade --target "$_msa_wheels" "$whl_dir"/*.whl \
                || { echo "gpu-setup: error: wheelhouse install failed" >&2; return 1; }
            echo "$want" > "$stamp"
        fi
    else
        echo "gpu-setup: warning: no wheels in $whl_dir (FlashInfer backends will be unavailable)" >&2
    fi
    _msa_fi_settle
    echo "gpu-setup: installing msa_bench from $_msa_repo into $_msa_pkg"
    [ -L "$_msa_pkg/msa_bench" ] && rm -f "$_msa_pkg/msa_bench"      # a link left by an older version of this script
    "${_msa_pip[@]}" --no-build-isolation --upgrade --target "$_msa_pkg" "$_msa_repo" \
        || { echo "gpu-setup: error: could not install msa_bench (pip needs setuptools on the host)" >&2; return 1; }
    case ":${PYTHONPATH:-}:" in *":$_msa_wheels:"*) ;; *) export PYTHONPATH="$_msa_wheels${PYTHONPATH:+:$PYTHONPATH}";; esac
    case ":$PYTHONPATH:" in *":$_msa_pkg:"*) ;; *) export PYTHONPATH="$_msa_pkg:$PYTHONPATH";; esac
    case ":$PATH:" in *":$_msa_pkg/bin:"*) ;; *) export PATH="$_msa_pkg/bin:$_msa_wheels/bin:$PATH";; esac
    export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}
    # the host has no git: scripts/stamp-commit.sh wrote the sender's commit into .gpu-commit/ (copied along)
    if [ -f "$_msa_repo/.gpu-commit/commit" ]; then
        read -r MSA_BENCH_GIT_COMMIT MSA_BENCH_GIT_DIRTY < "$_msa_repo/.gpu-commit/commit"
        export MSA_BENCH_GIT_COMMIT MSA_BENCH_GIT_DIRTY
        echo "gpu-setup: sender's commit $MSA_BENCH_GIT_COMMIT (dirty: $MSA_BENCH_GIT_DIRTY)"
    fi
    (cd /tmp && python3 -c "import msa_bench.cli") \
        || { echo "gpu-setup: error: msa_bench does not import" >&2; return 1; }
    echo "gpu-setup: ready (msa-bench at $(command -v msa-bench))"
}
_msa_setup
_msa_rc=$?
unset -f _msa_setup _msa_fi_restore _msa_fi_settle
return $_msa_rc 2>/dev/null || exit $_msa_rc
