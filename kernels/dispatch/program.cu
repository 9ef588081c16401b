// A module's launches, recorded once at plan time and replayed from C at each call: the C++ dispatch of
// kernels/dispatch (program.py builds it, build.py compiles this file ahead of time, no GPU needed).
//
// A step is one of: a launch of a compiled kernel by its CUfunction (the Triton stages: the same
// binaries the Python path launches, with their arguments packed at plan time); a stable radix sort of
// (key, int64 value) pairs over the key bits that can differ, or an int32 inclusive scan (CUB: what torch.sort and torch.cumsum compute);
// a lower-bound search of 0..T-1 in sorted keys (torch.searchsorted); a key's tile count; a memset; a
// CuTe attention launch through its library's C entry point (either kind of library). Steps belong to a stage; msa_prog_run
// replays one stage or all of them, in order, on the caller's stream, with no allocation or sync, so
// that a run is legal inside CUDA-graph capture.
//
// msa_prog_instantiate captures the whole program once as a CUDA graph (plan time); msa_prog_run of every
// stage then launches that graph, one driver call where the steps are several, except on a stream that is
// itself being captured, where it adds the steps as before (a graph launch is not a capturable call).
//
// Every entry point returns 0 or an error code: a CUresult for kernel launches, a cudaError_t
// otherwise; msa_prog_failed_step names the step that returned it.
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#include <dlfcn.h>
#include <cuda_runtime.h>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

namespace {

typedef int (*LaunchKernel)(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                            unsigned bz, unsigned smem, void *stream, void **params, void **extra);
typedef int (*CuteKvoLaunch)(void *const *ptrs, const int32_t *rows, int32_t hkv, int32_t num_pages,
                             float scale, float out_scale, void *stream);
typedef int (*CuteQpkLaunch)(void *const *ptrs, const int32_t *rows, int32_t hkv, int32_t n_token_tiles,
                             int32_t union_cap, int32_t num_ctas, int32_t n_tokens, int32_t topk, int32_t direct,
                             float scale, float out_scale, void *stream);

enum Kind { LAUNCH, SORT, SCAN, LOWER_BOUND, TILE_COUNTS, MEMSET, CUTE_KVO, CUTE_QPK };

struct Step {
  Kind kind;
  int stage;
  // LAUNCH
  void *function = nullptr;
  unsigned grid[3] = {1, 1, 1}, threads = 0, smem = 0;
  std::vector<char> blob;              // the packed arguments
  std::vector<void *> params;          // each argument's address in blob (a moved Step keeps blob's buffer)
  // SORT, SCAN, LOWER_BOUND, TILE_COUNTS, MEMSET
  int key_bytes = 0, end_bit = 0;      // SORT: keys differ only in bits [0, end_bit)
  void *a = nullptr, *b = nullptr, *c = nullptr, *d = nullptr, *temp = nullptr;
  size_t temp_bytes = 0;
  int64_t n = 0, m = 0;
  int32_t tile_q = 0;
  // CUTE_KVO, CUTE_QPK: the library's launch entry point and its arguments
  void *entry = nullptr;
  std::vector<void *> ptrs;
  std::vector<int32_t> rows;
  int32_t ints[7] = {0, 0, 0, 0, 0, 0, 0};
  float scale = 0.f, out_scale = 0.f;
};

// steps grow by moving, and only a move keeps each blob's buffer where its params point
static_assert(std::is_nothrow_move_constructible<Step>::value, "a Step must move, not copy");

const int GRAPH_LAUNCH_FAILED = -2;    // `failed` after msa_prog_run's graph launch failed (program.py reads it)

struct Program {
  std::vector<Step> steps;
  int failed = -1;
  cudaGraphExec_t exec = nullptr;      // the whole program as one graph, once msa_prog_instantiate made it
};

LaunchKernel launch_kernel() {
  static LaunchKernel fn = nullptr;
  if (!fn) {
    void *lib = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
    if (!lib) lib = dlopen("libcuda.so.1", RTLD_LAZY);
    if (lib) fn = (LaunchKernel)dlsym(lib, "cuLaunchKernel");
  }
  return fn;
}

template <typename K>
__global__ void lower_bound_kernel(const K *sorted, int64_t n, int32_t *out, int64_t targets) {
  int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= targets) return;
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    int64_t mid = (lo + hi) / 2;
    if ((int64_t)sorted[mid] < t) lo = mid + 1; else hi = mid;
  }
  out[t] = (int32_t)lo;
}

__global__ void tile_counts_kernel(const int32_t *csr_ptr, int32_t *tiles, int64_t keys, int32_t tile_q) {
  int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (k < keys) tiles[k] = (csr_ptr[k + 1] - csr_ptr[k] + tile_q - 1) / tile_q;
}

