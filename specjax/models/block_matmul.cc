// Matmuls of a few rows (1..8) that read each weight once, for XLA:CPU through the XLA FFI.
//
// A verification block of T tokens multiplies T rows by every weight matrix of the target. At one
// row XLA emits a matrix-vector loop that streams each weight once; at 2..8 rows it calls a
// library GEMM that takes about twice as long for the same weights (docs/architecture.md,
// "Streamed block matmuls"). The kernels here read each weight once, in a few sequential
// streams, with the rows' sums in registers. Built by specjax/models/block_matmul.py with the host's g++.
//
//   Rows:       out[M, N] = x[M, K] @ w[K, N]     float32, M = 2..8 (projections; the LM head, a tied
//                                                  one as its own [H, V] copy)
//   RowsBf16:   out[M, N] = x[M, K] @ w[K, N]     float32 rows, bfloat16 weights widened exactly as they
//                                                  stream, float32 sums, M = 1..8 (a draft head's weights
//                                                  as trained: half the bytes of float32)

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v8 __attribute__((vector_size(32)));  // 8 floats: AVX2's ymm, two NEON registers elsewhere

inline v8 load8(const float* p) { v8 v; std::memcpy(&v, p, sizeof v); return v; }
inline void store8(float* p, v8 v) { std::memcpy(p, &v, sizeof v); }
inline v8 splat8(float s) { return v8{s, s, s, s, s, s, s, s}; }

