/* y = x . W^T (+ bias) for the few rows of a decode step, float32, with W
 * packed once into blocks of 16 output features: packed[block][k][16].
 *
 * Each task is a pair of blocks (32 output features) over all rows, eight
 * rows at a time (three without 512-bit registers): per input feature one
 * 16-float load per block and a broadcast multiply-add per row, the
 * accumulators in registers. Tasks go to
 * OpenMP threads dynamically (torch's own pool, see c_build.py): when another
 * process takes one core for a while, the other thread keeps taking tasks
 * instead of waiting at the end of a static split. At 1-32 rows it runs the
 * default model's projections 0.66-0.88x of oneDNN's time with its packed
 * weights; past a few hundred rows oneDNN's blocking wins (models/cpu_linear.py
 * picks). Built by kernels/cpu_kernels.py (multiply-adds fused). */

#include <stdint.h>

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef float v8 __attribute__((vector_size(32), aligned(4)));

/* A block's 16 floats as PARTS vectors the CPU has registers for: one
 * 16-float vector with AVX-512, two 8-float ones elsewhere (16-float GCC
 * vectors on a 256-bit CPU are lowered through the stack: 576x576 at one row
 * ran at ~2 GFLOP/s). Each output feature stays one lane with the same
 * multiply-adds in the same order, so the results do not depend on the width.
 * ROW_TILE keeps the accumulators (ROW_TILE x 2 blocks x PARTS) in registers. */
#if defined(__AVX512F__)
#define ROW_TILE 8
typedef v16 vec;
enum { VW = 16 };
#else
#define ROW_TILE 3
typedef v8 vec;
enum { VW = 8 };
#endif
enum { PARTS = 16 / VW };

/* w (n, k) row-major into packed (ceil(n / 16), k, 16), zero past n. */
void skinny_pack(const float *w, float *packed, int64_t n, int64_t k) {
    const int64_t blocks = (n + 15) / 16;
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int c = 0; c < 16; c++) {
                const int64_t col = b * 16 + c;
                packed[(b * k + kk) * 16 + c] = col < n ? w[col * k + kk] : 0.0f;
            }
}

/* `rows` (<= ROW_TILE) rows of x against `nb` (1 or 2) blocks from column `col`. */
static inline __attribute__((always_inline)) void tile(
    const int rows, const int nb, const float *x, const float *w0, const float *w1, int64_t k,
    float *y, int64_t n, int64_t col, const float *bias) {
    vec acc[ROW_TILE][2][PARTS];
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < 2; j++)
            for (int h = 0; h < PARTS; h++) acc[m][j][h] = (vec){0};
    for (int64_t kk = 0; kk < k; kk++) {
        vec a[PARTS], b[PARTS];
        for (int h = 0; h < PARTS; h++) {
            a[h] = *(const vec *)(w0 + kk * 16 + h * VW);
            b[h] = nb == 2 ? *(const vec *)(w1 + kk * 16 + h * VW) : a[h];
        }
        for (int m = 0; m < rows; m++) {
            const float xv = x[m * k + kk];
            for (int h = 0; h < PARTS; h++) {
                acc[m][0][h] += xv * a[h];
                if (nb == 2) acc[m][1][h] += xv * b[h];
            }
        }
    }
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < nb; j++) {
            const int64_t c0 = col + 16 * j;
            float *dst = y + m * n + c0;
            float v[16];
            for (int h = 0; h < PARTS; h++) *(vec *)(v + h * VW) = acc[m][j][h];
            if (bias)
                for (int c = 0; c < 16 && c0 + c < n; c++) v[c] += bias[c0 + c];
            for (int c = 0; c < 16 && c0 + c < n; c++) dst[c] = v[c];
        }
}

/* y (m, n) = x (m, k) . W^T + bias (bias may be NULL); x and y contiguous. */
void skinny_linear(const float *x, int64_t m, int64_t k, const float *packed, int64_t n,
                   const float *bias, float *y, int threads) {
    const int64_t blocks = (n + 15) / 16, pairs = (blocks + 1) / 2;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && pairs > 1)
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t b = 2 * p;
        const float *w0 = packed + b * k * 16, *w1 = w0 + k * 16;
        const int two = b + 1 < blocks;
        for (int64_t r = 0; r < m; r += ROW_TILE) {
            const int rows = m - r < ROW_TILE ? (int)(m - r) : ROW_TILE;
            const float *xr = x + r * k;
            float *yr = y + r * n;
#define TILE(R)                                                            \
    if (two)                                                               \
        tile(R, 2, xr, w0, w1, k, yr, n, b * 16, bias);                    \
    else                                                                   \
        tile(R, 1, xr, w0, w1, k, yr, n, b * 16, bias);                    \
    break;
            /* constant row counts: the accumulators stay in registers */
            switch (rows) {
                case 1: TILE(1)
                case 2: TILE(2)
#if ROW_TILE > 3
                case 3: TILE(3)
                case 4: TILE(4)
                case 5: TILE(5)
                case 6: TILE(6)
                case 7: TILE(7)
#endif
                default: TILE(ROW_TILE)
            }
#undef TILE
        }
    }
}