template <typename K>
cudaError_t sort_pairs(Step &s, cudaStream_t stream) {
  size_t bytes = s.temp_bytes;
  return cub::DeviceRadixSort::SortPairs(s.temp, bytes, (const K *)s.a, (K *)s.b, (const int64_t *)s.c,
                                         (int64_t *)s.d, s.n, 0, s.end_bit, stream);
}

template <typename K>
size_t sort_bytes(int64_t n, int end_bit) {
  size_t bytes = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, bytes, (const K *)nullptr, (K *)nullptr, (const int64_t *)nullptr,
                                  (int64_t *)nullptr, n, 0, end_bit, (cudaStream_t)0);
  return bytes;
}

unsigned blocks(int64_t n, int threads) { return (unsigned)((n + threads - 1) / threads); }

int run_step(Step &s, cudaStream_t stream) {
  switch (s.kind) {
    case LAUNCH: {
      LaunchKernel fn = launch_kernel();
      if (!fn) return (int)cudaErrorSharedObjectInitFailed;
      if (!s.grid[0] || !s.grid[1] || !s.grid[2]) return 0;      // as Triton's launcher: an empty grid is no launch
      return fn(s.function, s.grid[0], s.grid[1], s.grid[2], s.threads, 1, 1, s.smem, stream, s.params.data(),
                nullptr);
    }
    case SORT:
      if (s.n == 0) return 0;
      return (int)(s.key_bytes == 2 ? sort_pairs<int16_t>(s, stream) : sort_pairs<int32_t>(s, stream));
    case SCAN: {
      if (s.n == 0) return 0;
      size_t bytes = s.temp_bytes;
      return (int)cub::DeviceScan::InclusiveSum(s.temp, bytes, (const int32_t *)s.a, (int32_t *)s.b, s.n, stream);
    }
    case LOWER_BOUND:
      if (s.m > 0) {
        if (s.key_bytes == 2)
          lower_bound_kernel<int16_t><<<blocks(s.m, 256), 256, 0, stream>>>((const int16_t *)s.a, s.n, (int32_t *)s.b, s.m);
        else
          lower_bound_kernel<int32_t><<<blocks(s.m, 256), 256, 0, stream>>>((const int32_t *)s.a, s.n, (int32_t *)s.b, s.m);
      }
      return (int)cudaGetLastError();
    case TILE_COUNTS:
      if (s.n > 0)
        tile_counts_kernel<<<blocks(s.n, 256), 256, 0, stream>>>((const int32_t *)s.a, (int32_t *)s.b, s.n, s.tile_q);
      return (int)cudaGetLastError();
    case MEMSET:
      return (int)cudaMemsetAsync(s.a, 0, (size_t)s.n, stream);
    case CUTE_KVO:
      return ((CuteKvoLaunch)s.entry)(s.ptrs.data(), s.rows.data(), s.ints[0], s.ints[1], s.scale, s.out_scale,
                                      stream);
    case CUTE_QPK:
      return ((CuteQpkLaunch)s.entry)(s.ptrs.data(), s.rows.data(), s.ints[0], s.ints[1], s.ints[2], s.ints[3],
                                      s.ints[4], s.ints[5], s.ints[6], s.scale, s.out_scale, stream);
  }
  return (int)cudaErrorInvalidValue;
}

Step &add(Program *p, Kind kind, int stage) {
  p->steps.emplace_back();
  Step &s = p->steps.back();
  s.kind = kind;
  s.stage = stage;
  return s;
}

}  // namespace

