// Matmuls of any number of rows that read each weight once, for XLA:CPU through the XLA FFI.
//
// A verification block of T tokens multiplies T rows by every weight matrix of the target. At one
// row XLA emits a matrix-vector loop that streams each weight once; at 2..8 rows it calls a
// library GEMM that takes about twice as long for the same weights (docs/architecture.md,
// "Streamed block matmuls"). Here each weight is packed in panels of 32 columns, each panel one
// sequential stream, the rows' sums in registers for the whole panel: a block of rows costs about
// what one row does. Built by specjax/models/block_matmul.py with the host's g++.
//
//   Panels:      out[M, N] = x[M, K] @ w[K, N]   float32 rows and weights (the target's projections
//                                                 and LM head, a tied one as its own copy)
//   PanelsBf16:  out[M, N] = x[M, K] @ w[K, N]   float32 rows, bfloat16 weights widened exactly as they
//                                                 stream, float32 sums (a draft head's weights as trained)
//   w arrives packed: panels [ceil(N / 32), K, 32].

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

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

// A weight w [K, N] is packed as panels [P, K, 32] (`block_matmul.pack`: P = ceil(N / 32), zero
// columns past N): panel p holds columns 32p..32p + 31, each of its K rows 32 contiguous weights,
// so a panel is one sequential stream and the sums of its columns stay in registers for all of K.
constexpr int64_t kPanel = 32;
#ifdef __AVX512F__
constexpr int kGroup = 8, kVectors = 4;  // rows a pass, vectors of sums per row: 32 of AVX-512's 32 registers
#else
constexpr int kGroup = 4, kVectors = 2;  // 8 of AVX2's 16 registers (a panel in two passes, the second from cache)
#endif

// out[M, c:c + 8T] = x[M, K] @ panel[K, o:o + 8T] with c = column of the panel's first weight + o;
// columns at or past N are not stored. Each sum adds k = 0..K-1 in order, whatever M: a row's
// result is the same bits alone or in a block.
template <int M, int T, typename W>
inline void panel_pass(const float* x, const W* panel, float* out, int64_t K, int64_t N, int64_t column, int o) {
  v8 acc[M][T] = {};
  for (int64_t k = 0; k < K; ++k) {
    v8 row[T];
    for (int t = 0; t < T; ++t) row[t] = load8(panel + k * kPanel + o + 8 * t);
    for (int m = 0; m < M; ++m) {
      const v8 s = splat8(x[m * K + k]);
      for (int t = 0; t < T; ++t) acc[m][t] += row[t] * s;
    }
  }
  for (int m = 0; m < M; ++m)
    for (int t = 0; t < T; ++t) {
      const int64_t first = column + o + 8 * t;
      if (first + 8 <= N) {
        store8(out + m * N + first, acc[m][t]);
      } else {
        for (int64_t lane = 0; first + lane < N; ++lane) out[m * N + first + lane] = acc[m][t][lane];
      }
    }
}

// out[:, 32p:32p + 32] for panels p in [p_begin, p_end): kGroup rows a pass over a panel (the
// first pass streams it from memory, the others read it from cache), kVectors vectors of sums.
template <int M, typename W>
void group_panels(const float* x, const W* panels, float* out, int64_t K, int64_t N, int64_t p_begin, int64_t p_end) {
  for (int64_t p = p_begin; p < p_end; ++p)
    for (int o = 0; o < kPanel; o += 8 * kVectors) panel_pass<M, kVectors>(x, panels + p * K * kPanel, out, K, N, p * kPanel, o);
}

// How many parts to split P panels into: one per thread of XLA's pool, fewer where the weights
// are too few to be worth waking a thread for.
int64_t num_parts(ffi::ThreadPool& pool, int64_t panels, int64_t weights) {
  constexpr int64_t kMinWeightsPerPart = 1 << 15;  // below 32k weights, waking a thread costs more than it saves
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  return std::clamp<int64_t>(weights / kMinWeightsPerPart, 1, std::min(threads, panels));
}

// Splits [0, extent) into `parts` (from num_parts) and runs `part(begin, end)` on each: one in the
// calling thread, the others as tasks of XLA's own thread pool. Whoever is free takes the next
// part, so a pool that runs nothing (or runs tasks in the caller) still finishes; the caller waits
// only for parts already taken. State lives on the heap: a task may start after the call returned.
template <typename Part>
void in_parts(ffi::ThreadPool& pool, int64_t extent, int64_t parts, Part part) {
  if (parts == 1) return part(0, extent);
  struct Shared {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto shared = std::make_shared<Shared>();
  auto work = [shared, part, parts, extent] {
    for (int64_t i; (i = shared->next.fetch_add(1)) < parts;) {
      part(extent * i / parts, extent * (i + 1) / parts);
      shared->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 1; t < parts; ++t) pool.Schedule(decltype(work)(work));  // a copy per task
  work();
  while (shared->done.load(std::memory_order_acquire) < parts) std::this_thread::yield();
}

// out[M, N] = x[M, K] @ w for packed weights of type W: parts split the panels (disjoint columns of
// `out`), each taking its panels kGroup rows of x at a time.
template <typename W>
void panels_in_parts(ffi::ThreadPool& pool, const float* x, const W* panels, float* out, int64_t M, int64_t K, int64_t N) {
  const int64_t P = (N + kPanel - 1) / kPanel;
  in_parts(pool, P, num_parts(pool, P, K * N), [=](int64_t begin, int64_t end) {
    for (int64_t m = 0; m < M; m += kGroup) {
      const float* rows = x + m * K;
      float* sums = out + m * N;
      switch (std::min<int64_t>(kGroup, M - m)) {
        case 1: group_panels<1>(rows, panels, sums, K, N, begin, end); break;
        case 2: group_panels<2>(rows, panels, sums, K, N, begin, end); break;
        case 3: group_panels<3>(rows, panels, sums, K, N, begin, end); break;
        case 4: group_panels<4>(rows, panels, sums, K, N, begin, end); break;
        case 5: group_panels<5>(rows, panels, sums, K, N, begin, end); break;
        case 6: group_panels<6>(rows, panels, sums, K, N, begin, end); break;
        case 7: group_panels<7>(rows, panels, sums, K, N, begin, end); break;
        case 8: group_panels<8>(rows, panels, sums, K, N, begin, end); break;
      }
    }
  });
}
// The handlers' body: x [M, K] @ panels [P, K, 32] -> out [M, N], N <= 32 P (the result's width).
template <ffi::DataType WeightType>
ffi::Error checked_panels(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::Buffer<WeightType>& panels, ffi::ResultBuffer<ffi::F32>& out) {
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], N = out->dimensions()[1];
  const auto shape = panels.dimensions();
  if (shape.size() != 3 || shape[1] != K || shape[2] != kPanel || shape[0] != (N + kPanel - 1) / kPanel)
    return ffi::Error::InvalidArgument("x [M, K] @ panels [ceil(N / 32), K, 32] -> out [M, N]: the shapes disagree");
  panels_in_parts(pool, x.typed_data(), panels.typed_data(), out->typed_data(), M, K, N);
  return ffi::Error::Success();
}

ffi::Error PanelsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> out) {
  return checked_panels(pool, x, w, out);
}

ffi::Error PanelsBf16Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w, ffi::ResultBuffer<ffi::F32> out) {
  return checked_panels(pool, x, w, out);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxPanels, PanelsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxPanelsBf16, PanelsBf16Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
