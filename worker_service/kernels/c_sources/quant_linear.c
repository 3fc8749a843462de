/* y = x . W^T (+ bias) with W kept in GGUF's quantized blocks (Q4_0, Q4_1,
 * Q8_0, Q4_K, Q5_K, Q6_K), float32 x and y; and W's rows dequantized.
 *
 * Arithmetic (llama.cpp's CPU backend's, in facts): each call quantizes the
 * activations once, per block, to int8 with one float scale d = amax / 127
 * (blocks of 32 for the 32-weight types, of 256 for the K-quants, with int
 * sums per 16 for the weight types' offsets and mins). A weight block then
 * meets an activation block as integer dot products (unsigned weight codes
 * times signed activations: vpdpbusd with AVX-512 VNNI, maddubs + madd with
 * AVX2, plain loops otherwise; the compiler's macros pick, so one source
 * builds on any x86 or other CPU), times the sub-block scales in integers,
 * and one float multiply by the two block scales. Offsets and mins go through
 * the activation sums: sum(q * x) - 8 * sum(x) for Q4_0, + m * d_x * sum(x)
 * for Q4_1, - dmin * d_x * sum_j(m_j * sum_j(x)) for Q4_K/Q5_K, -32 * sum(x)
 * per 16 for Q6_K.
 *
 * Weights stay in GGUF's byte layout (rows of blocks, one row per output
 * feature), read unaligned. Tasks are chunks of CHUNK output features over
 * all rows; OpenMP threads (torch's pool, see c_build.py) take them
 * dynamically, so a core lost to another process slows the call instead of
 * stalling it. Within a task, rows go ROW_TILE at a time: each weight block is
 * unpacked once per tile and met by every row of the tile, and the chunk's
 * blocks stay in L1 across tiles.
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
enum { CHUNK = 8, ROW_TILE = 4 };
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

/* ---- activations ---------------------------------------------------------- */

typedef struct {
    int8_t *q;    /* (rows, k) */
    float *d;     /* (rows, k / block) */
    float *xs;    /* (rows, k / 32): d * sum of the 32-block (32-weight types) */
    int32_t *s16; /* (rows, k / 16): sums per 16 (K-quants) */
    int64_t k, nb;
} acts;

static void quantize_row(const float *x, int64_t k, int block, int8_t *q, float *d, float *xs,
                         int32_t *s16) {
    for (int64_t b = 0; b < k / block; b++) {
        const float *xb = x + b * block;
        float amax = 0.0f;
        for (int i = 0; i < block; i++) amax = fmaxf(amax, fabsf(xb[i]));
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

/* ---- vector primitives ---------------------------------------------------- */

#if defined(QL_AVX2)
/* acc + sums of 4 (VNNI) or 2x2 (AVX2) products u8 x s8, as int32x8 */
AI __m256i dot_us(__m256i acc, __m256i u, __m256i s) {
#if QL_VNNI == 1
    return _mm256_dpbusd_epi32(acc, u, s);
#elif QL_VNNI == 2
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

/* Sub-block scale in the layout scaled_dot wants: int32 per lane (VNNI) or
 * int16 per lane (AVX2); lanes 0-3 / 0-7 scale the first 16 bytes. */
AI __m256i scale_pair(int a, int b) {
#if defined(QL_VNNI)
    return _mm256_setr_epi32(a, a, a, a, b, b, b, b);
#else
    return _mm256_setr_epi16(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b);
#endif
}

/* acc + (u . s per group) * scale, int32x8. maddubs cannot saturate: weight
 * codes are at most 63 and activations at most 127 in magnitude. */
AI __m256i scaled_dot(__m256i acc, __m256i u, __m256i s, __m256i scale) {
#if defined(QL_VNNI)
    return _mm256_add_epi32(acc, _mm256_mullo_epi32(dot_us(_mm256_setzero_si256(), u, s), scale));
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), scale));
#endif
}

AI __m256 fmadd(__m256 a, __m256 b, __m256 c) {
#if defined(__FMA__)
    return _mm256_fmadd_ps(a, b, c);
#else
    return _mm256_add_ps(_mm256_mul_ps(a, b), c);
#endif
}

AI float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

AI int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
    return _mm_cvtsi128_si32(s);
}

AI __m256i nibbles(const uint8_t *p) { /* 16 bytes: low nibbles, then high */
    const __m128i q = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0x0F));
}

#define LOAD(p) _mm256_loadu_si256((const __m256i *)(p))

