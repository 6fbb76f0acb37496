// The kernels as XLA FFI custom calls on CPU (`llada_jax.kernels.xla`): the activations' preparation
// (`activations.c`, its blocks split over XLA's intra-op thread pool) and the matmuls (their weight rows split).
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

extern "C" {
#include "kernels.h"
}

namespace ffi = xla::ffi;

namespace {

using Matrix = ffi::Buffer<ffi::F32, 2>;
using Blocks = ffi::Buffer<ffi::F32, 3>;  // float activations, block-major [I/32, R, 32]
using Bytes = ffi::Buffer<ffi::S8, 2>;  // the weights' bytes as stored
using Int8s = ffi::Buffer<ffi::S8, 3>;  // int8 activations, block-major [I/32, R, 32]
using Int32s = ffi::Buffer<ffi::S32, 2>;  // the int8 activations' block sums, [I/32, R] like their scales
using Stack = ffi::Buffer<ffi::S8, 3>;  // a sparse MoE's experts' bytes, stacked
using Starts = ffi::Buffer<ffi::S32, 1>;  // expert e's rows: [starts[e], starts[e + 1])

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
  shared->chunk = ((rows + 8 * threads - 1) / (8 * threads) + 15) / 16 * 16;  // ~8 chunks a thread, whole lanes
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

llk_weights Weights(Bytes& weights, ffi::AnyBuffer& scales, int64_t columns, int64_t group, bool signed8) {
  return {reinterpret_cast<const uint8_t*>(weights.typed_data()), scales.untyped_data(), weights.dimensions()[0],
          columns, group, scales.element_type() == ffi::BF16, signed8};
}

// Shapes as `c/kernels.h` needs them (the Python side builds them so; a mismatch is a bug, not user input).
ffi::Error Check(int64_t columns, int64_t bits, int64_t group, Bytes& weights, ffi::AnyBuffer& scales) {
  auto rows = weights.dimensions()[0];
  if (scales.element_type() != ffi::F32 && scales.element_type() != ffi::BF16)
    return ffi::Error::InvalidArgument("llada kernels: scales must be float32 or bfloat16");
  if (columns % LLK_BLOCK || group % LLK_BLOCK || columns % group || weights.dimensions()[1] * 8 != columns * bits ||
      scales.dimensions().size() != 2 || scales.dimensions()[0] != rows || scales.dimensions()[1] * group != columns)
    return ffi::Error::InvalidArgument("llada kernels: shapes do not match the quantized layout");
  return ffi::Error::Success();
}

// The float32 activations `x` as `c/kernels.h` describes them: [R, I], or [I, R] when `feature_major`.
llk_float_input Input(Matrix& x, bool feature_major, bool nibbles) {
  auto d = x.dimensions();
  return {x.typed_data(), feature_major ? d[1] : d[0], feature_major ? d[0] : d[1], feature_major, nibbles};
}

// Blocks [I/32, R, ...] of the activations `in`, as the preparation writes them.
ffi::Error CheckBlocks(const llk_float_input& in, ffi::Span<const int64_t> blocks) {
  if (in.columns % LLK_BLOCK || blocks[0] * LLK_BLOCK != in.columns || blocks[1] != in.positions)
    return ffi::Error::InvalidArgument("llada kernels: activations do not match their blocks");
  return ffi::Error::Success();
}

ffi::Error Int8Activations(ffi::ThreadPool pool, Matrix x, ffi::Result<Int8s> values, ffi::Result<Matrix> scales,
                           ffi::Result<Int32s> sums, bool feature_major, bool nibbles) {
  llk_float_input in = Input(x, feature_major, nibbles);
  if (auto error = CheckBlocks(in, values->dimensions()); error.failure()) return error;
  int8_t* q = values->typed_data();
  float* d = scales->typed_data();
  int32_t* s = sums->typed_data();
  ParallelRows(pool, in.columns / LLK_BLOCK, [&](int64_t b, int64_t e) { llk_int8_blocks(&in, q, d, s, b, e); });
  return ffi::Error::Success();
}

ffi::Error FloatActivations(ffi::ThreadPool pool, Matrix x, ffi::Result<Blocks> blocks, bool feature_major) {
  llk_float_input in = Input(x, feature_major, true);
  if (auto error = CheckBlocks(in, blocks->dimensions()); error.failure()) return error;
  float* out = blocks->typed_data();
  ParallelRows(pool, in.columns / LLK_BLOCK, [&](int64_t b, int64_t e) { llk_float_blocks(&in, out, b, e); });
  return ffi::Error::Success();
}

ffi::Error Int8Matmul(ffi::ThreadPool pool, Int8s values, Matrix block_scales, Int32s sums, Bytes weights,
                      ffi::AnyBuffer scales, ffi::Result<Matrix> out, int64_t bits, int64_t group, bool signed8) {
  const int64_t positions = values.dimensions()[1], columns = values.dimensions()[0] * LLK_BLOCK;
  if (auto error = Check(columns, bits, group, weights, scales); error.failure()) return error;
  llk_weights w = Weights(weights, scales, columns, group, signed8);
  llk_int8_activations a = {values.typed_data(), block_scales.typed_data(), sums.typed_data(), positions, positions};
  auto kernel = bits == 4 ? llk_w4a8 : llk_w8a8;
  float* result = out->typed_data();
  ParallelRows(pool, w.rows, [&](int64_t b, int64_t e) { kernel(&w, &a, result, b, e); });
  return ffi::Error::Success();
}

ffi::Error FloatMatmul(ffi::ThreadPool pool, Blocks ordered, Bytes weights, ffi::AnyBuffer scales,
                       ffi::Result<Matrix> out, int64_t group) {
  const int64_t positions = ordered.dimensions()[1], columns = ordered.dimensions()[0] * LLK_BLOCK;
  if (auto error = Check(columns, 4, group, weights, scales); error.failure()) return error;
  llk_weights w = Weights(weights, scales, columns, group, false);
  float* result = out->typed_data();
  const float* x = ordered.typed_data();
  ParallelRows(pool, w.rows, [&](int64_t b, int64_t e) { llk_w4a16(&w, x, positions, positions, result, b, e); });
  return ffi::Error::Success();
}

// Expert 0's matrix of a stack, as `c/kernels.h`'s routed kernels take it.
llk_weights StackWeights(Stack& stack, ffi::AnyBuffer& scales, int64_t columns, int64_t group) {
  return {reinterpret_cast<const uint8_t*>(stack.typed_data()), scales.untyped_data(), stack.dimensions()[1],
          columns, group, scales.element_type() == ffi::BF16, false};
}

ffi::Error CheckStack(int64_t columns, int64_t bits, int64_t group, Stack& stack, ffi::AnyBuffer& scales,
                      Starts& starts, int64_t positions) {
  auto experts = stack.dimensions()[0], rows = stack.dimensions()[1];
  if (scales.element_type() != ffi::F32 && scales.element_type() != ffi::BF16)
    return ffi::Error::InvalidArgument("llada kernels: scales must be float32 or bfloat16");
  if (columns % LLK_BLOCK || group % LLK_BLOCK || columns % group || stack.dimensions()[2] * 8 != columns * bits ||
      scales.dimensions().size() != 3 || scales.dimensions()[0] != experts || scales.dimensions()[1] != rows ||
      scales.dimensions()[2] * group != columns || starts.dimensions()[0] != experts + 1)
    return ffi::Error::InvalidArgument("llada kernels: shapes do not match the stacked quantized layout");
  const int32_t* s = starts.typed_data();
  for (int64_t e = 0; e < experts; e++)
    if (s[e] < 0 || s[e] > s[e + 1] || s[e + 1] > positions)
      return ffi::Error::InvalidArgument("llada kernels: expert row starts must rise within the rows");
  return ffi::Error::Success();
}

ffi::Error RoutedInt8Matmul(ffi::ThreadPool pool, Int8s values, Matrix block_scales, Int32s sums, Stack stack,
                            ffi::AnyBuffer scales, Starts starts, ffi::Result<Matrix> out, int64_t bits,
                            int64_t group) {
  const int64_t positions = values.dimensions()[1], columns = values.dimensions()[0] * LLK_BLOCK;
  if (auto error = CheckStack(columns, bits, group, stack, scales, starts, positions); error.failure()) return error;
  llk_weights w = StackWeights(stack, scales, columns, group);
  llk_int8_activations a = {values.typed_data(), block_scales.typed_data(), sums.typed_data(), positions, positions};
  const int32_t* s = starts.typed_data();
  int64_t experts = stack.dimensions()[0];
  float* result = out->typed_data();
  ParallelRows(pool, w.rows, [&](int64_t b, int64_t e) { llk_routed_int8(&w, bits, s, experts, &a, result, b, e); });
  return ffi::Error::Success();
}

ffi::Error RoutedFloatMatmul(ffi::ThreadPool pool, Blocks ordered, Stack stack, ffi::AnyBuffer scales, Starts starts,
                             ffi::Result<Matrix> out, int64_t group) {
  const int64_t positions = ordered.dimensions()[1], columns = ordered.dimensions()[0] * LLK_BLOCK;
  if (auto error = CheckStack(columns, 4, group, stack, scales, starts, positions); error.failure()) return error;
  llk_weights w = StackWeights(stack, scales, columns, group);
  const int32_t* s = starts.typed_data();
  int64_t experts = stack.dimensions()[0];
  float* result = out->typed_data();
  const float* x = ordered.typed_data();
  ParallelRows(pool, w.rows,
               [&](int64_t b, int64_t e) { llk_routed_w4a16(&w, s, experts, x, positions, result, b, e); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LladaInt8Activations, Int8Activations,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Ret<Int8s>()
                                  .Ret<Matrix>()
                                  .Ret<Int32s>()
                                  .Attr<bool>("feature_major")
                                  .Attr<bool>("nibbles"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(LladaFloatActivations, FloatActivations,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Ret<Blocks>()
                                  .Attr<bool>("feature_major"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(LladaInt8Matmul, Int8Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Int8s>()
                                  .Arg<Matrix>()
                                  .Arg<Int32s>()
                                  .Arg<Bytes>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<Matrix>()
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("group")
                                  .Attr<bool>("signed8"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(LladaFloatMatmul, FloatMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Blocks>()
                                  .Arg<Bytes>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<Matrix>()
                                  .Attr<int64_t>("group"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(LladaRoutedInt8Matmul, RoutedInt8Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Int8s>()
                                  .Arg<Matrix>()
                                  .Arg<Int32s>()
                                  .Arg<Stack>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<Starts>()
                                  .Ret<Matrix>()
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("group"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(LladaRoutedFloatMatmul, RoutedFloatMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Blocks>()
                                  .Arg<Stack>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<Starts>()
                                  .Ret<Matrix>()
                                  .Attr<int64_t>("group"));

extern "C" const char* LladaKernelsIsa() { return llk_isa(); }
