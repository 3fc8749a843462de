/* y = x . W^T (+ bias) with W kept in GGUF's quantized blocks (Q4_0, Q4_1,
 * Q8_0, Q4_K, Q5_K, Q6_K), float32 x and y; and W's rows dequantized.
 *
 * Arithmetic (llama.cpp's CPU backend's, in facts): each call quantizes the
 * activations once, per block, to int8 with one float scale d = amax / 127
 * (blocks of 32 for the 32-weight types, of 256 for the K-quants, with int
 * sums per 16 for the weight types' offsets and mins). A weight block then
 * meets an activation block as integer dot products (unsigned weight codes
 * times signed activations; signed codes as |w| times x with w's sign:
 * vpdpbusd with AVX-512 VNNI, maddubs + madd with
 * AVX2, plain loops otherwise; the compiler's macros pick, so one source
 * builds on any x86 or other CPU), times the sub-block scales in integers,
 * and one float multiply by the two block scales. Offsets and mins go through
 * the activation sums: sum(q * x) - 8 * sum(x) for Q4_0, + m * d_x * sum(x)
 * for Q4_1, - dmin * d_x * sum_j(m_j * sum_j(x)) for Q4_K/Q5_K, -32 * sum(x)
 * per 16 for Q6_K.
 *
 * Weights are GGUF's bytes, the 32-weight types' rows interleaved by groups of
 * 8 (ql_pack, once; "layout" below says how and why), the K-quants as in GGUF,
 * read unaligned. Tasks are runs of whole groups of output features over all
 * rows, about 16 a thread; OpenMP threads (torch's pool, see c_build.py) take
 * them dynamically, so a core lost to another process slows the call instead
 * of stalling it. Within a task, rows go ROW_TILE at a time: each weight chunk
 * is unpacked once per tile and met by every row of the tile, and the task's
 * blocks stay in L1/L2 across tiles.
 *
 * Built with -ffp-contract=off: ql_dequantize_rows is gguf.quants'
 * dequantizers' float32 arithmetic bit for bit (no fused multiply-adds). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>
#define QL_AVX2 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define QL_VNNI 1
#elif defined(__AVXVNNI__)
#define QL_VNNI 2
#endif
#endif

enum { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2, Q4_K = 3, Q5_K = 4, Q6_K = 5 };
enum { ROW_TILE = 4 };
/* group_32 prefetches the weight block this many blocks ahead of the one it
 * multiplies: a one-row step streams its weights from memory, and this was
 * 7% off a one-row decode step of the default model (8.5 -> 7.9 ms, three
 * alternating runs each; prefill and 16 rows unchanged). */
enum { PREFETCH_BLOCKS = 16 };
/* weight streams a one-row product walks side by side (group_32) */
enum { STREAMS = 4 };
#define AI static inline __attribute__((always_inline))

static const int BLOCK[6] = {32, 32, 32, 256, 256, 256};
static const int BYTES[6] = {18, 20, 34, 144, 176, 210};

/* Which vector path this build took: 2 VNNI, 1 AVX2, 0 portable. */
int ql_isa(void) {
#if defined(QL_VNNI)
    return 2;
#elif defined(QL_AVX2)
    return 1;
#else
    return 0;
#endif
}

