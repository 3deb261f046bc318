// Matmuls of a few rows (2..8) that read each weight once, for XLA:CPU through the XLA FFI.
//
// A verification block of T tokens multiplies T rows by every weight matrix of the target. At one
// row XLA emits a matrix-vector loop that streams each weight once; at 2..8 rows it calls a
// library GEMM that takes about twice as long for the same weights (docs/architecture.md,
// "Streamed block matmuls"). Both kernels here keep the rows' partial sums in L1 and walk the
// weights in memory order, once. Built by specjax/models/block_matmul.py with the host's g++.
//
//   Rows:   out[M, N] = x[M, K] @ w[K, N]       (projections; an untied LM head)
//   RowDot: out[M, V] = x[M, H] @ e[V, H]^T     (a tied LM head: the embedding's rows)

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v8 __attribute__((vector_size(32)));  // 8 floats: AVX2's ymm, two NEON registers elsewhere

inline v8 load8(const float* p) { v8 v; std::memcpy(&v, p, sizeof v); return v; }
inline void store8(float* p, v8 v) { std::memcpy(p, &v, sizeof v); }
inline v8 splat8(float s) { return v8{s, s, s, s, s, s, s, s}; }

// out[M, n0:n1] = x[M, K] @ w[K, n0:n1]. Columns in blocks of kBlock (M x kBlock partial sums stay
// in L1); within a block, two weight rows per pass, each read in order.
template <int M>
void rows(const float* x, const float* w, float* out, int64_t K, int64_t N, int64_t n_begin, int64_t n_end) {
  constexpr int64_t kBlock = 512;
  for (int m = 0; m < M; ++m) std::memset(out + m * N + n_begin, 0, sizeof(float) * (n_end - n_begin));
  for (int64_t n0 = n_begin; n0 < n_end; n0 += kBlock) {
    const int64_t width = std::min(kBlock, n_end - n0);
    const int64_t vector_end = width - width % 8;
    int64_t k = 0;
    for (; k + 2 <= K; k += 2) {
      const float* w0 = w + k * N + n0;  // weight rows k and k + 1 of this block
      const float* w1 = w0 + N;
      v8 x0[M], x1[M];
      for (int m = 0; m < M; ++m) x0[m] = splat8(x[m * K + k]), x1[m] = splat8(x[m * K + k + 1]);
      for (int64_t n = 0; n < vector_end; n += 8) {
        const v8 a = load8(w0 + n), b = load8(w1 + n);
        for (int m = 0; m < M; ++m) {
          float* o = out + m * N + n0 + n;
          store8(o, load8(o) + a * x0[m] + b * x1[m]);
        }
      }
      for (int64_t n = vector_end; n < width; ++n)
        for (int m = 0; m < M; ++m) out[m * N + n0 + n] += w0[n] * x[m * K + k] + w1[n] * x[m * K + k + 1];
    }
    for (; k < K; ++k)
      for (int64_t n = 0; n < width; ++n)
        for (int m = 0; m < M; ++m) out[m * N + n0 + n] += x[m * K + k] * w[k * N + n0 + n];
  }
}

// out[M, v] = x[M, H] . e[v, H] for v in [v_begin, v_end): each embedding row read once against all M rows.
template <int M>
void row_dots(const float* x, const float* e, float* out, int64_t H, int64_t V, int64_t v_begin, int64_t v_end) {
  const int64_t vector_end = H - H % 8;
  for (int64_t v = v_begin; v < v_end; ++v) {
    const float* row = e + v * H;
    v8 acc[M] = {};
    for (int64_t h = 0; h < vector_end; h += 8) {
      const v8 a = load8(row + h);
      for (int m = 0; m < M; ++m) acc[m] += a * load8(x + m * H + h);
    }
    for (int m = 0; m < M; ++m) {
      float sum = 0;
      for (int lane = 0; lane < 8; ++lane) sum += acc[m][lane];
      for (int64_t h = vector_end; h < H; ++h) sum += row[h] * x[m * H + h];
      out[m * V + v] = sum;
    }
  }
}

