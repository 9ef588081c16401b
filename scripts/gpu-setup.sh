# Set up the offline GPU host for msa-bench. Source it from anywhere:
#     source scripts/gpu-setup.sh
# - installs the FlashInfer wheelhouse (.whl-gpu/, built by shared/tools/gpu-wheelhouse.sh) into
#   $MSA_WHEEL_SITE (default /tmp/site), once per wheelhouse content;
# - installs this checkout as the package msa_bench into $MSA_PKG_SITE (default /tmp/msa-site),
#   afresh on every source (about 2 s, offline, setuptools from the host), so re-source after
#   changing code;
# - exports PYTHONPATH, PATH (the msa-bench console script) and FLASHINFER_CUDA_ARCH_LIST=9.0a.
# No `set -e`: this file is sourced; a failure prints one line and returns non-zero.

_msa_repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_msa_wheels=${MSA_WHEEL_SITE:-/tmp/site}
_msa_pkg=${MSA_PKG_SITE:-/tmp/msa-site}
_msa_pip=(python3 -m pip install -q --disable-pip-version-check --no-index --no-deps)
export PIP_ROOT_USER_ACTION=ignore

_msa_setup() {
    local whl_dir="$_msa_repo/.whl-gpu" stamp="$_msa_wheels/.msa-wheelhouse" want
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
    echo "gpu-setup: installing msa_bench from $_msa_repo into $_msa_pkg"
    [ -L "$_msa_pkg/msa_bench" ] && rm -f "$_msa_pkg/msa_bench"      # an earlier fallback link
    if ! "${_msa_pip[@]}" --no-build-isolation --upgrade --target "$_msa_pkg" "$_msa_repo"; then
        # no usable setuptools/bdist_wheel on the host: link the checkout as the package instead
        echo "gpu-setup: pip build failed; linking $_msa_repo as $_msa_pkg/msa_bench" >&2
        rm -rf "$_msa_pkg/msa_bench" && mkdir -p "$_msa_pkg/bin" && ln -s "$_msa_repo" "$_msa_pkg/msa_bench" \
            && printf '#!/usr/bin/env python3\nimport sys\nfrom msa_bench.cli import main\nsys.exit(main())\n' \
                > "$_msa_pkg/bin/msa-bench" && chmod +x "$_msa_pkg/bin/msa-bench" \
            || { echo "gpu-setup: error: could not install msa_bench" >&2; return 1; }
    fi
    case ":${PYTHONPATH:-}:" in *":$_msa_wheels:"*) ;; *) export PYTHONPATH="$_msa_wheels${PYTHONPATH:+:$PYTHONPATH}";; esac
    case ":$PYTHONPATH:" in *":$_msa_pkg:"*) ;; *) export PYTHONPATH="$_msa_pkg:$PYTHONPATH";; esac
    case ":$PATH:" in *":$_msa_pkg/bin:"*) ;; *) export PATH="$_msa_pkg/bin:$_msa_wheels/bin:$PATH";; esac
    export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}
    (cd /tmp && python3 -c "import msa_bench.cli") \
        || { echo "gpu-setup: error: msa_bench does not import" >&2; return 1; }
    echo "gpu-setup: ready (msa-bench at $(command -v msa-bench))"
}
_msa_setup
_msa_rc=$?
unset -f _msa_setup
return $_msa_rc 2>/dev/null || exit $_msa_rc
