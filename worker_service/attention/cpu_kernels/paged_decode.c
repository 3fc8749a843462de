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

#include "decode_numbers.h"

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

#include "decode_pieces.h"

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