// Splits [0, extent) into parts of whole 8-lane groups and runs `part(begin, end)` on each: one in
// the calling thread, the others as tasks of XLA's own thread pool. Whoever is free takes the next
// part, so a pool that runs nothing (or runs tasks in the caller) still finishes; the caller waits
// only for parts already taken. State lives on the heap: a task may start after the call returned.
template <typename Part>
void in_parts(ffi::ThreadPool& pool, int64_t extent, int64_t weights, Part part) {
  constexpr int64_t kMinWeightsPerPart = 1 << 16;  // below 256 KB of weights, waking a thread costs more than it saves
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t most = std::max<int64_t>(1, std::min(threads, extent / 8));
  const int64_t parts = std::clamp<int64_t>(weights / kMinWeightsPerPart, 1, most);
  if (parts == 1) return part(0, extent);
  struct Shared {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto shared = std::make_shared<Shared>();
  const int64_t groups = extent / 8;  // >= parts: every part gets at least one group
  auto work = [shared, part, parts, groups, extent] {
    for (int64_t i; (i = shared->next.fetch_add(1)) < parts;) {
      part(groups * i / parts * 8, i + 1 == parts ? extent : groups * (i + 1) / parts * 8);  // the last part takes the tail
      shared->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 1; t < parts; ++t) pool.Schedule(decltype(work)(work));  // a copy per task
  work();
  while (shared->done.load(std::memory_order_acquire) < parts) std::this_thread::yield();
}

#define SPECJAX_FOR_ROWS(KERNEL, ...)                                                   \
  switch (num_rows) {                                                                   \
    case 2: KERNEL<2>(__VA_ARGS__); break;                                              \
    case 3: KERNEL<3>(__VA_ARGS__); break;                                              \
    case 4: KERNEL<4>(__VA_ARGS__); break;                                              \
    case 5: KERNEL<5>(__VA_ARGS__); break;                                              \
    case 6: KERNEL<6>(__VA_ARGS__); break;                                              \
    case 7: KERNEL<7>(__VA_ARGS__); break;                                              \
    case 8: KERNEL<8>(__VA_ARGS__); break;                                              \
  }

ffi::Error RowsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> out) {
  const int64_t num_rows = x.dimensions()[0], K = x.dimensions()[1], N = w.dimensions()[1];
  if (num_rows < 2 || num_rows > 8) return ffi::Error::InvalidArgument("streamed block matmuls take 2..8 rows");
  if (w.dimensions()[0] != K) return ffi::Error::InvalidArgument("x [M, K] @ w [K, N]: K differs");
  const float *xp = x.typed_data(), *wp = w.typed_data();
  float* op = out->typed_data();
  in_parts(pool, N, K * N, [=](int64_t begin, int64_t end) { SPECJAX_FOR_ROWS(rows, xp, wp, op, K, N, begin, end) });
  return ffi::Error::Success();
}

ffi::Error RowDotImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> e, ffi::ResultBuffer<ffi::F32> out) {
  const int64_t num_rows = x.dimensions()[0], H = x.dimensions()[1], V = e.dimensions()[0];
  if (num_rows < 2 || num_rows > 8) return ffi::Error::InvalidArgument("streamed block matmuls take 2..8 rows");
  if (e.dimensions()[1] != H) return ffi::Error::InvalidArgument("x [M, H] @ e [V, H]^T: H differs");
  const float *xp = x.typed_data(), *ep = e.typed_data();
  float* op = out->typed_data();
  in_parts(pool, V, V * H, [=](int64_t begin, int64_t end) { SPECJAX_FOR_ROWS(row_dots, xp, ep, op, H, V, begin, end) });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxRows, RowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxRowDot, RowDotImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