AI float f16(const uint8_t *p) {
    const uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023;
    uint32_t bits;
    if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        int e = 113;
        uint32_t m = man;
        while (!(m & 1024)) {
            m <<= 1;
            e--;
        }
        bits = sign | ((uint32_t)e << 23) | ((m & 1023) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* Q4_K/Q5_K's 6-bit scale and min of sub-block j from the 12 scale bytes. */
AI void scale_min_k4(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* ---- layout --------------------------------------------------------------
 * The 32-weight types keep GGUF's bytes but interleave them by groups of GROUP
 * output features (pack, once): block b of a group is the GROUP rows' float16
 * scales (d[GROUP], then Q4_1's m[GROUP]), then their codes in chunks of 4
 * bytes: chunk c holds bytes 4c..4c+3 of each row's codes, rows in order. One
 * 32-byte load is then 4 codes (Q8_0) or 4 + 4 (low and high nibbles: weights
 * 4c.. and 16 + 4c..) of each of 8 rows, and one broadcast of 4 activation
 * bytes meets all 8 rows (a row's sum lands in its own lane: no horizontal
 * sums, no cancellation across lanes). Rows past the last whole group, and
 * the K-quants, stay as in GGUF. Same size as GGUF's blocks. */

enum { GROUP = 8 };

AI int64_t grouped_rows(int type, int64_t n) { return BLOCK[type] == 32 ? n - n % GROUP : 0; }

/* GGUF's bytes of block b of row o (in place, or gathered into tmp). */
static const uint8_t *block_of(int type, const uint8_t *w, int64_t n, int64_t nb, int64_t o,
                               int64_t b, uint8_t *tmp) {
    const int bytes = BYTES[type];
    const int64_t row_bytes = nb * bytes;
    if (o >= grouped_rows(type, n)) return w + o * row_bytes + b * bytes;
    const uint8_t *g = w + (o / GROUP) * GROUP * row_bytes + b * GROUP * bytes;
    const int lane = (int)(o % GROUP), scales = type == Q4_1 ? 2 : 1;
    const int chunks = (bytes - 2 * scales) / 4;
    for (int s = 0; s < scales; s++) memcpy(tmp + 2 * s, g + 2 * GROUP * s + 2 * lane, 2);
    const uint8_t *codes = g + 2 * GROUP * scales;
    for (int c = 0; c < chunks; c++) memcpy(tmp + 2 * scales + 4 * c, codes + 4 * GROUP * c + 4 * lane, 4);
    return tmp;
}

/* dst = src (n, k) in GGUF's blocks, rearranged as block_of reads it. */
int ql_pack(int type, const uint8_t *src, uint8_t *dst, int64_t n, int64_t k) {
    if (type < 0 || type > Q6_K || k % BLOCK[type] != 0) return -1;
    const int bytes = BYTES[type];
    const int64_t nb = k / BLOCK[type], row_bytes = nb * bytes, grouped = grouped_rows(type, n);
    memcpy(dst + grouped * row_bytes, src + grouped * row_bytes, (size_t)((n - grouped) * row_bytes));
    const int scales = type == Q4_1 ? 2 : 1, chunks = (bytes - 2 * scales) / 4;
    for (int64_t o = 0; o < grouped; o++)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = src + o * row_bytes + b * bytes;
            uint8_t *g = dst + (o / GROUP) * GROUP * row_bytes + b * GROUP * bytes;
            const int lane = (int)(o % GROUP);
            for (int s = 0; s < scales; s++) memcpy(g + 2 * GROUP * s + 2 * lane, blk + 2 * s, 2);
            uint8_t *codes = g + 2 * GROUP * scales;
            for (int c = 0; c < chunks; c++)
                memcpy(codes + 4 * GROUP * c + 4 * lane, blk + 2 * scales + 4 * c, 4);
        }
    return 0;
}

/* ---- activations ---------------------------------------------------------- */

typedef struct {
    int8_t *q;    /* (rows, k) */
    float *d;     /* (rows, k / block) */
    float *xs;    /* (rows, k / 32): d * sum of the 32-block (32-weight types) */
    int32_t *s16; /* (rows, k / 16): sums per 16 (K-quants) */
    uint8_t *qu;  /* (rows, k): q + 128, for Q8_0 with VNNI; else NULL */
    int64_t k, nb;
} acts;

static void quantize_row(const float *x, int64_t k, int block, int8_t *q, float *d, float *xs,
                         int32_t *s16) {
    for (int64_t b = 0; b < k / block; b++) {
        const float *xb = x + b * block;
        float amax = 0.0f;
        int finite = 1;
        /* a max reduction the vectoriser takes (fmaxf's NaN rule kept it
         * scalar); NaN and infinities are caught by `finite` either way */
#pragma omp simd reduction(max : amax) reduction(& : finite)
        for (int i = 0; i < block; i++) {
            const float a = fabsf(xb[i]);
            amax = a > amax ? a : amax;
            finite &= xb[i] - xb[i] == 0.0f; /* false for NaN and infinities */
        }
        if (!finite) { /* the float product's NaN, not codes cast from NaN */
            d[b] = NAN;
            memset(q + b * block, 0, (size_t)block);
            continue;
        }
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        d[b] = amax / 127.0f;
        for (int i = 0; i < block; i++) q[b * block + i] = (int8_t)nearbyintf(xb[i] * id);
    }
    for (int64_t g = 0; g < k / 16; g++) {
        int32_t s = 0;
        for (int i = 0; i < 16; i++) s += q[g * 16 + i];
        s16[g] = s;
    }
    if (block == 32)
        for (int64_t b = 0; b < k / 32; b++) xs[b] = d[b] * (float)(s16[2 * b] + s16[2 * b + 1]);
}

/* ---- the dot products ------------------------------------------------------ */

#if defined(QL_AVX2)
#include "quant_dot_avx2.h"
#else
#include "quant_dot_portable.h"
#endif


/* Rows [r0, r0 + R) against output features [o0, o1). */
AI void tile(const int type, const int R, const uint8_t *w, int64_t n, const acts *a, int64_t r0,
             int64_t o0, int64_t o1, const float *bias, float *y, int64_t ys) {
    int64_t o = o0;
#if defined(QL_AVX2)
    const int64_t row_bytes = a->nb * BYTES[type];
    const int64_t end = o1 < grouped_rows(type, n) ? o1 : grouped_rows(type, n);
    const int64_t groups = end > o ? (end - o) / GROUP : 0;
    if (R == 1 && groups >= STREAMS) {
        /* STREAMS runs of the task's groups, walked side by side; the
         * remainder's groups one at a time */
        const int64_t run = groups / STREAMS;
        for (int64_t i = 0; i < run; i++) {
            const uint8_t *gs[STREAMS];
            int64_t os[STREAMS];
            for (int j = 0; j < STREAMS; j++) {
                os[j] = o + (j * run + i) * GROUP;
                gs[j] = w + os[j] * row_bytes;
            }
            __m256 res[STREAMS];
            group_32(type, 1, STREAMS, gs, a, r0, res);
            store_groups(1, STREAMS, res, os, bias, y, ys, r0);
        }
        o += STREAMS * run * GROUP;
    }
    for (; o + GROUP <= end; o += GROUP) {
        const uint8_t *g = w + o * row_bytes;
        __m256 res[ROW_TILE];
        group_32(type, R, 1, &g, a, r0, res);
        store_groups(R, 1, res, &o, bias, y, ys, r0);
    }
#endif
    for (; o < o1; o++) {
        float res[ROW_TILE];
#if defined(QL_AVX2)
        if (BLOCK[type] == 32)
            dot_32(type, R, w + o * row_bytes, a, r0, res);
        else
            dot_k(type, R, w + o * row_bytes, a, r0, res);
#else
        dot_any(type, R, w, n, o, a, r0, res);
#endif
        const float bo = bias ? bias[o] : 0.0f;
        for (int r = 0; r < R; r++) y[(r0 + r) * ys + o] = res[r] + bo;
    }
}

/* The activations' buffer for (rows, k): d, xs, s16, q, then (VNNI) qu. */
AI acts acts_at(void *scratch, int64_t rows, int64_t k, int block) {
    acts a = {.k = k, .nb = k / block, .qu = NULL};
    const size_t nq = (size_t)(rows * k), nd = (size_t)(rows * a.nb),
                 n32 = (size_t)(rows * (k / 32));
    a.d = (float *)scratch;
    a.xs = a.d + nd;
    a.s16 = (int32_t *)(a.xs + n32);
    a.q = (int8_t *)(a.s16 + (size_t)(rows * (k / 16)));
#if defined(QL_VNNI)
    a.qu = (uint8_t *)a.q + nq;
#else
    (void)nq;
#endif
    return a;
}

/* Bytes of the buffer ql_quantize_row fills for (rows, k), either block size. */
int64_t ql_scratch_bytes(int64_t rows, int64_t k) {
    return 2 * rows * k + 4 * (2 * rows * (k / 32) + rows * (k / 16)) + 64;
}

/* Quantizes row r of x into scratch's layout for (rows, k) and the block size
 * (32 or 256) of the types it will meet. One row: the decode chain's team
 * splits the rows. */
void ql_quantize_row(int block, const float *x, int64_t rows, int64_t k, int64_t r, void *scratch) {
    acts a = acts_at(scratch, rows, k, block);
    quantize_row(x, k, block, a.q + r * k, a.d + r * a.nb, a.xs + r * (k / 32),
                 a.s16 + r * (k / 16));
#if defined(QL_VNNI)
    if (block == 32)
        for (int64_t i = r * k; i < (r + 1) * k; i++) a.qu[i] = (uint8_t)(a.q[i] ^ 0x80);
#endif
}

AI void run_part(const int type, const uint8_t *w, int64_t n, const acts *a, int64_t rows,
                 int64_t o0, int64_t o1, const float *bias, float *y, int64_t ys) {
    for (int64_t r = 0; r < rows; r += ROW_TILE) {
        switch (rows - r < ROW_TILE ? rows - r : ROW_TILE) {
            case 1: tile(type, 1, w, n, a, r, o0, o1, bias, y, ys); break;
            case 2: tile(type, 2, w, n, a, r, o0, o1, bias, y, ys); break;
            case 3: tile(type, 3, w, n, a, r, o0, o1, bias, y, ys); break;
            default: tile(type, 4, w, n, a, r, o0, o1, bias, y, ys);
        }
    }
}

/* Output features [o0, o1) (o0 a multiple of 8) of y = x . W^T + bias for all
 * rows, x already quantized into scratch (ql_quantize_row, every row), on the
 * calling thread. Each feature's arithmetic is ql_matmul's: the results are
 * its bit for bit, however the features are split. Returns 0 or -1. */
int ql_matmul_part(int type, const void *scratch, int64_t rows, int64_t k, const uint8_t *w,
                   int64_t n, int64_t o0, int64_t o1, const float *bias, float *y, int64_t ys) {
    if (type < 0 || type > Q6_K || k % BLOCK[type] != 0 || o0 % GROUP != 0) return -1;
    const acts a = acts_at((void *)scratch, rows, k, BLOCK[type]);
    switch (type) {
        case Q4_0: run_part(Q4_0, w, n, &a, rows, o0, o1, bias, y, ys); break;
        case Q4_1: run_part(Q4_1, w, n, &a, rows, o0, o1, bias, y, ys); break;
        case Q8_0: run_part(Q8_0, w, n, &a, rows, o0, o1, bias, y, ys); break;
        case Q4_K: run_part(Q4_K, w, n, &a, rows, o0, o1, bias, y, ys); break;
        case Q5_K: run_part(Q5_K, w, n, &a, rows, o0, o1, bias, y, ys); break;
        default: run_part(Q6_K, w, n, &a, rows, o0, o1, bias, y, ys);
    }
    return 0;
}

/* y (rows, n; row stride ys) = x (rows, k; row stride xs) . W^T + bias (may be
 * NULL). Returns 0, -1 for an unknown type or k not a multiple of its block,
 * -2 when scratch memory cannot be had. */
int ql_matmul(int type, const float *x, int64_t rows, int64_t x_stride, int64_t k,
              const uint8_t *w, int64_t n, const float *bias, float *y, int64_t ys, int threads) {
    if (type < 0 || type > Q6_K || k % BLOCK[type] != 0) return -1;
    if (rows <= 0 || n <= 0) return 0;
    char *scratch = malloc((size_t)ql_scratch_bytes(rows, k));
    if (!scratch) return -2;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows >= 32)
    for (int64_t r = 0; r < rows; r++)
        ql_quantize_row(BLOCK[type], x + r * x_stride, rows, k, r, scratch);
    /* about 16 tasks a thread (whole groups), so that a thread slowed by another
     * process leaves its share to the others without a scheduling cost per group */
    const int64_t groups = (n + GROUP - 1) / GROUP, per_thread = 16 * (threads > 1 ? threads : 1);
    const int64_t chunk = GROUP * (groups > per_thread ? groups / per_thread : 1);
    const int64_t tasks = (n + chunk - 1) / chunk;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && tasks > 1)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t o0 = t * chunk, o1 = o0 + chunk < n ? o0 + chunk : n;
        ql_matmul_part(type, scratch, rows, k, w, n, o0, o1, bias, y, ys);
    }
    free(scratch);
    return 0;
}

/* ---- dequantization: gguf.quants' float32 arithmetic -------------------- */

#include "quant_dequantize.h"

int ql_dequantize_rows(int type, const uint8_t *w, int64_t n, int64_t k, const int64_t *ids,
                       int64_t count, float *out, int threads) {
    if (type < 0 || type > Q6_K || k % BLOCK[type] != 0) return -1;
    if (ids)
        for (int64_t i = 0; i < count; i++)
            if (ids[i] < 0 || ids[i] >= n) return -3;
    const int64_t nb = k / BLOCK[type];
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && count * k >= 65536)
    for (int64_t i = 0; i < count; i++) {
        uint8_t tmp[34];
        for (int64_t b = 0; b < nb; b++)
            dequantize_block(type, block_of(type, w, n, nb, ids ? ids[i] : i, b, tmp),
                             out + i * k + b * BLOCK[type]);
    }
    return 0;
}
