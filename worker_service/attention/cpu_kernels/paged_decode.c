/* Decode attention over the paged KV cache, read in place (no gather).
 *
 * One query per sequence. The cache of one layer has the layout
 * (num_pages, 2, page_size, kv_heads, head_dim): index 0 of the second axis
 * holds keys, 1 values. Position p of sequence i lives in page
 * page_ids[indptr[i] + p / page_size], slot p % page_size: page_ids is the
 * worker's page table (int32, a row per request) and indptr[i] the first cell
 * of sequence i's row, so no per-step copy of the page lists is made.
 *
 * Work is split into tasks, one per (sequence, kv head); a task serves the
 * kv head's whole group of query heads, so each key and value row is read
 * from memory once for all of them. The caller runs the task range
 * [task_begin, task_end) and may split the range across threads; a range's
 * consecutive tasks of one sequence are run side by side (decode_heads),
 * which reads the pages contiguously and gives the same results.
 *
 * paged_decode_parallel splits the tasks over OpenMP threads, in chunks of
 * about equal keys to read, taken dynamically; built with -fopenmp, it runs in torch's own OpenMP pool (the same
 * libgomp, already loaded by torch), whose threads are awake between the
 * model's matmuls, so attention neither wakes threads nor competes with
 * spinning ones. Built without, it runs the tasks in the calling thread.
 *
 * Two softmax features, off (0 and NULL) for most models: a logit soft cap
 * (Gemma 2: scores -> cap * tanh(scores / cap) before the softmax) and sinks
 * (GPT-OSS: a learned logit per query head that joins the softmax's
 * denominator and contributes no value).
 *
 * An fp8 e4m3 cache (--kv-cache-dtype fp8_e4m3) is read through a 256-entry
 * table of its values; its per-layer key scale comes folded into `scale` (the
 * scores' factor) and its value scale as `v_scale`, applied once per output
 * row with the softmax's 1 / sum.
 *
 * Plain C, called through ctypes with raw pointers; built by
 * cpu_paged_kernel.py with the host compiler. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

static inline float bf16_to_float(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(bits >> 16);
}

/* dtype codes shared with the Python side */
enum { DT_F32 = 0, DT_BF16 = 1, DT_E4M3 = 2 };

/* float8_e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0
 * is subnormal, S.1111.111 is NaN, no infinities. */
static float e4m3_values[256];

static void __attribute__((constructor)) fill_e4m3_values(void) {
    for (int i = 0; i < 256; i++) {
        const int e = (i >> 3) & 15, m = i & 7;
        float v;
        if (e == 15 && m == 7)
            v = NAN;
        else if (e == 0)
            v = ldexpf((float)m, -9);
        else
            v = ldexpf((float)(8 + m), e - 10);
        e4m3_values[i] = (i & 128) ? -v : v;
    }
}

/* 16 floats, loaded from any float address (GCC/Clang vector extensions:
 * AVX-512 registers where the CPU has them, pairs or quads of narrower ones
 * elsewhere). */
typedef float v16 __attribute__((vector_size(64), aligned(4)));

typedef float v8 __attribute__((vector_size(32), aligned(4)));

/* The kernel's vector: 16 floats where the CPU has 512-bit registers, else 8
 * (16-float vectors on a 256-bit CPU were lowered through the stack: a
 * task ran 3.2x slower with its keys in cache, 2.3x at context 300, on the
 * 2-core AVX2 machine). */
#if defined(__AVX512F__)
typedef v16 vec;
enum { VW = 16 };
#define vsum hsum
#else
typedef v8 vec;
enum { VW = 8 };
#define vsum hsum8
#endif
typedef float v4 __attribute__((vector_size(16), aligned(4)));

/* Sum of the 16 lanes as a tree of halves (a lane-by-lane loop is 15
 * dependent additions, the compiler may not reorder them). */
