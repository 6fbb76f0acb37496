/* One kernel call read from a file, its output written to another: how the kernels' tests reach builds this
 * Python cannot load (arm64, under qemu-aarch64). The input (`kernel_statement.Call`): an int64 header {scheme
 * (0 w4a8, 1 w8a8, 2 w4a16), positions, rows, columns, group, scale_bf16, signed8}, the weights' bytes, their
 * scales, then the int8 activations (values, float32 scales, int32 sums) or the float32 ones, block-major. Rows
 * go in two calls, as threads would; rows no call writes stay NaN. Prints the build's ISA path.
 * Scheme 3 prepares activations instead (`activations.c`): header {3, positions, 0, columns, feature_major, nibbles,
 * int8}, then float32 x as held; writes the blocks (int8: values, float32 scales, int32 sums), blocks in two calls. */
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

static void write_all(FILE* o, const void* p, int64_t bytes) {
  if (fwrite(p, 1, (size_t)bytes, o) != (size_t)bytes) exit(2);
}

static void prepare(FILE* in, const int64_t* h, FILE* o) {
  int64_t positions = h[1], columns = h[3], blocks = columns / LLK_BLOCK, split[3] = {0, blocks / 2, blocks};
  llk_float_input x = {take(in, positions * columns * 4), positions, columns, (int32_t)h[4], (int32_t)h[5]};
  if (!h[6]) {
    float* out = malloc((size_t)(positions * columns) * sizeof(float));
    for (int k = 0; k < 2; k++) llk_float_blocks(&x, out, split[k], split[k + 1]);
    write_all(o, out, positions * columns * 4);
    return;
  }
  int8_t* values = malloc((size_t)(positions * columns));
  float* scales = malloc((size_t)(positions * blocks) * sizeof(float));
  int32_t* sums = malloc((size_t)(positions * blocks) * sizeof(int32_t));
  for (int k = 0; k < 2; k++) llk_int8_blocks(&x, values, scales, sums, split[k], split[k + 1]);
  write_all(o, values, positions * columns);
  write_all(o, scales, positions * blocks * 4);
  write_all(o, sums, positions * blocks * 4);
}

int main(int argc, char** argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: kernel_runner CALL OUT\n");
    return 2;
  }
  FILE* in = fopen(argv[1], "rb");
  if (!in) return 2;
  int64_t* h = take(in, 7 * sizeof(int64_t));
  if (h[0] == 3) {
    FILE* o = fopen(argv[2], "wb");
    if (!o) return 2;
    prepare(in, h, o);
    fclose(o);
    puts(llk_isa());
    return 0;
  }
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
