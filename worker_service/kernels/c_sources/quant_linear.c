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

AI __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* The integer sums of one weight block of a group (g: its scales, then its
 * codes; see "layout") against R rows' activation blocks x[r] (xu[r]: the
 * same + 128, VNNI's Q8_0 only): isum[r], one lane a feature. */
AI void block_isums(const int type, const int R, const uint8_t *g, const int8_t *const *x,
                    const uint8_t *const *xu, __m256i *isum) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    /* chunk by chunk, each unpacked chunk meeting every row: few live
     * registers (two accumulators a row), no spills */
    __m256i s0[ROW_TILE], s1[ROW_TILE];
    for (int r = 0; r < R; r++) s0[r] = s1[r] = _mm256_setzero_si256();
    if (type == Q8_0 && xu[0] != NULL) {
        /* VNNI: x + 128 (unsigned) times the signed codes, less 128 * sum(w)
         * per row (the sums by the same instruction, once per weight chunk) */
        const uint8_t *codes = g + 16;
        const __m256i ones = _mm256_set1_epi8(1);
        __m256i wsum = _mm256_setzero_si256();
        for (int c = 0; c < 8; c += 2) {
            const __m256i w0 = LOAD(codes + 32 * c), w1 = LOAD(codes + 32 * c + 32);
            wsum = dot_us(dot_us(wsum, ones, w0), ones, w1);
            for (int r = 0; r < R; r++) {
                s0[r] = dot_us(s0[r], bcast4((const int8_t *)xu[r] + 4 * c), w0);
                s1[r] = dot_us(s1[r], bcast4((const int8_t *)xu[r] + 4 * c + 4), w1);
            }
        }
        const __m256i offset = _mm256_slli_epi32(wsum, 7);
        for (int r = 0; r < R; r++) s0[r] = _mm256_sub_epi32(s0[r], offset);
    } else if (type == Q8_0) {
        const uint8_t *codes = g + 16;
        for (int c = 0; c < 8; c += 2) {
            const __m256i w0 = LOAD(codes + 32 * c), w1 = LOAD(codes + 32 * c + 32);
            const __m256i u0 = _mm256_sign_epi8(w0, w0), u1 = _mm256_sign_epi8(w1, w1);
            for (int r = 0; r < R; r++) {
                s0[r] = dot_us(s0[r], u0, _mm256_sign_epi8(bcast4(x[r] + 4 * c), w0));
                s1[r] = dot_us(s1[r], u1, _mm256_sign_epi8(bcast4(x[r] + 4 * c + 4), w1));
            }
        }
    } else {
        const uint8_t *codes = g + (type == Q4_1 ? 32 : 16);
#if defined(QL_VNNI)
        for (int c = 0; c < 4; c++) {
            const __m256i q = LOAD(codes + 32 * c);
            const __m256i lo = _mm256_and_si256(q, low);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
            for (int r = 0; r < R; r++) {
                s0[r] = dot_us(s0[r], lo, bcast4(x[r] + 4 * c));
                s1[r] = dot_us(s1[r], hi, bcast4(x[r] + 16 + 4 * c));
            }
        }
#else
        /* AVX2: the block's eight maddubs pair sums add up in int16 and
         * widen once. Exact: a pair is at most 2 * 15 * 127 = 3810 in
         * magnitude, eight of them 30480 < 32767. */
        __m256i p16[ROW_TILE];
        for (int r = 0; r < R; r++) p16[r] = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            const __m256i q = LOAD(codes + 32 * c);
            const __m256i lo = _mm256_and_si256(q, low);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
            for (int r = 0; r < R; r++) {
                p16[r] = _mm256_add_epi16(p16[r], _mm256_maddubs_epi16(lo, bcast4(x[r] + 4 * c)));
                p16[r] = _mm256_add_epi16(p16[r], _mm256_maddubs_epi16(hi, bcast4(x[r] + 16 + 4 * c)));
            }
        }
        for (int r = 0; r < R; r++) s0[r] = _mm256_madd_epi16(p16[r], _mm256_set1_epi16(1));
