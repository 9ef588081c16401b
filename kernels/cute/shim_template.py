"""C++ sources of the shims linked into the CuTe libraries, one per kind of library (Python strings, so that
they are installed with the package and hashed with the kernel sources). Each defines `<name>_load()`, which
loads the embedded module once, and `<name>_launch(ptrs, rows, scalars..., stream)`, which launches on the
caller's stream with the arguments of its manifest.Abi in order (tests check the two against each other and
the kernel's __call__). kernels/cute/build.py fills in the configuration name (shim_source). These are the
texts the measured libraries were built from: any edit of them changes every library's bytes."""

KV_OUTER_SHIM = r"""// C entry points of one compiled CuTe DSL attention configuration (KVO_NAME is replaced by
// kernels/cute/build.py with the configuration name). Python calls them through ctypes:
//   KVO_NAME_load()                 loads the embedded module once; returns a cudaError_t
//   KVO_NAME_launch(ptrs, rows, ...) launches on `stream` (the caller's current stream, read at each
//                                   call so that CUDA-graph capture records it); returns a cudaError_t
// The launch does no allocation, sync or attribute setting (the module load did those), so it is
// legal inside stream capture.
// ptrs[i] / rows[i] are the data pointer and the dynamic leading extent of tensor argument i, in
// the order of the kernel's __call__ (q, k, v, csr_query, tile_key, tile_edge, tile_count,
// cta_range, page_block, q_limit, o_part, m_part, l_part).
#include "KVO_NAME.h"

static KVO_NAME_Kernel_Module_t kvo_module;
static int kvo_loaded = 0;

extern "C" int KVO_NAME_load(void) {
  if (!kvo_loaded) {
    cudaError_t err = cudaGetLastError();   // do not blame the load for an earlier error
    (void)err;
    KVO_NAME_Kernel_Module_Load(&kvo_module);
    err = cudaGetLastError();
    if (err != cudaSuccess) return (int)err;
    kvo_loaded = 1;
  }
  return 0;
}

#define KVO_TENSOR(arg, i)          \
  KVO_NAME_Tensor_##arg##_t arg;    \
  arg.data = ptrs[i];               \
  arg.dynamic_shapes[0] = rows[i];

extern "C" int KVO_NAME_launch(void *const *ptrs, const int32_t *rows, int32_t hkv, int32_t num_pages,
                               float scale, float out_scale, void *stream) {
  if (!kvo_loaded) return (int)cudaErrorInitializationError;
  KVO_TENSOR(mQ, 0) KVO_TENSOR(mK, 1) KVO_TENSOR(mV, 2) KVO_TENSOR(mCsrQuery, 3)
  KVO_TENSOR(mTileKey, 4) KVO_TENSOR(mTileEdge, 5) KVO_TENSOR(mTileCount, 6)
  KVO_TENSOR(mCtaRange, 7) KVO_TENSOR(mPageBlock, 8) KVO_TENSOR(mQLimit, 9)
  KVO_TENSOR(mO, 10) KVO_TENSOR(mM, 11) KVO_TENSOR(mL, 12)
  int32_t ret = cute_dsl_KVO_NAME_wrapper(&kvo_module, &mQ, &mK, &mV, &mCsrQuery, &mTileKey, &mTileEdge,
                                          &mTileCount, &mCtaRange, &mPageBlock, &mQLimit, &mO, &mM, &mL,
                                          hkv, num_pages, scale, out_scale, (cudaStream_t)stream);
  cudaError_t err = cudaGetLastError();   // the launch's own error (consumed: it is reported here)
  if (ret != 0) return (int)ret;
  return (int)err;
}
"""

# The q-packed entry points (QPK_NAME is replaced by the configuration name):
#   QPK_NAME_load()                   loads the embedded module once; returns a cudaError_t
#   QPK_NAME_launch(ptrs, rows, ...)  launches on `stream`; returns a cudaError_t. No allocation, sync or
#                                     attribute setting (the module load did those): legal in stream capture.
# ptrs[i] / rows[i]: data pointer and leading extent of tensor argument i, in manifest.Q_PACKED_ABI's order.
Q_PACKED_SHIM = r"""#include "QPK_NAME.h"

static QPK_NAME_Kernel_Module_t qpk_module;
static int qpk_loaded = 0;

extern "C" int QPK_NAME_load(void) {
  if (!qpk_loaded) {
    cudaError_t err = cudaGetLastError();   // do not blame the load for an earlier error
    (void)err;
    QPK_NAME_Kernel_Module_Load(&qpk_module);
    err = cudaGetLastError();
    if (err != cudaSuccess) return (int)err;
    qpk_loaded = 1;
  }
  return 0;
}

#define QPK_TENSOR(arg, i)          \
  QPK_NAME_Tensor_##arg##_t arg;    \
  arg.data = ptrs[i];               \
  arg.dynamic_shapes[0] = rows[i];

extern "C" int QPK_NAME_launch(void *const *ptrs, const int32_t *rows, int32_t hkv, int32_t n_token_tiles,
                               int32_t union_cap, int32_t num_ctas, int32_t n_tokens, int32_t topk, int32_t direct,
                               float scale, float out_scale, void *stream) {
  if (!qpk_loaded) return (int)cudaErrorInitializationError;
  QPK_TENSOR(mQ, 0) QPK_TENSOR(mK, 1) QPK_TENSOR(mV, 2) QPK_TENSOR(mTileTok0, 3) QPK_TENSOR(mTileNtok, 4)
  QPK_TENSOR(mTileCount, 5) QPK_TENSOR(mTilePage, 6) QPK_TENSOR(mTileLimit, 7) QPK_TENSOR(mTileSplit, 8)
  QPK_TENSOR(mPages, 9) QPK_TENSOR(mSel, 10) QPK_TENSOR(mQLimit, 11) QPK_TENSOR(mO, 12) QPK_TENSOR(mLse, 13)
  QPK_TENSOR(mResIdx, 14) QPK_TENSOR(mResO, 15) QPK_TENSOR(mResM, 16) QPK_TENSOR(mResL, 17)
  int32_t ret = cute_dsl_QPK_NAME_wrapper(&qpk_module, &mQ, &mK, &mV, &mTileTok0, &mTileNtok, &mTileCount,
                                          &mTilePage, &mTileLimit, &mTileSplit, &mPages, &mSel, &mQLimit, &mO,
                                          &mLse, &mResIdx, &mResO, &mResM, &mResL, hkv, n_token_tiles,
                                          union_cap, num_ctas, n_tokens, topk, direct,
                                          scale, out_scale, (cudaStream_t)stream);
  cudaError_t err = cudaGetLastError();   // the launch's own error (consumed: it is reported here)
  if (ret != 0) return (int)ret;
  return (int)err;
}
"""

import re

SHIMS = {"kv-outer": (KV_OUTER_SHIM, "KVO_NAME"), "q-packed": (Q_PACKED_SHIM, "QPK_NAME")}


def shim_source(kind: str, name: str, omitted: tuple = ()) -> str:
    """The C++ shim of configuration `name` of library kind `kind`, without the tensors it leaves out
    (LibraryConfig.omitted: their pointers are passed and not read)."""
    template, placeholder = SHIMS[kind]
    text = template.replace(placeholder, name)
    for arg in omitted:
        text = re.sub(rf" ?QPK_TENSOR\({arg}, \d+\)", "", text.replace(f" &{arg},", ""))
    return "\n".join(line for line in text.split("\n") if line.strip() or not line)
