/* One kernel call read from a file, its output written to another: how the kernels' tests reach builds this
 * Python cannot load (arm64, under qemu-aarch64). The input (`kernel_statement.Call`): an int64 header {scheme
 * (0 w4a8, 1 w8a8, 2 w4a16), positions, rows, columns, group, scale_bf16, signed8}, the weights' bytes, their
 * scales, then the int8 activations (values, float32 scales, int32 sums) or the float32 ones, block-major. Rows
 * go in two calls, as threads would; rows no call writes stay NaN. Prints the build's ISA path. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

static void* take(FILE* in, int64_t bytes) {
  void* p = malloc(bytes ? (size_t)bytes : 1);
  if (!p || fread(p, 1, (size_t)bytes, in) != (size_t)bytes) {
    fprintf(stderr, "kernel_runner: short input\n");
    exit(2);
  }
  return p;
}

int main(int argc, char** argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: kernel_runner CALL OUT\n");
    return 2;
  }
  FILE* in = fopen(argv[1], "rb");
  if (!in) return 2;
  int64_t* h = take(in, 7 * sizeof(int64_t));
  int64_t scheme = h[0], positions = h[1], rows = h[2], columns = h[3], group = h[4];
  int64_t bits = scheme == 1 ? 8 : 4, blocks = columns / LLK_BLOCK;
  llk_weights w = {take(in, rows * columns * bits / 8), take(in, rows * (columns / group) * (h[5] ? 2 : 4)), rows,
                   columns, group, (int32_t)h[5], (int32_t)h[6]};
  float* out = malloc((size_t)(positions * rows) * sizeof(float));
  memset(out, 0xFF, (size_t)(positions * rows) * sizeof(float)); /* NaN */
  int64_t split[3] = {0, rows / 2, rows};
  if (scheme == 2) {
    float* x = take(in, positions * columns * 4);
    for (int k = 0; k < 2; k++) llk_w4a16(&w, x, positions, positions, out, split[k], split[k + 1]);
  } else {
    llk_int8_activations a = {take(in, positions * columns), take(in, positions * blocks * 4),
                              take(in, positions * blocks * 4), positions, positions};
    for (int k = 0; k < 2; k++) (scheme == 0 ? llk_w4a8 : llk_w8a8)(&w, &a, out, split[k], split[k + 1]);
  }
  fclose(in);
  FILE* o = fopen(argv[2], "wb");
  if (!o || fwrite(out, sizeof(float), (size_t)(positions * rows), o) != (size_t)(positions * rows)) return 2;
  fclose(o);
  puts(llk_isa());
  return 0;
}
