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

/* The tasks (seq, kvh0) .. (seq, kvh0 + nh - 1): nh kv heads of one sequence
 * side by side. A page's rows hold every kv head's key (then value) next to
 * each other, so reading the heads together reads each page's keys and values
 * as two contiguous runs, where one head alone reads short runs a stride
 * apart: on the 2-core machine a layer's keys and values at context 450 took
 * ~80 us per head-by-head pass and ~53 us contiguous, on one thread. Each
 * head's arithmetic is its own task's, in the same order (the dot products
 * key by key, the softmax, the weighted values key by key): the results do
 * not depend on how the tasks are grouped. Inlined into a copy per common
 * (group, chunks) pair, so those loops have constant bounds. */
enum { MAX_HEADS = 4 }; /* kv heads read together */

static inline __attribute__((always_inline)) void decode_heads(
    const int group, const int chunks, const int64_t seq, const int kvh0, const int nh,
    const void *q, const int q_dtype, const void *cache, const int cache_dtype, void *out,
    const int64_t *rows, const int64_t *lens, const int64_t *indptr, const int32_t *page_ids,
    const int page_size, const int heads, const int kv_heads, const int head_dim,
    const int window, const float scale, const float soft_cap, const float v_scale,
    const float *sinks, float *scores, float *row) {
    const int64_t slot_stride = (int64_t)kv_heads * head_dim;       /* next position in a page */
    const int64_t half_stride = (int64_t)page_size * slot_stride;   /* keys -> values */
    const int64_t page_stride = 2 * half_stride;
    vec qs[MAX_HEADS][MAX_GROUP][MAX_CHUNKS];
    vec acc[MAX_HEADS][MAX_GROUP][MAX_CHUNKS];
    float inv_sum[MAX_HEADS][MAX_GROUP];

    const int64_t len = lens[seq];
    const int64_t first = (window > 0 && len > window) ? len - window : 0;
    const int64_t span = len - first;
    const int32_t *pages = page_ids + indptr[seq];
    const int64_t q_row = rows[seq] * heads;
    const int64_t head0 = (int64_t)kvh0 * head_dim; /* the first head's offset in a row */
    const int run = nh * head_dim;                  /* the heads' floats in a row */

    for (int h = 0; h < nh; h++)
        for (int g = 0; g < group; g++) {
            const int64_t qi = (q_row + (int64_t)(kvh0 + h) * group + g) * head_dim;
            const float *qg = float_row(row, q, qi, head_dim, q_dtype);
            for (int c = 0; c < chunks; c++) qs[h][g][c] = *(const vec *)(qg + VW * c) * scale;
        }

    /* scores = scale * q . k, page by page */
    const int64_t first_page = first / page_size;
    for (int64_t pg = first_page, i = 0; pg * page_size < len; pg++) {
        const int64_t base = (int64_t)pages[pg] * page_stride + head0;
        const int from = pg == first_page ? (int)(first % page_size) : 0;
        const int to = (pg + 1) * page_size <= len ? page_size : (int)(len - pg * page_size);
        if ((pg + 1) * page_size < len)
            prefetch_page(cache, (int64_t)pages[pg + 1] * page_stride + head0, page_size,
                          slot_stride, run, cache_dtype);
        for (int slot = from; slot < to; slot++, i++) {
            for (int h = 0; h < nh; h++) {
                const float *k = float_row(row, cache, base + slot * slot_stride + h * head_dim,
                                           head_dim, cache_dtype);
                vec kc[MAX_CHUNKS];
                for (int c = 0; c < chunks; c++) kc[c] = *(const vec *)(k + VW * c);
                for (int g = 0; g < group; g++) {
                    vec dot = qs[h][g][0] * kc[0];
                    for (int c = 1; c < chunks; c++) dot += qs[h][g][c] * kc[c];
                    scores[((int64_t)h * group + g) * span + i] = vsum(dot);
                }
            }
        }
    }
    if (soft_cap > 0.0f) {
        const float inv_cap = 1.0f / soft_cap;
        const int64_t n = (int64_t)nh * group * span;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) scores[i] = soft_cap * tanh_approx(scores[i] * inv_cap);
    }
    /* softmax per query head; a sink joins the maximum and the denominator */
    for (int h = 0; h < nh; h++)
        for (int g = 0; g < group; g++) {
            float *s = scores + ((int64_t)h * group + g) * span;
            const float sink = sinks ? sinks[(kvh0 + h) * group + g] : 0.0f;
            float m = s[0];
            for (int64_t i = 1; i < span; i++) m = s[i] > m ? s[i] : m;
            if (sinks && sink > m) m = sink;
            float sum = sinks ? exp_nonpositive(sink - m) : 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t i = 0; i < span; i++) {
                s[i] = exp_nonpositive(s[i] - m);
                sum += s[i];
            }
            inv_sum[h][g] = v_scale / sum;
        }
    /* out = softmax . v */
    for (int h = 0; h < nh; h++)
        for (int g = 0; g < group; g++)
            for (int c = 0; c < chunks; c++) acc[h][g][c] = (vec){0};
    for (int64_t pg = first_page, i = 0; pg * page_size < len; pg++) {
        const int64_t base = (int64_t)pages[pg] * page_stride + half_stride + head0;
        const int from = pg == first_page ? (int)(first % page_size) : 0;
        const int to = (pg + 1) * page_size <= len ? page_size : (int)(len - pg * page_size);
        if ((pg + 1) * page_size < len)
            prefetch_page(cache, (int64_t)pages[pg + 1] * page_stride + half_stride + head0,
                          page_size, slot_stride, run, cache_dtype);
        for (int slot = from; slot < to; slot++, i++) {
            for (int h = 0; h < nh; h++) {
                const float *v = float_row(row, cache, base + slot * slot_stride + h * head_dim,
                                           head_dim, cache_dtype);
                vec vc[MAX_CHUNKS];
                for (int c = 0; c < chunks; c++) vc[c] = *(const vec *)(v + VW * c);
                for (int g = 0; g < group; g++) {
                    const float w = scores[((int64_t)h * group + g) * span + i];
                    for (int c = 0; c < chunks; c++) acc[h][g][c] += w * vc[c];
                }
            }
        }
    }
    for (int h = 0; h < nh; h++)
        for (int g = 0; g < group; g++) {
            const int64_t o = (q_row + (int64_t)(kvh0 + h) * group + g) * head_dim;
            for (int c = 0; c < chunks; c++) {
                const vec a = acc[h][g][c] * inv_sum[h][g];
                if (q_dtype == DT_F32) {
                    *(vec *)((float *)out + o + VW * c) = a;
                } else {
                    uint16_t *dst = (uint16_t *)out + o + VW * c;
                    for (int i = 0; i < VW; i++) dst[i] = float_to_bf16(a[i]);
                }
            }
        }
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
    float *scores = malloc(sizeof(float) * (size_t)(MAX_HEADS * group * max_len));
    float *row = malloc(sizeof(float) * (size_t)head_dim);
    if (!scores || !row) {
        free(scores);
        free(row);
        return -1;
    }
    /* consecutive tasks of one sequence go together, MAX_HEADS at a time */
    for (int64_t task = task_begin; task < task_end;) {
        const int64_t seq = task / kv_heads;
        const int kvh = (int)(task % kv_heads);
        int64_t nh = kv_heads - kvh;
        if (nh > task_end - task) nh = task_end - task;
        if (nh > MAX_HEADS) nh = MAX_HEADS;
#define TASK(G, C)                                                                              \
    decode_heads(G, C, seq, kvh, (int)nh, q, q_dtype, cache, cache_dtype, out, rows, lens,     \
                 indptr, page_ids, page_size, heads, kv_heads, head_dim, window, scale,        \
                 soft_cap, v_scale, sinks, scores, row)
        /* The model's own shape (-DGROUP=..., -DCHUNKS=... at build time) gets a
         * copy with constant loop bounds: about 4x faster than the general one.
         * One copy per build keeps the build near a second. */
#if defined(GROUP) && defined(CHUNKS)
        if (group == GROUP && chunks == CHUNKS * 16 / VW)
            TASK(GROUP, CHUNKS * 16 / VW);
        else
#endif
            TASK(group, chunks);
#undef TASK
        task += nh;
    }
    free(scores);
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
