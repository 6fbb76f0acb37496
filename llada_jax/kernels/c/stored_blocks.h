/* A weight row's 32-column block, read as stored, as the ISA's dot product wants it (`simd.h`). */
#ifndef LLADA_STORED_BLOCKS_H
#define LLADA_STORED_BLOCKS_H

#include "kernels.h"
#include "simd.h"

static inline __attribute__((always_inline)) wvec block_weights(const llk_weights* w, int64_t row, int64_t block,
                                                                int bits) {
  int64_t bytes_per_row = w->columns * bits / 8;
  const uint8_t* p = w->weights + row * bytes_per_row + block * (LLK_BLOCK * bits / 8);
  return bits == 4 ? unpack4(p) : load8(p, w->signed8);
}

#endif
