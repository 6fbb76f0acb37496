/* The kernels as IREE dispatch functions, linked into a bundle's executables (`lowering/kernel_dispatch.py`):
 * each workgroup of a matmul computes LLK_IREE_ROWS weight rows of every position, each of a preparation
 * LLK_IREE_BLOCKS blocks of the activations. IREE passes each buffer as a 1-D memref descriptor (base pointer,
 * aligned pointer, offset in elements, size, stride) and index operands as size_t. */
#include <stddef.h>

#include "kernels.h"

#define LLK_IREE_ROWS 64
#define LLK_IREE_BLOCKS 8
#define BUFFER(type, name) \
  type *name##_base, type *name, size_t name##_offset, size_t name##_size, size_t name##_stride
#define AT(name) (name + name##_offset)

static llk_weights weights_of(const int8_t* weights, const void* scales, size_t columns, size_t rows, size_t group,
                              size_t scale_bf16) {
  llk_weights w = {(const uint8_t*)weights, scales, (int64_t)rows, (int64_t)columns, (int64_t)group,
                   (int32_t)scale_bf16, 0};
  return w;
}

static int64_t last_row(size_t workgroup, size_t rows) {
  size_t end = (workgroup + 1) * LLK_IREE_ROWS;
  return (int64_t)(end < rows ? end : rows);
}

/* The scales of one matrix: float32 or bfloat16 (`scale_bf16`), the offset in their own elements. */
static const void* scales_at(const void* scales, size_t offset, size_t scale_bf16) {
  return (const char*)scales + offset * (scale_bf16 ? 2 : 4);
}

void llk_iree_int8(BUFFER(const int8_t, values), BUFFER(const float, block_scales), BUFFER(const int32_t, sums),
                   BUFFER(const int8_t, weights), BUFFER(const void, scales), BUFFER(float, out), size_t bits,
                   size_t positions, size_t columns, size_t rows, size_t group, size_t scale_bf16, size_t workgroup) {
  llk_weights w = weights_of(AT(weights), scales_at(scales, scales_offset, scale_bf16), columns, rows, group,
                             scale_bf16);
  llk_int8_activations a = {AT(values), AT(block_scales), AT(sums), (int64_t)positions, (int64_t)positions};
  int64_t begin = (int64_t)(workgroup * LLK_IREE_ROWS), end = last_row(workgroup, rows);
  if (bits == 4)
    llk_w4a8(&w, &a, AT(out), begin, end);
  else
    llk_w8a8(&w, &a, AT(out), begin, end);
}

void llk_iree_float(BUFFER(const float, ordered), BUFFER(const int8_t, weights), BUFFER(const void, scales),
                    BUFFER(float, out), size_t positions, size_t columns, size_t rows, size_t group,
                    size_t scale_bf16, size_t workgroup) {
  llk_weights w = weights_of(AT(weights), scales_at(scales, scales_offset, scale_bf16), columns, rows, group,
                             scale_bf16);
  llk_w4a16(&w, AT(ordered), (int64_t)positions, (int64_t)positions, AT(out), (int64_t)(workgroup * LLK_IREE_ROWS),
            last_row(workgroup, rows));
}

/* A sparse MoE's routed products (`routed.c`): `weights` and `scales` hold `experts` matrices stacked, `starts`
 * each expert's first row (and the end). */
void llk_iree_int8_routed(BUFFER(const int8_t, values), BUFFER(const float, block_scales), BUFFER(const int32_t, sums),
                          BUFFER(const int8_t, weights), BUFFER(const void, scales), BUFFER(const int32_t, starts),
                          BUFFER(float, out), size_t bits, size_t experts, size_t positions, size_t columns,
                          size_t rows, size_t group, size_t scale_bf16, size_t workgroup) {
  llk_weights w = weights_of(AT(weights), scales_at(scales, scales_offset, scale_bf16), columns, rows, group,
                             scale_bf16);
  llk_int8_activations a = {AT(values), AT(block_scales), AT(sums), (int64_t)positions, (int64_t)positions};
  llk_routed_int8(&w, (int64_t)bits, AT(starts), (int64_t)experts, &a, AT(out),
                  (int64_t)(workgroup * LLK_IREE_ROWS), last_row(workgroup, rows));
}

void llk_iree_float_routed(BUFFER(const float, ordered), BUFFER(const int8_t, weights), BUFFER(const void, scales),
                           BUFFER(const int32_t, starts), BUFFER(float, out), size_t experts, size_t positions,
                           size_t columns, size_t rows, size_t group, size_t scale_bf16, size_t workgroup) {
  llk_weights w = weights_of(AT(weights), scales_at(scales, scales_offset, scale_bf16), columns, rows, group,
                             scale_bf16);
  llk_routed_w4a16(&w, AT(starts), (int64_t)experts, AT(ordered), (int64_t)positions, AT(out),
                   (int64_t)(workgroup * LLK_IREE_ROWS), last_row(workgroup, rows));
}

static int64_t last_block(size_t workgroup, size_t blocks) {
  size_t end = (workgroup + 1) * LLK_IREE_BLOCKS;
  return (int64_t)(end < blocks ? end : blocks);
}

void llk_iree_int8_activations(BUFFER(const float, x), BUFFER(int8_t, values), BUFFER(float, block_scales),
                               BUFFER(int32_t, sums), size_t positions, size_t columns, size_t feature_major,
                               size_t nibbles, size_t blocks, size_t workgroup) {
  llk_float_input in = {AT(x), (int64_t)positions, (int64_t)columns, (int32_t)feature_major, (int32_t)nibbles};
  llk_int8_blocks(&in, AT(values), AT(block_scales), AT(sums), (int64_t)(workgroup * LLK_IREE_BLOCKS),
                  last_block(workgroup, blocks));
}

void llk_iree_float_activations(BUFFER(const float, x), BUFFER(float, ordered), size_t positions, size_t columns,
                                size_t feature_major, size_t blocks, size_t workgroup) {
  llk_float_input in = {AT(x), (int64_t)positions, (int64_t)columns, (int32_t)feature_major, 1};
  llk_float_blocks(&in, AT(ordered), (int64_t)(workgroup * LLK_IREE_BLOCKS), last_block(workgroup, blocks));
}