#endif
    }
    for (int r = 0; r < R; r++) isum[r] = _mm256_add_epi32(s0[r], s1[r]);
}

/* NG groups of GROUP output features each (interleaved, see "layout") against
 * R activation rows, block by block in step: res[j * R + r] is group j's 8
 * features for row r. Several groups at once are several weight streams
 * (STREAMS): one core reading one sequential stream got ~15 GB/s here, four
 * ~26, and a one-row product is that stream and little else. Each feature's
 * arithmetic does not depend on NG. */
AI void group_32(const int type, const int R, const int NG, const uint8_t *const *gs,
                 const acts *a, int64_t r0, __m256 *res) {
    const int bytes = BYTES[type];
    __m256 acc[ROW_TILE * STREAMS], accm[ROW_TILE * STREAMS];
    for (int i = 0; i < R * NG; i++) acc[i] = accm[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a->nb; b++) {
        const int8_t *x[ROW_TILE];
        const uint8_t *xu[ROW_TILE];
        for (int r = 0; r < R; r++) {
            x[r] = a->q + (r0 + r) * a->k + b * 32;
            xu[r] = a->qu ? a->qu + (r0 + r) * a->k + b * 32 : NULL;
        }
        for (int j = 0; j < NG; j++) {
            const uint8_t *g = gs[j] + b * GROUP * bytes;
            /* past the task's last group it reads the next group's first blocks
             * (or nothing: a prefetch never faults) */
            for (int l = 0; l < GROUP * bytes; l += 64)
                __builtin_prefetch(g + PREFETCH_BLOCKS * GROUP * bytes + l);
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));
            __m256i isums[ROW_TILE];
            block_isums(type, R, g, x, xu, isums);
            const __m256 mw = type == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 16)))
                                           : _mm256_setzero_ps();
            for (int r = 0; r < R; r++) {
                const int64_t row = r0 + r;
                __m256i isum = isums[r];
                if (type == Q4_0) { /* codes - 8, in integers */
                    const int32_t *s16 = a->s16 + row * (a->k / 16) + 2 * b;
                    isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(8 * (s16[0] + s16[1])));
                }
                const __m256 dd = _mm256_mul_ps(dw, _mm256_set1_ps(a->d[row * a->nb + b]));
                acc[j * R + r] = fmadd(_mm256_cvtepi32_ps(isum), dd, acc[j * R + r]);
                if (type == Q4_1)
                    accm[j * R + r] = fmadd(mw, _mm256_set1_ps(a->xs[row * a->nb + b]), accm[j * R + r]);
            }
        }
    }
    for (int i = 0; i < R * NG; i++) res[i] = _mm256_add_ps(acc[i], accm[i]);
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

AI void dot_any(const int type, const int R, const uint8_t *w, int64_t n, int64_t o,
                const acts *a, int64_t r0, float *res) {
    const int block = BLOCK[type];
    uint8_t tmp[34];
    int16_t q[256];
    int sc16[16], mins[8];
    float acc[ROW_TILE] = {0};
    for (int64_t b = 0; b < a->nb; b++) {
        float dw, dm;
        unpack_block(type, block_of(type, w, n, a->nb, o, b, tmp), q, sc16, mins, &dw, &dm);
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

#if defined(QL_AVX2)
/* Stores group results res[j * R + r] (+ bias) at features os[j]. */
AI void store_groups(const int R, const int NG, const __m256 *res, const int64_t *os,
                     const float *bias, float *y, int64_t ys, int64_t r0) {
    for (int j = 0; j < NG; j++) {
        const __m256 bv = bias ? _mm256_loadu_ps(bias + os[j]) : _mm256_setzero_ps();
        for (int r = 0; r < R; r++)
            _mm256_storeu_ps(y + (r0 + r) * ys + os[j], _mm256_add_ps(res[j * R + r], bv));
    }
}
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