extern "C" {

void *msa_prog_new(void) { return new Program(); }

void msa_prog_free(void *prog) {
  Program *p = (Program *)prog;
  if (p->exec) cudaGraphExecDestroy(p->exec);
  delete p;
}

int msa_prog_size(void *p, int stage) {
  int n = 0;
  for (const Step &s : ((Program *)p)->steps) n += (stage < 0 || s.stage == stage);
  return n;
}

int msa_prog_failed_step(void *p) { return ((Program *)p)->failed; }

size_t msa_sort_temp_bytes(int key_bytes, int64_t n, int end_bit) {
  return key_bytes == 2 ? sort_bytes<int16_t>(n, end_bit) : sort_bytes<int32_t>(n, end_bit);
}

size_t msa_scan_temp_bytes(int64_t n) {
  size_t bytes = 0;
  cub::DeviceScan::InclusiveSum(nullptr, bytes, (const int32_t *)nullptr, (int32_t *)nullptr, n, (cudaStream_t)0);
  return bytes;
}

void msa_prog_launch(void *p, int stage, void *function, unsigned gx, unsigned gy, unsigned gz, unsigned threads,
                     unsigned smem, const void *blob, int32_t blob_bytes, const int32_t *offsets, int32_t nargs) {
  Step &s = add((Program *)p, LAUNCH, stage);
  s.function = function;
  s.grid[0] = gx; s.grid[1] = gy; s.grid[2] = gz;
  s.threads = threads;
  s.smem = smem;
  s.blob.assign((const char *)blob, (const char *)blob + blob_bytes);
  for (int32_t i = 0; i < nargs; ++i) s.params.push_back(s.blob.data() + offsets[i]);
}

void msa_prog_sort(void *p, int stage, int key_bytes, int end_bit, void *keys_in, void *keys_out, void *vals_in,
                   void *vals_out, int64_t n, void *temp, size_t temp_bytes) {
  Step &s = add((Program *)p, SORT, stage);
  s.key_bytes = key_bytes;
  s.end_bit = end_bit;
  s.a = keys_in; s.b = keys_out; s.c = vals_in; s.d = vals_out;
  s.n = n; s.temp = temp; s.temp_bytes = temp_bytes;
}

void msa_prog_scan(void *p, int stage, void *in, void *out, int64_t n, void *temp, size_t temp_bytes) {
  Step &s = add((Program *)p, SCAN, stage);
  s.a = in; s.b = out; s.n = n; s.temp = temp; s.temp_bytes = temp_bytes;
}

void msa_prog_lower_bound(void *p, int stage, int key_bytes, void *sorted, int64_t n, void *out, int64_t targets) {
  Step &s = add((Program *)p, LOWER_BOUND, stage);
  s.key_bytes = key_bytes;
  s.a = sorted; s.n = n; s.b = out; s.m = targets;
}

void msa_prog_tile_counts(void *p, int stage, void *csr_ptr, void *tiles, int64_t keys, int32_t tile_q) {
  Step &s = add((Program *)p, TILE_COUNTS, stage);
  s.a = csr_ptr; s.b = tiles; s.n = keys; s.tile_q = tile_q;
}

void msa_prog_memset(void *p, int stage, void *ptr, int64_t bytes) {
  Step &s = add((Program *)p, MEMSET, stage);
  s.a = ptr; s.n = bytes;
}

void msa_prog_cute(void *p, int stage, int packed_kind, void *entry, void *const *ptrs, const int32_t *rows,
                   int32_t n, const int32_t *ints, int32_t n_ints, float scale, float out_scale) {
  Step &s = add((Program *)p, packed_kind == 0 ? CUTE_KVO : CUTE_QPK, stage);
  s.entry = entry;
  s.ptrs.assign(ptrs, ptrs + n);
  s.rows.assign(rows, rows + n);
  for (int i = 0; i < n_ints && i < 7; ++i) s.ints[i] = ints[i];
  s.scale = scale; s.out_scale = out_scale;
}

static int run_steps(Program *p, int stage, cudaStream_t st) {
  for (size_t i = 0; i < p->steps.size(); ++i) {
    Step &s = p->steps[i];
    if (stage >= 0 && s.stage != stage) continue;
    int err = run_step(s, st);
    if (err) {
      p->failed = (int)i;
      return err;
    }
  }
  return 0;
}

int msa_prog_run(void *prog, int stage, void *stream) {
  Program *p = (Program *)prog;
  cudaStream_t st = (cudaStream_t)stream;
  if (stage < 0 && p->exec) {
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    cudaError_t err = cudaStreamIsCapturing(st, &capturing);
    if (err) return (int)err;
    if (capturing == cudaStreamCaptureStatusNone) {
      err = cudaGraphLaunch(p->exec, st);
      if (err) p->failed = GRAPH_LAUNCH_FAILED;
      return (int)err;
    }
  }
  return run_steps(p, stage, st);
}

// Run every step once (each kernel's module is loaded before capture), then capture them on a stream of
// their own (thread-local mode: other threads' CUDA calls are not refused meanwhile) and instantiate the
// graph; the steps stay, to run a stage alone or under capture.
int msa_prog_instantiate(void *prog) {
  Program *p = (Program *)prog;
  if (p->exec) return 0;
  cudaStream_t st = nullptr;
  cudaError_t err = cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
  if (err) return (int)err;
  int warm = run_steps(p, -1, st);
  if (warm) {
    cudaStreamDestroy(st);
    return warm;
  }
  err = cudaStreamSynchronize(st);
  if (!err) err = cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal);
  int step_err = err ? 0 : run_steps(p, -1, st);
  cudaGraph_t graph = nullptr;
  if (!err) {
    cudaError_t end = cudaStreamEndCapture(st, &graph);
    err = step_err ? (cudaError_t)step_err : end;
  }
  if (!err) err = cudaGraphInstantiate(&p->exec, graph, 0);
  if (graph) cudaGraphDestroy(graph);
  cudaStreamDestroy(st);
  if (err) p->exec = nullptr;
  return (int)err;
}

}  // extern "C"
