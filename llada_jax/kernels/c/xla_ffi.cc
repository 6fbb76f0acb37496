// The kernels as an XLA FFI custom call on CPU (`llada_jax.kernels.xla`): activations prepared once per call,
// then the weight rows split in chunks over XLA's intra-op thread pool.
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

extern "C" {
#include "kernels.h"
}

namespace ffi = xla::ffi;

namespace {

enum Scheme : int64_t { kW4A8 = 0, kW8A8 = 1, kW4A16 = 2 };
using Matrix = ffi::Buffer<ffi::F32, 2>;
using Bytes = ffi::Buffer<ffi::U8, 2>;

// Runs work(begin, end) over [0, rows) in chunks on the pool and the calling thread. The caller waits only
// for chunks already taken, never for a task to start: a busy pool cannot deadlock it.
void ParallelRows(ffi::ThreadPool& pool, int64_t rows, const std::function<void(int64_t, int64_t)>& work) {
  struct Shared {
    std::atomic<int64_t> next{0}, done{0};
    int64_t chunk = 0, chunks = 0;
    const std::function<void(int64_t, int64_t)>* work = nullptr;
  };
  auto shared = std::make_shared<Shared>();
  int64_t threads = pool.num_threads() > 0 ? pool.num_threads() : 1;
  shared->chunk = ((rows + 8 * threads - 1) / (8 * threads) + 3) / 4 * 4;  // ~8 chunks a thread, whole tiles
  shared->chunks = (rows + shared->chunk - 1) / shared->chunk;
  shared->work = &work;
  auto run = [shared, rows] {
    for (int64_t i; (i = shared->next.fetch_add(1)) < shared->chunks;) {
      int64_t begin = i * shared->chunk, end = begin + shared->chunk < rows ? begin + shared->chunk : rows;
      (*shared->work)(begin, end);
      shared->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 1; t < threads && t < shared->chunks; t++) pool.Schedule([run] { run(); });
  run();
  while (shared->done.load(std::memory_order_acquire) < shared->chunks) std::this_thread::yield();
}

ffi::Error QuantizedMatmul(ffi::ThreadPool pool, Matrix x, Bytes weights, ffi::AnyBuffer scales,
                           ffi::Result<Matrix> out, int64_t scheme,
                           int64_t group, bool signed8) {
  const int64_t positions = x.dimensions()[0], columns = x.dimensions()[1], rows = weights.dimensions()[0];
  const int bits = scheme == kW8A8 ? 8 : 4;
  if (scales.element_type() != ffi::F32 && scales.element_type() != ffi::BF16)
    return ffi::Error::InvalidArgument("llada kernels: scales must be float32 or bfloat16");
  if (columns % LLK_BLOCK || group % LLK_BLOCK || columns % group || weights.dimensions()[1] * 8 != columns * bits ||
      scales.dimensions().size() != 2 || scales.dimensions()[0] != rows || scales.dimensions()[1] * group != columns)
    return ffi::Error::InvalidArgument("llada kernels: shapes do not match the quantized layout");
  llk_weights w = {weights.typed_data(), scales.untyped_data(), rows, columns, group,
                   scales.element_type() == ffi::BF16, signed8};
  float* result = out->typed_data();
  if (scheme == kW4A16) {
    std::vector<float> ordered(positions * columns);
    llk_order_activations(x.typed_data(), positions, columns, ordered.data());
    ParallelRows(pool, rows, [&](int64_t b, int64_t e) { llk_w4a16(&w, ordered.data(), positions, result, b, e); });
    return ffi::Error::Success();
  }
  int64_t blocks = positions * columns / LLK_BLOCK;
  std::vector<int8_t> values(positions * columns);
  std::vector<float> block_scales(blocks);
  std::vector<int32_t> sums(blocks);
  llk_quantize_activations(x.typed_data(), positions, columns, bits == 4, values.data(), block_scales.data(),
                           sums.data());
  llk_int8_activations a = {values.data(), block_scales.data(), sums.data(), positions};
  auto kernel = bits == 4 ? llk_w4a8 : llk_w8a8;
  ParallelRows(pool, rows, [&](int64_t b, int64_t e) { kernel(&w, &a, result, b, e); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LladaQuantizedMatmul, QuantizedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<Bytes>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<Matrix>()
                                  .Attr<int64_t>("scheme")
                                  .Attr<int64_t>("group")
                                  .Attr<bool>("signed8"));

extern "C" const char* LladaKernelsIsa() { return llk_isa(); }