/* One output feature (row `w` of nb 32-blocks) against R activation rows. */
AI void dot_32(const int type, const int R, const uint8_t *w, const acts *a, int64_t r0,
               float *res) {
    const int bytes = BYTES[type];
    __m256 acc[ROW_TILE];
    float accm[ROW_TILE];
    for (int r = 0; r < R; r++) {
        acc[r] = _mm256_setzero_ps();
        accm[r] = 0.0f;
    }
    for (int64_t b = 0; b < a->nb; b++) {
        const uint8_t *blk = w + b * bytes;
        const float dw = f16(blk);
        __m256i u, wv = _mm256_setzero_si256();
        /* signed codes (Q8_0, Q4_0 less its offset 8) as |w| times x with w's
         * sign, so that each lane holds the products' sum (no offset to cancel) */
        if (type == Q4_1) {
            u = nibbles(blk + 4);
        } else {
            wv = type == Q8_0 ? LOAD(blk + 2) : _mm256_sub_epi8(nibbles(blk + 2), _mm256_set1_epi8(8));
            u = _mm256_sign_epi8(wv, wv);
        }
        const float mw = type == Q4_1 ? f16(blk + 2) : 0.0f;
        for (int r = 0; r < R; r++) {
            const int64_t row = r0 + r;
            __m256i xv = LOAD(a->q + row * a->k + b * 32);
            if (type != Q4_1) xv = _mm256_sign_epi8(xv, wv);
            const __m256i p = dot_us(_mm256_setzero_si256(), u, xv);
            acc[r] = fmadd(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * a->d[row * a->nb + b]), acc[r]);
            if (type == Q4_1) accm[r] += mw * a->xs[row * a->nb + b];
        }
    }
    for (int r = 0; r < R; r++) res[r] = hsum(acc[r]) + accm[r];
}

/* One output feature of K-quant super-blocks against R activation rows. */
AI void dot_k(const int type, const int R, const uint8_t *w, const acts *a, int64_t r0,
              float *res) {
    const int bytes = BYTES[type];
    float accm[ROW_TILE] = {0};
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < a->nb; b++) {
        const uint8_t *blk = w + b * bytes;
        __m256i u[8], sc[8];
        float dw, dmin = 0.0f;
        int mins[8] = {0}, sc6[16];
        if (type == Q6_K) {
            dw = f16(blk + 208);
            const int8_t *s = (const int8_t *)(blk + 192);
            for (int h = 0; h < 2; h++) {
                const uint8_t *ql = blk + 64 * h, *qhp = blk + 128 + 32 * h;
                const __m256i l0 = LOAD(ql), l1 = LOAD(ql + 32), qh = LOAD(qhp);
                const __m256i three = _mm256_set1_epi8(3);
                const __m256i h0 = _mm256_and_si256(qh, three);
                const __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(qh, 2), three);
                const __m256i h2 = _mm256_and_si256(_mm256_srli_epi16(qh, 4), three);
                const __m256i h3 = _mm256_and_si256(_mm256_srli_epi16(qh, 6), three);
                u[4 * h + 0] = _mm256_or_si256(_mm256_and_si256(l0, low), _mm256_slli_epi16(h0, 4));
                u[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, low), _mm256_slli_epi16(h1, 4));
                u[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low),
                                               _mm256_slli_epi16(h2, 4));
                u[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low),
                                               _mm256_slli_epi16(h3, 4));
            }
            for (int v = 0; v < 8; v++) sc[v] = scale_pair(s[2 * v], s[2 * v + 1]);
            for (int j = 0; j < 16; j++) sc6[j] = s[j];
        } else {
            dw = f16(blk);
            dmin = f16(blk + 2);
            const uint8_t *qs = blk + (type == Q5_K ? 48 : 16);
            __m256i hb = type == Q5_K ? LOAD(blk + 16) : _mm256_setzero_si256();
            for (int j = 0; j < 4; j++) {
                const __m256i q = LOAD(qs + 32 * j);
                u[2 * j] = _mm256_and_si256(q, low);
                u[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
            }
            if (type == Q5_K) {
                const __m256i bit4 = _mm256_set1_epi8(0x10);
                for (int j = 0; j < 8; j++) {
                    u[j] = _mm256_or_si256(u[j], _mm256_and_si256(_mm256_slli_epi16(hb, 4), bit4));
                    hb = _mm256_srli_epi16(hb, 1);
                }
            }
            for (int j = 0; j < 8; j++) {
                int s, m;
                scale_min_k4(blk + 4, j, &s, &m);
                sc[j] = scale_pair(s, s);
                mins[j] = m;
            }
        }
        for (int r = 0; r < R; r++) {
            const int64_t row = r0 + r;
            const int8_t *x = a->q + row * a->k + b * 256;
            const int32_t *s16 = a->s16 + row * (a->k / 16) + b * 16;
            __m256i isum = _mm256_setzero_si256();
            for (int v = 0; v < 8; v++) isum = scaled_dot(isum, u[v], LOAD(x + 32 * v), sc[v]);
            /* the super-block's integer total: the Q6_K offset cancels in integers */
            int32_t total = hsum_i32(isum), off = 0;
            if (type == Q6_K) {
                for (int j = 0; j < 16; j++) off += sc6[j] * s16[j];
                total -= 32 * off;
            }
            accm[r] += dw * a->d[row * a->nb + b] * (float)total;
            if (type != Q6_K) {
                for (int j = 0; j < 8; j++) off += mins[j] * (s16[2 * j] + s16[2 * j + 1]);
                accm[r] -= dmin * a->d[row * a->nb + b] * (float)off;
            }
        }
    }
    for (int r = 0; r < R; r++) res[r] = accm[r];
}

