/* y = x . W^T (+ bias) for the few rows of a decode step, float32, with W
 * packed once into blocks of 16 output features: packed[block][k][16].
 *
 * Each task is a pair of blocks (32 output features) over all rows, eight
 * rows at a time: per input feature one 16-float load per block and a
 * broadcast multiply-add per row, 16 accumulators in registers. Tasks go to
 * OpenMP threads dynamically (torch's own pool, see c_build.py): when another
 * process takes one core for a while, the other thread keeps taking tasks
 * instead of waiting at the end of a static split. At 1-32 rows it runs the
 * default model's projections 0.66-0.88x of oneDNN's time with its packed
 * weights; past a few hundred rows oneDNN's blocking wins (models/cpu_linear.py
 * picks). Built by kernels/cpu_kernels.py (multiply-adds fused). */

#include <stdint.h>

typedef float v16 __attribute__((vector_size(64), aligned(4)));
enum { ROW_TILE = 8 };

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
    v16 acc[ROW_TILE][2];
    for (int m = 0; m < rows; m++) acc[m][0] = acc[m][1] = (v16){0};
    for (int64_t kk = 0; kk < k; kk++) {
        const v16 a = *(const v16 *)(w0 + kk * 16);
        const v16 b = nb == 2 ? *(const v16 *)(w1 + kk * 16) : a;
        for (int m = 0; m < rows; m++) {
            const float xv = x[m * k + kk];
            acc[m][0] += xv * a;
            if (nb == 2) acc[m][1] += xv * b;
        }
    }
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < nb; j++) {
            const int64_t c0 = col + 16 * j;
            float *dst = y + m * n + c0;
            v16 v = acc[m][j];
            if (bias)
                for (int c = 0; c < 16 && c0 + c < n; c++) v[c] += bias[c0 + c];
            if (c0 + 16 <= n)
                *(v16 *)dst = v;
            else
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
                case 3: TILE(3)
                case 4: TILE(4)
                case 5: TILE(5)
                case 6: TILE(6)
                case 7: TILE(7)
                default: TILE(8)
            }
#undef TILE
        }
    }
}