// bfloat16 is the upper half of a float32: widening is a 16-bit shift, exact.
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
inline v8 load8(const uint16_t* p) {
  u16x8 half;
  std::memcpy(&half, p, sizeof half);
  const u32x8 wide = __builtin_convertvector(half, u32x8) << 16;
  v8 v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
}
inline float widen(float w) { return w; }
inline float widen(uint16_t w) {
  const uint32_t bits = uint32_t{w} << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// out[M, n:n + 8T] += x[M, k0:k1] @ w[k0:k1, n:n + 8T]: M x T vectors of sums in registers while
// the chunk's weight rows stream past, then one load and store of `out` per vector.
template <int M, int T, typename W>
inline void tile(const float* x, const W* w, float* out, int64_t K, int64_t N, int64_t n, int64_t k0, int64_t k1) {
  v8 acc[M][T] = {};
  for (int64_t k = k0; k < k1; ++k) {
    v8 row[T];
    for (int t = 0; t < T; ++t) row[t] = load8(w + k * N + n + 8 * t);
    for (int m = 0; m < M; ++m) {
      const v8 s = splat8(x[m * K + k]);
      for (int t = 0; t < T; ++t) acc[m][t] += row[t] * s;
    }
  }
  for (int m = 0; m < M; ++m)
    for (int t = 0; t < T; ++t) store8(out + m * N + n + 8 * t, load8(out + m * N + n + 8 * t) + acc[m][t]);
}

// out[M, N] = x[M, k_begin:k_end] @ w[k_begin:k_end, N]: the weight rows in chunks (8 or more), each
// chunk (contiguous in memory) read as that many sequential streams by register tiles of 8T columns
// (M x T vectors of sums), then single vectors, then the last columns one by one.
template <int M, typename W>
void rows(const float* x, const W* w, float* out, int64_t K, int64_t N, int64_t k_begin, int64_t k_end) {
  const int64_t chunk = std::clamp<int64_t>(8192 / N, 8, 64);  // narrow weights: more rows per chunk, fewer stores of sums
  constexpr int T = M <= 3 ? 4 : std::max(1, 12 / M);  // about 12 of AVX2's 16 registers hold sums
  const int64_t tiles_end = N / (8 * T) * (8 * T), vectors_end = N / 8 * 8;
  std::memset(out, 0, sizeof(float) * M * N);
  for (int64_t k0 = k_begin; k0 < k_end; k0 += chunk) {
    const int64_t k1 = std::min(k_end, k0 + chunk);
    int64_t n = 0;
    for (; n < tiles_end; n += 8 * T) tile<M, T>(x, w, out, K, N, n, k0, k1);
    for (; n < vectors_end; n += 8) tile<M, 1>(x, w, out, K, N, n, k0, k1);
    for (; n < N; ++n)
      for (int64_t k = k0; k < k1; ++k)
        for (int m = 0; m < M; ++m) out[m * N + n] += x[m * K + k] * widen(w[k * N + n]);
  }
}

// How many parts of whole 8-lane groups to split [0, extent) into: one per thread of XLA's pool,
// fewer where the weights are too few to be worth waking a thread for.
int64_t num_parts(ffi::ThreadPool& pool, int64_t extent, int64_t weights) {
  constexpr int64_t kMinWeightsPerPart = 1 << 15;  // below 128 KB of weights, waking a thread costs more than it saves
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t most = std::max<int64_t>(1, std::min(threads, extent / 8));
  return std::clamp<int64_t>(weights / kMinWeightsPerPart, 1, most);
}

// Splits [0, extent) into `parts` (from num_parts) and runs `part(index, begin, end)` on each: one
// in the calling thread, the others as tasks of XLA's own thread pool. Whoever is free takes the
// next part, so a pool that runs nothing (or runs tasks in the caller) still finishes; the caller
// waits only for parts already taken. State lives on the heap: a task may start after the call returned.
template <typename Part>
void in_parts(ffi::ThreadPool& pool, int64_t extent, int64_t parts, Part part) {
  if (parts == 1) return part(0, 0, extent);
  struct Shared {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto shared = std::make_shared<Shared>();
  const int64_t groups = extent / 8;  // >= parts: every part gets at least one group
  auto work = [shared, part, parts, groups, extent] {
    for (int64_t i; (i = shared->next.fetch_add(1)) < parts;) {
      part(i, groups * i / parts * 8, i + 1 == parts ? extent : groups * (i + 1) / parts * 8);  // the last part takes the tail
      shared->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 1; t < parts; ++t) pool.Schedule(decltype(work)(work));  // a copy per task
  work();
  while (shared->done.load(std::memory_order_acquire) < parts) std::this_thread::yield();
}

#define SPECJAX_FOR_ROWS(KERNEL, ...)                                                   \
  switch (num_rows) {                                                                   \
    case 1: KERNEL<1>(__VA_ARGS__); break;                                              \
    case 2: KERNEL<2>(__VA_ARGS__); break;                                              \
    case 3: KERNEL<3>(__VA_ARGS__); break;                                              \
    case 4: KERNEL<4>(__VA_ARGS__); break;                                              \
    case 5: KERNEL<5>(__VA_ARGS__); break;                                              \
    case 6: KERNEL<6>(__VA_ARGS__); break;                                              \
    case 7: KERNEL<7>(__VA_ARGS__); break;                                              \
    case 8: KERNEL<8>(__VA_ARGS__); break;                                              \
  }

// out[M, N] = x @ w for weights of type W: parts split the weight rows, each streaming one
// contiguous slab into its own sums (part 0 into `out`, the others into scratch), added up once all are done.
template <typename W>
void rows_in_parts(ffi::ThreadPool& pool, const float* xp, const W* wp, float* op, int64_t num_rows, int64_t K, int64_t N) {
  const int64_t size = num_rows * N, parts = num_parts(pool, K, K * N);
  auto scratch = std::make_shared<std::vector<float>>((parts - 1) * size);
  in_parts(pool, K, parts, [=](int64_t i, int64_t begin, int64_t end) {
    float* sums = i == 0 ? op : scratch->data() + (i - 1) * size;
    SPECJAX_FOR_ROWS(rows, xp, wp, sums, K, N, begin, end)
  });
  for (int64_t i = 1; i < parts; ++i)
    for (int64_t j = 0; j < size; ++j) op[j] += (*scratch)[(i - 1) * size + j];
}

// The handlers' body: x [M, K] @ w [K, N] -> out [M, N] for M in min_rows..8.
template <ffi::DataType WeightType>
ffi::Error checked_rows(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::Buffer<WeightType>& w, ffi::ResultBuffer<ffi::F32>& out,
                        int64_t min_rows) {
  const int64_t num_rows = x.dimensions()[0], K = x.dimensions()[1], N = w.dimensions()[1];
  if (num_rows < min_rows || num_rows > 8)
    return ffi::Error::InvalidArgument("these streamed matmuls take " + std::to_string(min_rows) + "..8 rows");
  if (w.dimensions()[0] != K) return ffi::Error::InvalidArgument("x [M, K] @ w [K, N]: K differs");
  rows_in_parts(pool, x.typed_data(), w.typed_data(), out->typed_data(), num_rows, K, N);
  return ffi::Error::Success();
}

ffi::Error RowsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> out) {
  return checked_rows(pool, x, w, out, 2);  // one row: XLA's matrix-vector loop is as fast
}

ffi::Error RowsBf16Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w, ffi::ResultBuffer<ffi::F32> out) {
  return checked_rows(pool, x, w, out, 1);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxRows, RowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxRowsBf16, RowsBf16Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