static inline float hsum8(v8 a) {
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

static inline __attribute__((unused)) float hsum(v16 x) {
    v8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7)
           + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* exp(x) for x <= 0 (softmax after subtracting the maximum), to within a few
 * ulp: 2^n * e^r with |r| <= ln2/2 and a degree-6 polynomial. Vectorisable,
 * unlike the C library's expf without -ffast-math. */
static inline float exp_nonpositive(float x) {
    if (x < -87.0f) return 0.0f;
    /* round to nearest by adding and removing 1.5 * 2^23 (plain arithmetic, so
     * the loop vectorises; roundf is a library call) */
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const float r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { uint32_t u; float f; } scale = {.u = (uint32_t)((int32_t)n + 127) << 23};
    return p * scale.f;
}

/* tanh(x) from exp_nonpositive, to within about 1e-7 absolute (the soft cap
 * multiplies it by the cap: well inside the scores' rounding); vectorisable,
 * unlike the C library's tanhf, which made a capped step ~1.7x slower. */
static inline float tanh_approx(float x) {
    const float e = exp_nonpositive(-2.0f * fabsf(x));
    return copysignf((1.0f - e) / (1.0f + e), x);
}

/* Row `index` of `base` as floats: in place for float32, else converted into `scratch`. */
static inline const float *float_row(float *scratch, const void *base, int64_t index, int dim,
                                     int dtype) {
    if (dtype == DT_F32) return (const float *)base + index;
    if (dtype == DT_E4M3) {
        const uint8_t *bytes = (const uint8_t *)base + index;
        for (int d = 0; d < dim; d++) scratch[d] = e4m3_values[bytes[d]];
        return scratch;
    }
    const uint16_t *src = (const uint16_t *)base + index;
#pragma omp simd
    for (int d = 0; d < dim; d++) scratch[d] = bf16_to_float(src[d]);
    return scratch;
}

enum { MAX_GROUP = 16, MAX_CHUNKS = 256 / VW }; /* head_dim up to 256 */
enum { MAX_HEADS = 4 }; /* kv heads read side by side */

/* Asks for the cache lines of the next page's rows (keys or values; `width`
 * floats of each row from `index`: the heads a pass reads) while this one is
 * read: a sequence's pages are anywhere in the pool. At context 1000 on the
 * 2-core machine the step's attention took ~8% less. */
static inline void prefetch_page(const void *cache, int64_t index, int page_size,
                                 int64_t slot_stride, int width, int dtype) {
    const int elem = dtype == DT_F32 ? 4 : (dtype == DT_E4M3 ? 1 : 2);
    const char *base = (const char *)cache + index * elem;
    const int64_t bytes = (int64_t)width * elem, stride = slot_stride * elem;
    for (int slot = 0; slot < page_size; slot++)
        for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(base + slot * stride + b, 0, 0);
}

/* The pieces of one sequence's attention, shared by the whole-task path
 * (decode_heads) and the team's pieces (paged_decode_piece): scores key by
 * key, the softmax head by head, the weighted values of each key half key by
 * key, the output head by head. A piece's result does not depend on how the
 * work is cut, so the two paths agree bit for bit. A row's scores lie at
 * scores[q_head * span + i], i the key's index in the row's span. */
typedef struct {
    int64_t len, first, span, q_row;
    const int32_t *pages;
} RowSpan;

static inline RowSpan row_span(int64_t seq, const int64_t *rows, const int64_t *lens,
                               const int64_t *indptr, const int32_t *page_ids, int heads,
                               int window) {
    RowSpan r;
    r.len = lens[seq];
    r.first = (window > 0 && r.len > window) ? r.len - window : 0;
    r.span = r.len - r.first;
    r.pages = page_ids + indptr[seq];
    r.q_row = rows[seq] * heads;
    return r;
}

/* Scores of keys [i0, i1) of the span for kv heads [kvh0, kvh0 + nh), nh <=
 * MAX_HEADS, read side by side: a page slot holds every kv head's key next
 * to each other, so the heads together read a page's keys as one contiguous
 * run, where one head alone reads short runs a stride apart (a layer's pages
 * at context 450: ~80 -> ~53 us of reads on one thread, 2-core machine). */
static inline __attribute__((always_inline)) void heads_scores(
    const int group, const int chunks, const RowSpan *r, const int kvh0, const int nh,
    const int64_t i0, const int64_t i1, const void *q, const int q_dtype, const void *cache,
    const int cache_dtype, const int page_size, const int kv_heads, const int head_dim,
    const float scale, const float soft_cap, float *scores, float *row) {
    const int64_t slot_stride = (int64_t)kv_heads * head_dim;
    const int64_t page_stride = 2 * (int64_t)page_size * slot_stride;
    const int64_t head0 = (int64_t)kvh0 * head_dim;
    vec qs[MAX_HEADS][MAX_GROUP][MAX_CHUNKS];
    for (int h = 0; h < nh; h++)
        for (int g = 0; g < group; g++) {
            const int64_t qi = (r->q_row + (int64_t)(kvh0 + h) * group + g) * head_dim;
            const float *qg = float_row(row, q, qi, head_dim, q_dtype);
            for (int c = 0; c < chunks; c++) qs[h][g][c] = *(const vec *)(qg + VW * c) * scale;
        }
    const int64_t p0 = r->first + i0, p1 = r->first + i1;
    for (int64_t pg = p0 / page_size; pg * page_size < p1; pg++) {
        const int64_t base = (int64_t)r->pages[pg] * page_stride + head0;
        const int from = pg * page_size < p0 ? (int)(p0 - pg * page_size) : 0;
        const int to = (pg + 1) * page_size <= p1 ? page_size : (int)(p1 - pg * page_size);
        if ((pg + 1) * page_size < p1)
            prefetch_page(cache, (int64_t)r->pages[pg + 1] * page_stride + head0, page_size,
                          slot_stride, nh * head_dim, cache_dtype);
        for (int slot = from; slot < to; slot++) {
            const int64_t i = pg * page_size + slot - r->first;
            for (int h = 0; h < nh; h++) {
                const float *k = float_row(row, cache, base + slot * slot_stride + h * head_dim,
                                           head_dim, cache_dtype);
                vec kc[MAX_CHUNKS];
                for (int c = 0; c < chunks; c++) kc[c] = *(const vec *)(k + VW * c);
                for (int g = 0; g < group; g++) {
                    vec dot = qs[h][g][0] * kc[0];
                    for (int c = 1; c < chunks; c++) dot += qs[h][g][c] * kc[c];
                    scores[((int64_t)(kvh0 + h) * group + g) * r->span + i] = vsum(dot);
                }
            }
        }
    }
    if (soft_cap > 0.0f) {
        const float inv_cap = 1.0f / soft_cap;
        for (int h = 0; h < nh; h++)
            for (int g = 0; g < group; g++) {
                float *sg = scores + ((int64_t)(kvh0 + h) * group + g) * r->span;
#pragma omp simd
                for (int64_t i = i0; i < i1; i++) sg[i] = soft_cap * tanh_approx(sg[i] * inv_cap);
            }
    }
}

/* Query head qh's softmax over its span's scores, in place; returns v_scale /
 * the denominator (a sink joins the maximum and the denominator). The sum
 * runs in VW lanes from the row's first key, whatever the buffer's address. */
static inline float head_softmax(float *s, const int64_t span, const float *sinks, const int qh,
                                 const float v_scale) {
    const float sink = sinks ? sinks[qh] : 0.0f;
    float m = s[0];
    for (int64_t i = 1; i < span; i++) m = s[i] > m ? s[i] : m;
    if (sinks && sink > m) m = sink;
#pragma omp simd
    for (int64_t i = 0; i < span; i++) s[i] = exp_nonpositive(s[i] - m);
    vec lanes = (vec){0};
    int64_t i = 0;
    for (; i + VW <= span; i += VW) lanes += *(const vec *)(s + i);
    float sum = vsum(lanes);
    for (; i < span; i++) sum += s[i];
    if (sinks) sum += exp_nonpositive(sink - m);
    return v_scale / sum;
}

/* The weighted values of keys [i0, i1) of the span for kv heads [kvh0, kvh0 +
 * nh), key by key in order, into part[q_head * head_dim + d]. A row's output
 * is the sum of two such parts, keys [0, span / 2) and [span / 2, span),
 * times the softmax's factor (head_output): a definition that lets two
 * threads share one row's values and stays the same however the work is
 * run. */
static inline __attribute__((always_inline)) void heads_values(
    const int group, const int chunks, const RowSpan *r, const int kvh0, const int nh,
    const int64_t i0, const int64_t i1, const void *cache, const int cache_dtype,
    const int page_size, const int kv_heads, const int head_dim, const float *scores,
    float *part, float *row) {
    const int64_t slot_stride = (int64_t)kv_heads * head_dim;
    const int64_t half_stride = (int64_t)page_size * slot_stride;
    const int64_t page_stride = 2 * half_stride;
    const int64_t head0 = (int64_t)kvh0 * head_dim;
    vec acc[MAX_HEADS][MAX_GROUP][MAX_CHUNKS];
    for (int h = 0; h < nh; h++)
        for (int g = 0; g < group; g++)
            for (int c = 0; c < chunks; c++) acc[h][g][c] = (vec){0};
    const int64_t p0 = r->first + i0, p1 = r->first + i1;
    for (int64_t pg = p0 / page_size; pg * page_size < p1; pg++) {
        const int64_t base = (int64_t)r->pages[pg] * page_stride + half_stride + head0;
        const int from = pg * page_size < p0 ? (int)(p0 - pg * page_size) : 0;
        const int to = (pg + 1) * page_size <= p1 ? page_size : (int)(p1 - pg * page_size);
        if ((pg + 1) * page_size < p1)
            prefetch_page(cache, (int64_t)r->pages[pg + 1] * page_stride + half_stride + head0,
                          page_size, slot_stride, nh * head_dim, cache_dtype);
        for (int slot = from; slot < to; slot++) {
            const int64_t i = pg * page_size + slot - r->first;
            for (int h = 0; h < nh; h++) {
                const float *v = float_row(row, cache, base + slot * slot_stride + h * head_dim,
                                           head_dim, cache_dtype);
                vec vc[MAX_CHUNKS];
                for (int c = 0; c < chunks; c++) vc[c] = *(const vec *)(v + VW * c);
                for (int g = 0; g < group; g++) {
                    const float w = scores[((int64_t)(kvh0 + h) * group + g) * r->span + i];
                    for (int c = 0; c < chunks; c++) acc[h][g][c] += w * vc[c];
                }
            }
        }
    }
    for (int h = 0; h < nh; h++)
        for (int g = 0; g < group; g++) {
            float *dst = part + (int64_t)((kvh0 + h) * group + g) * head_dim;
            for (int c = 0; c < chunks; c++) *(vec *)(dst + VW * c) = acc[h][g][c];
        }
}

/* Query head qh's output row: (lo + hi) * inv[qh], lo and hi its two parts. */
static inline void head_output(const int qh, const int chunks, const int head_dim,
                               const float *lo, const float *hi, const float *inv,
                               const int q_dtype, void *out, const int64_t q_row) {
    const int64_t o = (q_row + qh) * head_dim;
    const float *a0 = lo + (int64_t)qh * head_dim, *a1 = hi + (int64_t)qh * head_dim;
    for (int c = 0; c < chunks; c++) {
        const vec a = (*(const vec *)(a0 + VW * c) + *(const vec *)(a1 + VW * c)) * inv[qh];
        if (q_dtype == DT_F32) {
            *(vec *)((float *)out + o + VW * c) = a;
        } else {
            uint16_t *dst = (uint16_t *)out + o + VW * c;
            for (int i = 0; i < VW; i++) dst[i] = float_to_bf16(a[i]);
        }
    }
}

/* The scratch both paths use for rows of up to `len` keys: (heads, len)
 * scores, then (heads,) softmax factors, then the two key halves' (heads,
 * head_dim) weighted values. */
typedef struct {
    float *scores, *inv, *lo, *hi;
} Scratch;

int64_t paged_decode_piece_floats(int heads, int head_dim, int64_t len) {
    return (int64_t)heads * (len + 1 + 2 * (int64_t)head_dim);
}

static inline Scratch scratch_at(float *base, int heads, int head_dim, int64_t len) {
    Scratch w;
    w.scores = base;
    w.inv = base + (int64_t)heads * len;
    w.lo = w.inv + heads;
    w.hi = w.lo + (int64_t)heads * head_dim;
    return w;
}

/* The tasks (seq, kvh0) .. (seq, kvh0 + nh - 1), nh <= MAX_HEADS: those kv
 * heads of one sequence side by side, whole. */
static inline __attribute__((always_inline)) void decode_heads(
    const int group, const int chunks, const int64_t seq, const int kvh0, const int nh,
    const void *q, const int q_dtype, const void *cache, const int cache_dtype, void *out,
    const int64_t *rows, const int64_t *lens, const int64_t *indptr, const int32_t *page_ids,
    const int page_size, const int heads, const int kv_heads, const int head_dim,
    const int window, const float scale, const float soft_cap, const float v_scale,
    const float *sinks, const Scratch *w, float *row) {
    const RowSpan r = row_span(seq, rows, lens, indptr, page_ids, heads, window);
    heads_scores(group, chunks, &r, kvh0, nh, 0, r.span, q, q_dtype, cache, cache_dtype,
                 page_size, kv_heads, head_dim, scale, soft_cap, w->scores, row);
    for (int qh = kvh0 * group; qh < (kvh0 + nh) * group; qh++)
        w->inv[qh] = head_softmax(w->scores + (int64_t)qh * r.span, r.span, sinks, qh, v_scale);
    heads_values(group, chunks, &r, kvh0, nh, 0, r.span / 2, cache, cache_dtype, page_size,
                 kv_heads, head_dim, w->scores, w->lo, row);
    heads_values(group, chunks, &r, kvh0, nh, r.span / 2, r.span, cache, cache_dtype,
                 page_size, kv_heads, head_dim, w->scores, w->hi, row);
    for (int qh = kvh0 * group; qh < (kvh0 + nh) * group; qh++)
        head_output(qh, chunks, head_dim, w->lo, w->hi, w->inv, q_dtype, out, r.q_row);
}

/* CALL with G and C the (group, chunks) pair, constants for the model's own
 * shape (-DGROUP=..., -DCHUNKS=... at build time): a copy with constant loop
 * bounds, about 4x faster than the general one. */
#if defined(GROUP) && defined(CHUNKS)
#define SHAPED(G_, C_, CALL)                                                  \
    do {                                                                      \
        if ((G_) == GROUP && (C_) == CHUNKS * 16 / VW) {                      \
            const int G = GROUP, C = CHUNKS * 16 / VW;                        \
            CALL;                                                             \
        } else {                                                              \
            const int G = (G_), C = (C_);                                     \
            CALL;                                                             \
        }                                                                     \
    } while (0)
#else
#define SHAPED(G_, C_, CALL)                                                  \
    do {                                                                      \
        const int G = (G_), C = (C_);                                         \
        CALL;                                                                 \
    } while (0)
#endif

/* One piece of sequence `seq`'s attention, for a team of threads on fewer
 * rows than threads (decode_chain.c). Phase 0: the scores of keys part /
 * parts of the span; 1: the softmax of query heads part / parts; 2: the
 * weighted values of key half `part` (parts 0 and 1 only: the row's
 * definition has two halves); 3: the output rows of query heads part /
 * parts. Each phase needs the one before complete (the caller's barrier);
 * together they are decode_heads' arithmetic for every kv head, bit for bit.
 * scratch: paged_decode_piece_floats(heads, head_dim, len) floats (the
 * layout scratch_at names). Returns 0, or -2 for a shape the kernel does
 * not handle. */
int paged_decode_piece(
    const void *q, int q_dtype, const void *cache, int cache_dtype, void *out,
    const int64_t *rows, const int64_t *lens, const int64_t *indptr, const int32_t *page_ids,
    int page_size, int heads, int kv_heads, int head_dim, int window, float scale,
    float soft_cap, float v_scale, const float *sinks, int64_t seq, int phase, int part,
    int parts, float *scratch) {
    const int group = heads / kv_heads;
    const int chunks = head_dim / VW;
    if (head_dim % 16 != 0 || chunks > MAX_CHUNKS || group > MAX_GROUP || group < 1) return -2;
    const RowSpan r = row_span(seq, rows, lens, indptr, page_ids, heads, window);
    const Scratch w = scratch_at(scratch, heads, head_dim, r.len);
    float *scores = w.scores, *inv = w.inv;
    float row[256];
    const int qh0 = (int)((int64_t)heads * part / parts);
    const int qh1 = (int)((int64_t)heads * (part + 1) / parts);
    if (phase == 1) {
        for (int qh = qh0; qh < qh1; qh++)
            inv[qh] = head_softmax(scores + (int64_t)qh * r.span, r.span, sinks, qh, v_scale);
        return 0;
    }
    if (phase == 3) {
        for (int qh = qh0; qh < qh1; qh++)
            head_output(qh, chunks, head_dim, w.lo, w.hi, inv, q_dtype, out, r.q_row);
        return 0;
    }
    if (phase == 2 && part > 1) return 0;
    for (int kvh0 = 0; kvh0 < kv_heads; kvh0 += MAX_HEADS) {
        const int nh = kv_heads - kvh0 < MAX_HEADS ? kv_heads - kvh0 : MAX_HEADS;
        if (phase == 0) {
            const int64_t i0 = r.span * part / parts, i1 = r.span * (part + 1) / parts;
            SHAPED(group, chunks,
                   heads_scores(G, C, &r, kvh0, nh, i0, i1, q, q_dtype, cache, cache_dtype,
                                page_size, kv_heads, head_dim, scale, soft_cap, scores, row));
        } else {
            const int64_t i0 = part == 0 ? 0 : r.span / 2, i1 = part == 0 ? r.span / 2 : r.span;
            SHAPED(group, chunks,
                   heads_values(G, C, &r, kvh0, nh, i0, i1, cache, cache_dtype, page_size,
                                kv_heads, head_dim, scores, part == 0 ? w.lo : w.hi, row));
        }
    }
    return 0;
}

/* Returns 0; -1 when a scratch allocation fails; -2 for a shape it does not
 * handle (head_dim not a multiple of 16 or over 256, group over 16). */
int paged_decode(
    const void *q,          /* (T, heads, head_dim), dtype q_dtype */
    int q_dtype,
    const void *cache,      /* one layer: (pages, 2, page_size, kv_heads, head_dim) */
    int cache_dtype,
    void *out,              /* (T, heads, head_dim), dtype q_dtype */
    const int64_t *rows,    /* (n,) row of each sequence's query in q and out */
    const int64_t *lens,    /* (n,) keys to attend: positions [0, len) */
    const int64_t *indptr,  /* (n,) first cell of each sequence's pages in page_ids */
    const int32_t *page_ids,
    int page_size, int heads, int kv_heads, int head_dim,
    int window,             /* > 0: attend only the last `window` positions */
    float scale,
    float soft_cap,         /* > 0: scores -> soft_cap * tanh(scores / soft_cap) */
    float v_scale,          /* values x v_scale (an fp8 cache's; else 1) */
    const float *sinks,     /* (heads,) sink logits, or NULL */
    int64_t task_begin, int64_t task_end) {
    const int group = heads / kv_heads;
    const int chunks = head_dim / VW;
    if (head_dim % 16 != 0 || chunks > MAX_CHUNKS || group > MAX_GROUP || group < 1) return -2;
    int64_t max_len = 1;
    for (int64_t t = task_begin; t < task_end; t++) {
        int64_t len = lens[t / kv_heads];
        if (len > max_len) max_len = len;
    }
    float *base = malloc(sizeof(float) * (size_t)paged_decode_piece_floats(heads, head_dim, max_len));
    float *row = malloc(sizeof(float) * (size_t)head_dim);
    if (!base || !row) {
        free(base);
        free(row);
        return -1;
    }
    const Scratch w = scratch_at(base, heads, head_dim, max_len);
    /* consecutive tasks of one sequence go together, MAX_HEADS at a time */
    for (int64_t task = task_begin; task < task_end;) {
        const int64_t seq = task / kv_heads;
        const int kvh = (int)(task % kv_heads);
        int64_t nh = kv_heads - kvh;
        if (nh > task_end - task) nh = task_end - task;
        if (nh > MAX_HEADS) nh = MAX_HEADS;
        SHAPED(group, chunks,
               decode_heads(G, C, seq, kvh, (int)nh, q, q_dtype, cache, cache_dtype, out, rows,
                            lens, indptr, page_ids, page_size, heads, kv_heads, head_dim,
                            window, scale, soft_cap, v_scale, sinks, &w, row));
        task += nh;
    }
    free(base);
    free(row);
    return 0;
}

/* 1 when built with OpenMP (paged_decode_parallel uses threads), else 0. */
int paged_decode_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* First task whose cumulative cost reaches `target` (costs: keys + a constant). */
static int64_t task_at_cost(const int64_t *lens, int kv_heads, int64_t tasks, int64_t target) {
    int64_t cum = 0;
    for (int64_t t = 0; t < tasks; t++) {
        if (cum >= target) return t;
        cum += lens[t / kv_heads] + 16;
    }
    return tasks;
}

/* paged_decode over tasks [0, tasks) on up to `threads` OpenMP threads: the
 * tasks are cut into CHUNKS_PER_THREAD * threads contiguous chunks of about
 * equal cost (neighbouring rows share prefix pages: a chunk keeps them
 * together) that the threads take as they come free, so a thread that loses
 * its core for a while delays one chunk, not the step. Returns the first
 * failing status, else 0. */
enum { CHUNKS_PER_THREAD = 4 };
/* Below this many cost units (keys x kv heads, plus 16 a task) the calling
 * thread runs every task: a parallel region's hand-off (tens of microseconds
 * when the pool's threads have gone to sleep) costs more than such a batch's
 * attention (one sequence of a few hundred keys: ~20 us). */
#ifndef PARALLEL_MIN_COST
#define PARALLEL_MIN_COST 8192
#endif

int paged_decode_parallel(
    const void *q, int q_dtype, const void *cache, int cache_dtype, void *out,
    const int64_t *rows, const int64_t *lens, const int64_t *indptr, const int32_t *page_ids,
    int page_size, int heads, int kv_heads, int head_dim, int window, float scale,
    float soft_cap, float v_scale, const float *sinks, int64_t tasks, int threads) {
#ifdef _OPENMP
    int64_t total = 0;
    for (int64_t t = 0; t < tasks; t++) total += lens[t / kv_heads] + 16;
    if (threads > 1 && tasks > 1 && total >= PARALLEL_MIN_COST) {
        int64_t chunks = (int64_t)threads * CHUNKS_PER_THREAD;
        if (chunks > tasks) chunks = tasks;
        if (threads > tasks) threads = (int)tasks;
        int status = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) reduction(min : status)
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t begin = task_at_cost(lens, kv_heads, tasks, total * c / chunks);
            const int64_t end = task_at_cost(lens, kv_heads, tasks, total * (c + 1) / chunks);
            if (begin < end) {
                const int st = paged_decode(q, q_dtype, cache, cache_dtype, out, rows, lens,
                                            indptr, page_ids, page_size, heads, kv_heads,
                                            head_dim, window, scale, soft_cap, v_scale,
                                            sinks, begin, end);
                if (st < status) status = st;
            }
        }
        return status;
    }
#endif
    (void)threads;
    return paged_decode(q, q_dtype, cache, cache_dtype, out, rows, lens, indptr, page_ids,
                        page_size, heads, kv_heads, head_dim, window, scale, soft_cap, v_scale,
                        sinks, 0, tasks);
}