#else /* portable */

/* The block's signed weight codes (offsets applied) and per-16 integer
 * scales; the float scales; the min (Q4_1: m; K4/K5: dmin with mins[]). */
static void unpack_block(int type, const uint8_t *blk, int16_t *q, int *sc16, int *mins,
                         float *dw, float *dm) {
    switch (type) {
        case Q4_0:
        case Q4_1: {
            const uint8_t *qs = blk + (type == Q4_1 ? 4 : 2);
            for (int i = 0; i < 16; i++) {
                q[i] = (int16_t)((qs[i] & 0xF) - (type == Q4_0 ? 8 : 0));
                q[i + 16] = (int16_t)((qs[i] >> 4) - (type == Q4_0 ? 8 : 0));
            }
            *dw = f16(blk);
            *dm = type == Q4_1 ? f16(blk + 2) : 0.0f;
            sc16[0] = sc16[1] = 1;
            break;
        }
        case Q8_0:
            for (int i = 0; i < 32; i++) q[i] = ((const int8_t *)(blk + 2))[i];
            *dw = f16(blk);
            *dm = 0.0f;
            sc16[0] = sc16[1] = 1;
            break;
        case Q4_K:
        case Q5_K: {
            const uint8_t *qs = blk + (type == Q5_K ? 48 : 16), *qh = blk + 16;
            for (int j = 0; j < 4; j++)
                for (int l = 0; l < 32; l++) {
                    int lo = qs[32 * j + l] & 0xF, hi = qs[32 * j + l] >> 4;
                    if (type == Q5_K) {
                        lo |= ((qh[l] >> (2 * j)) & 1) << 4;
                        hi |= ((qh[l] >> (2 * j + 1)) & 1) << 4;
                    }
                    q[64 * j + l] = (int16_t)lo;
                    q[64 * j + 32 + l] = (int16_t)hi;
                }
            for (int j = 0; j < 8; j++) {
                int s, m;
                scale_min_k4(blk + 4, j, &s, &m);
                sc16[2 * j] = sc16[2 * j + 1] = s;
                mins[j] = m;
            }
            *dw = f16(blk);
            *dm = f16(blk + 2);
            break;
        }
        default: { /* Q6_K */
            for (int h = 0; h < 2; h++) {
                const uint8_t *ql = blk + 64 * h, *qh = blk + 128 + 32 * h;
                for (int l = 0; l < 32; l++) {
                    int16_t *y = q + 128 * h + l;
                    y[0] = (int16_t)(((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32);
                    y[32] = (int16_t)(((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
                    y[64] = (int16_t)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                    y[96] = (int16_t)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
                }
            }
            for (int j = 0; j < 16; j++) sc16[j] = ((const int8_t *)(blk + 192))[j];
            *dw = f16(blk + 208);
            *dm = 0.0f;
        }
    }
}

AI void dot_any(const int type, const int R, const uint8_t *w, const acts *a, int64_t r0,
                float *res) {
    const int block = BLOCK[type], bytes = BYTES[type];
    int16_t q[256];
    int sc16[16], mins[8];
    float acc[ROW_TILE] = {0};
    for (int64_t b = 0; b < a->nb; b++) {
        float dw, dm;
        unpack_block(type, w + b * bytes, q, sc16, mins, &dw, &dm);
        for (int r = 0; r < R; r++) {
            const int64_t row = r0 + r;
            const int8_t *x = a->q + row * a->k + b * block;
            int32_t isum = 0;
            for (int g = 0; g < block / 16; g++) {
                int32_t s = 0;
                for (int i = 0; i < 16; i++) s += q[16 * g + i] * x[16 * g + i];
                isum += sc16[g] * s;
            }
            const float dx = a->d[row * a->nb + b];
            acc[r] += dw * dx * (float)isum;
            if (type == Q4_1) acc[r] += dm * a->xs[row * a->nb + b];
            if (type == Q4_K || type == Q5_K) {
                const int32_t *s16 = a->s16 + row * (a->k / 16) + b * 16;
                int32_t off = 0;
                for (int j = 0; j < 8; j++) off += mins[j] * (s16[2 * j] + s16[2 * j + 1]);
                acc[r] -= dm * dx * (float)off;
            }
        }
    }
    for (int r = 0; r < R; r++) res[r] = acc[r];
}
#endif

/* Rows [r0, r0 + R) against output features [o0, o1). */
AI void tile(const int type, const int R, const uint8_t *w, int64_t row_bytes, const acts *a,
             int64_t r0, int64_t o0, int64_t o1, const float *bias, float *y, int64_t ys) {
    for (int64_t o = o0; o < o1; o++) {
        float res[ROW_TILE];
#if defined(QL_AVX2)
        if (BLOCK[type] == 32)
            dot_32(type, R, w + o * row_bytes, a, r0, res);
        else
            dot_k(type, R, w + o * row_bytes, a, r0, res);
#else
        dot_any(type, R, w + o * row_bytes, a, r0, res);
#endif
        const float bo = bias ? bias[o] : 0.0f;
        for (int r = 0; r < R; r++) y[(r0 + r) * ys + o] = res[r] + bo;
    }
}

AI void run_type(const int type, const uint8_t *w, int64_t n, const acts *a, int64_t rows,
                 const float *bias, float *y, int64_t ys, int threads) {
    const int64_t row_bytes = a->nb * BYTES[type], tasks = (n + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && tasks > 1)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t o0 = t * CHUNK, o1 = o0 + CHUNK < n ? o0 + CHUNK : n;
        for (int64_t r = 0; r < rows; r += ROW_TILE) {
            switch (rows - r < ROW_TILE ? rows - r : ROW_TILE) {
                case 1: tile(type, 1, w, row_bytes, a, r, o0, o1, bias, y, ys); break;
                case 2: tile(type, 2, w, row_bytes, a, r, o0, o1, bias, y, ys); break;
                case 3: tile(type, 3, w, row_bytes, a, r, o0, o1, bias, y, ys); break;
                default: tile(type, 4, w, row_bytes, a, r, o0, o1, bias, y, ys);
            }
        }
    }
}

/* y (rows, n; row stride ys) = x (rows, k; row stride xs) . W^T + bias (may be
 * NULL). Returns 0, -1 for an unknown type or k not a multiple of its block,
 * -2 when scratch memory cannot be had. */
int ql_matmul(int type, const float *x, int64_t rows, int64_t x_stride, int64_t k,
              const uint8_t *w, int64_t n, const float *bias, float *y, int64_t ys, int threads) {
    if (type < 0 || type > Q6_K || k % BLOCK[type] != 0) return -1;
    if (rows <= 0 || n <= 0) return 0;
    const int block = BLOCK[type];
    acts a = {.k = k, .nb = k / block};
    const size_t nq = (size_t)(rows * k), nd = (size_t)(rows * a.nb), n32 = (size_t)(rows * (k / 32)),
                 n16 = (size_t)(rows * (k / 16));
    char *scratch = malloc(nq + 4 * (nd + n32 + n16) + 64);
    if (!scratch) return -2;
    a.d = (float *)scratch;
    a.xs = a.d + nd;
    a.s16 = (int32_t *)(a.xs + n32);
    a.q = (int8_t *)(a.s16 + n16);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows >= 32)
    for (int64_t r = 0; r < rows; r++)
        quantize_row(x + r * x_stride, k, block, a.q + r * k, a.d + r * a.nb, a.xs + r * (k / 32),
                     a.s16 + r * (k / 16));
    switch (type) {
        case Q4_0: run_type(Q4_0, w, n, &a, rows, bias, y, ys, threads); break;
        case Q4_1: run_type(Q4_1, w, n, &a, rows, bias, y, ys, threads); break;
        case Q8_0: run_type(Q8_0, w, n, &a, rows, bias, y, ys, threads); break;
        case Q4_K: run_type(Q4_K, w, n, &a, rows, bias, y, ys, threads); break;
        case Q5_K: run_type(Q5_K, w, n, &a, rows, bias, y, ys, threads); break;
        default: run_type(Q6_K, w, n, &a, rows, bias, y, ys, threads);
    }
    free(scratch);
    return 0;
}

/* ---- dequantization: gguf.quants' float32 arithmetic -------------------- */

static void dequantize_block(int type, const uint8_t *blk, float *y) {
    switch (type) {
        case Q4_0: {
            const float d = f16(blk);
            for (int i = 0; i < 16; i++) {
                y[i] = d * (float)((blk[2 + i] & 0xF) - 8);
                y[i + 16] = d * (float)((blk[2 + i] >> 4) - 8);
            }
            break;
        }
        case Q4_1: {
            const float d = f16(blk), m = f16(blk + 2);
            for (int i = 0; i < 16; i++) {
                y[i] = d * (float)(blk[4 + i] & 0xF) + m;
                y[i + 16] = d * (float)(blk[4 + i] >> 4) + m;
            }
            break;
        }
        case Q8_0: {
            const float d = f16(blk);
            for (int i = 0; i < 32; i++) y[i] = (float)((const int8_t *)(blk + 2))[i] * d;
            break;
        }
        case Q4_K:
        case Q5_K: {
            const float d = f16(blk), dmin = f16(blk + 2);
            const uint8_t *qs = blk + (type == Q5_K ? 48 : 16), *qh = blk + 16;
            for (int j = 0; j < 4; j++) {
                int s0, m0, s1, m1;
                scale_min_k4(blk + 4, 2 * j, &s0, &m0);
                scale_min_k4(blk + 4, 2 * j + 1, &s1, &m1);
                const float d0 = d * (float)s0, dm0 = dmin * (float)m0;
                const float d1 = d * (float)s1, dm1 = dmin * (float)m1;
                for (int l = 0; l < 32; l++) {
                    int lo = qs[32 * j + l] & 0xF, hi = qs[32 * j + l] >> 4;
                    if (type == Q5_K) {
                        lo |= ((qh[l] >> (2 * j)) & 1) << 4;
                        hi |= ((qh[l] >> (2 * j + 1)) & 1) << 4;
                    }
                    y[64 * j + l] = d0 * (float)lo - dm0;
                    y[64 * j + 32 + l] = d1 * (float)hi - dm1;
                }
            }
            break;
        }
        default: { /* Q6_K */
            const float d = f16(blk + 208);
            const int8_t *s = (const int8_t *)(blk + 192);
            for (int h = 0; h < 2; h++) {
                const uint8_t *ql = blk + 64 * h, *qh = blk + 128 + 32 * h;
                for (int l = 0; l < 32; l++) {
                    const int g = 8 * h + l / 16;
                    float *o = y + 128 * h + l;
                    o[0] = (d * (float)s[g]) * (float)(((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32);
                    o[32] = (d * (float)s[g + 2]) *
                            (float)(((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
                    o[64] = (d * (float)s[g + 4]) *
                            (float)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                    o[96] = (d * (float)s[g + 6]) *
                            (float)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
                }
            }
        }
    }
}

/* out (count, k) = rows ids[i] of W (NULL ids: rows 0..count-1). Returns 0,
 * -1 for an unknown type or k, -3 for an id outside [0, n). */
int ql_dequantize_rows(int type, const uint8_t *w, int64_t n, int64_t k, const int64_t *ids,
                       int64_t count, float *out, int threads) {
    if (type < 0 || type > Q6_K || k % BLOCK[type] != 0) return -1;
    if (ids)
        for (int64_t i = 0; i < count; i++)
            if (ids[i] < 0 || ids[i] >= n) return -3;
    const int64_t nb = k / BLOCK[type], row_bytes = nb * BYTES[type];
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && count * k >= 65536)
    for (int64_t i = 0; i < count; i++) {
        const uint8_t *row = w + (ids ? ids[i] : i) * row_bytes;
        for (int64_t b = 0; b < nb; b++)
            dequantize_block(type, row + b * BYTES[type], out + i * k + b * BLOCK[type]);
    }
    return 0;
}
