/* A Llama decoder stack over a few rows in one call: the CPU decode step's
 * layers without a return to Python between ops.
 *
 * Per layer, on rows x (already normed) and the residual stream:
 *   qkv = x W_qkv^T (+ bias); RoPE on q and k in place; k and v stored into
 *   the layer's paged cache; q copied to rows of its own; paged decode
 *   attention; o = attn W_o^T; (x, residual) = add_rmsnorm(o, residual);
 *   gate_up = x W_gu^T; act = silu(gate) * up; d = act W_down^T;
 *   (x, residual) = add_rmsnorm(d, residual) with the next layer's input norm
 *   (the final norm after the last layer).
 *
 * The ops are the very C functions the Python forward calls (cpu_ops.c,
 * skinny_linear.c, quant_linear.c, paged_decode.c), reached through function
 * pointers the caller hands over, with the same arguments in the same order:
 * the result is the Python path's bit for bit. The typedefs below restate
 * those functions' signatures: change one there and here together
 * (tests/worker_service/test_cpu_decode_chain.py fails otherwise). What this saves is the Python
 * between them (module calls, argument checks, ctypes conversions, tensor
 * allocations): about 0.3 ms a layer on this machine (a one-row quantized
 * step 21.7 -> 12.1 ms over 30 layers), more than a quantized layer's
 * matmuls at one row.
 *
 * Plain C, called through ctypes; built by models/cpu_decode_chain.py. */

#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SPIN_PAUSE() _mm_pause()
#else
#define SPIN_PAUSE() ((void)0)
#endif

typedef void (*skinny_fn)(const float *x, int64_t m, int64_t k, const float *packed, int64_t n,
                          const float *bias, float *y, int threads);
typedef int (*quant_fn)(int type, const float *x, int64_t rows, int64_t x_stride, int64_t k,
                        const void *w, int64_t n, const float *bias, float *y, int64_t ys,
                        int threads);
typedef void (*add_rmsnorm_fn)(float *x, float *residual, const float *weight, int64_t rows,
                               int dim, float eps, int threads);
typedef void (*rope_fn)(const int64_t *positions, int64_t tokens, float *q, int64_t q_stride,
                        int heads, float *k, int64_t k_stride, int kv_heads, int head_dim,
                        const float *cos_sin, int threads);
typedef void (*silu_fn)(const float *gate_up, float *out, int64_t rows, int inter, int threads);
typedef int (*attn_parallel_fn)(const void *q, int q_dtype, const void *cache, int cache_dtype,
                                void *out, const int64_t *rows, const int64_t *lens,
                                const int64_t *indptr, const int32_t *page_ids, int page_size,
                                int heads, int kv_heads, int head_dim, int window, float scale,
                                float soft_cap, float v_scale, const float *sinks, int64_t tasks,
                                int threads);
typedef void (*quant_row_fn)(int block, const float *x, int64_t rows, int64_t k, int64_t r,
                             void *scratch);
typedef int (*quant_part_fn)(int type, const void *scratch, int64_t rows, int64_t k,
                             const void *w, int64_t n, int64_t o0, int64_t o1, const float *bias,
                             float *y, int64_t ys);
typedef int (*attn_piece_fn)(const void *q, int q_dtype, const void *cache, int cache_dtype,
                             void *out, const int64_t *rows, const int64_t *lens,
                             const int64_t *indptr, const int32_t *page_ids, int page_size,
                             int heads, int kv_heads, int head_dim, int window, float scale,
                             float soft_cap, float v_scale, const float *sinks, int64_t seq,
                             int phase, int part, int parts, float *scratch);
typedef int64_t (*attn_piece_floats_fn)(int heads, int head_dim, int64_t len);
typedef int (*attn_range_fn)(const void *q, int q_dtype, const void *cache, int cache_dtype,
                             void *out, const int64_t *rows, const int64_t *lens,
                             const int64_t *indptr, const int32_t *page_ids, int page_size,
                             int heads, int kv_heads, int head_dim, int window, float scale,
                             float soft_cap, float v_scale, const float *sinks,
                             int64_t task_begin, int64_t task_end);

enum { MAX_PARTS = 4, KIND_FLOAT = 0, KIND_QUANT = 1 };

typedef struct {
    int32_t kind;  /* KIND_FLOAT: skinny_linear's packed float32; KIND_QUANT: ql_matmul's blocks */
    int32_t qtype; /* ql_matmul's type code */
    const void *weight;
    int64_t out_features;
    int64_t col; /* first output column of this part */
} ChainPart;

typedef struct {
    int32_t nparts;
    int32_t bias_after; /* 1: bias added once the parts are in (the quantized path) */
    ChainPart parts[MAX_PARTS];
    const float *bias; /* NULL or (out_total,) */
    int64_t out_total;
    int64_t in_features;
} ChainLinear;

typedef struct {
    ChainLinear qkv, o, gate_up, down;
    const float *post_norm; /* post_attention_layernorm */
    const float *next_norm; /* the next layer's input_layernorm, or the final norm */
    void *cache;            /* (pages, 2, page_size, kv_heads, head_dim) float32 */
} ChainLayer;

typedef struct {
    void *skinny, *quant, *add_rmsnorm, *rope, *silu, *attn;
    int32_t attn_parallel; /* attn is paged_decode_parallel (else paged_decode over a range) */
    int32_t threads_skinny, threads_quant, threads_ops, threads_attn;
    int32_t num_layers, hidden, heads, kv_heads, head_dim, inter, page_size, window;
    float eps, scale;
    ChainLayer *layers;
    /* The team path (every projection GGUF blocks; this file built with
     * OpenMP): one parallel region for the whole stack. */
    void *quant_row, *quant_part, *attn_range;
    int32_t team;           /* threads of the region; 0: the op-by-op path */
    int32_t block_of[8];    /* quant type code -> its block (32 or 256) */
    void *attn_piece;       /* paged_decode_piece: one row's attention over the team */
    void *attn_piece_floats; /* paged_decode_piece_floats: the pieces' scratch size */
} ChainModel;

/* The per-step arguments: the rows' positions and KV slots, the attention's
 * layout (cpu_paged_kernel.DecodeLayout), RoPE's table, scratch buffers. */
typedef struct {
    int64_t rows;
    const int64_t *positions, *write_pages, *write_offsets;
    const int64_t *attn_rows, *attn_lens, *attn_indptr;
    const int32_t *page_ids;
    const float *cos_sin;
    float *x, *residual; /* (rows, hidden): normed input in, final-normed hidden out */
    float *qkv, *q, *attn_out, *gate_up, *act, *tmp;
    void *acts; /* the team path: two quant_row buffers for (rows, max(hidden, inter)) */
    int64_t acts_bytes; /* the size of one of them */
} ChainStep;

static int linear(const ChainModel *m, const ChainLinear *l, const float *x, int64_t rows,
                  float *y) {
    for (int p = 0; p < l->nparts; p++) {
        const ChainPart *part = &l->parts[p];
        if (part->kind == KIND_FLOAT) {
            /* One part only (checked when the chain is built): y is contiguous. */
            ((skinny_fn)m->skinny)(x, rows, l->in_features, (const float *)part->weight,
                                   part->out_features, l->bias_after ? NULL : l->bias, y,
                                   m->threads_skinny);
        } else {
            int st = ((quant_fn)m->quant)(part->qtype, x, rows, l->in_features, l->in_features,
                                          part->weight, part->out_features, NULL, y + part->col,
                                          l->out_total, m->threads_quant);
            if (st != 0) return st;
        }
    }
    if (l->bias_after && l->bias != NULL) {
        for (int64_t r = 0; r < rows; r++) {
            float *yr = y + r * l->out_total;
            for (int64_t c = 0; c < l->out_total; c++) yr[c] = yr[c] + l->bias[c];
        }
    }
    return 0;
}

/* Row t's k and v (after RoPE) into its slot of the layer's cache, and its q
 * into rows of its own (attention's input). */
static void store_row(const ChainModel *m, const ChainStep *s, float *cache, int64_t t) {
    const int64_t q_width = (int64_t)m->heads * m->head_dim;
    const int64_t kv_width = (int64_t)m->kv_heads * m->head_dim;
    const float *row = s->qkv + t * (q_width + 2 * kv_width);
    float *k_dst = cache + (s->write_pages[t] * 2 * m->page_size + s->write_offsets[t]) * kv_width;
    memcpy(k_dst, row + q_width, (size_t)kv_width * sizeof(float));
    memcpy(k_dst + (int64_t)m->page_size * kv_width, row + q_width + kv_width,
           (size_t)kv_width * sizeof(float));
    memcpy(s->q + t * q_width, row, (size_t)q_width * sizeof(float));
}

/* ---- the team path --------------------------------------------------------
 * The op-by-op path enters an OpenMP region per op: about 150 a step, each a
 * wake-up of the pool and a barrier, which at one row cost more than they
 * share out (a one-row step ran slower on two threads than on one). Here the
 * team enters once. Each op is split into independent pieces (output
 * features of a projection, (row, kv head) tasks of attention, rows of the
 * small ops) taken by the team's threads. Every piece is the very function
 * the op-by-op path calls, on a part of its data; no result depends on the
 * split or on which thread takes a piece, so the two paths agree bit for bit
 * (test_cpu_decode_chain.py).
 *
 * Between dependent ops there is no barrier but a phase: every thread walks
 * the same sequence of phases; in each it takes pieces from the phase's
 * counter until none is left, then waits until every piece is done (not
 * until every thread has arrived). A thread that lost its core to another
 * process (the scheduler, the API, the gateway: on a 2-core machine each
 * token wakes them all) holds up a phase only while it holds one of its
 * pieces; its partner takes the rest and goes on, and the late thread, once
 * back, finds the phases it missed done and catches up. With OpenMP's
 * barriers the partner waited at every barrier until it was back. */

typedef struct {
    _Atomic int64_t next; /* the next piece to take */
    _Atomic int64_t done; /* pieces finished */
    char pad[64 - 2 * sizeof(int64_t)];
} Phase;

typedef struct {
    Phase *phases; /* zeroed at the step's start, one per dependent op */
    int64_t count;
} Phases;

static inline int64_t take(Phase *p) {
    return atomic_fetch_add_explicit(&p->next, 1, memory_order_relaxed);
}

static inline void finish(Phase *p) {
    atomic_fetch_add_explicit(&p->done, 1, memory_order_release);
}

/* Until the phase's ``n`` pieces are done: spin a while, then yield the core
 * (the thread holding the last piece may be waiting for one). */
static void wait_done(Phase *p, int64_t n) {
    for (int spins = 0; atomic_load_explicit(&p->done, memory_order_acquire) < n; spins++) {
        if (spins < 2000) SPIN_PAUSE();
        else sched_yield();
    }
}

/* This thread's next phase (every thread calls it in the same order). */
static inline Phase *phase_at(const Phases *ph, int64_t *k) {
    return &ph->phases[*k < ph->count ? (*k)++ : ph->count - 1];
}

/* Pieces 0..n-1 of phase P, each run once by whichever thread takes it; the
 * loop's increment marks a piece done (also after a continue). */
#define PIECES(P, t, n) for (int64_t t = take(P); t < (n); finish(P), t = take(P))

enum { FEATURE_CHUNK = 16 }; /* output features a projection task takes at least */

/* The rows of x quantized (both block sizes where the linear's parts need
 * them) into acts[0] (block 32) and acts[1] (block 256): row r only. */
static void quant_rows_of(const ChainModel *m, const ChainStep *s, const ChainLinear *l,
                          const float *x, int64_t r) {
    int need32 = 0, need256 = 0;
    for (int p = 0; p < l->nparts; p++) {
        if (m->block_of[l->parts[p].qtype] == 32) need32 = 1;
        else need256 = 1;
    }
    char *acts = (char *)s->acts;
    const float *xr = x + r * l->in_features;
    if (need32) ((quant_row_fn)m->quant_row)(32, xr, s->rows, l->in_features, r, acts);
    if (need256)
        ((quant_row_fn)m->quant_row)(256, xr, s->rows, l->in_features, r, acts + s->acts_bytes);
}

/* Output features a projection task takes: whole groups of 8
 * (ql_matmul_part's unit), at least FEATURE_CHUNK; about 4 tasks a thread
 * (a thread that loses its core delays one of them, not its whole share),
 * but one a thread at one row: a one-row product walks its weights as
 * several long streams (quant_linear.c STREAMS), and short tasks cut them
 * short (a one-row step's chain 5.1-5.2 -> 4.5-4.6 ms on the 2-core
 * machine, alternating; served TPOT 9.5-9.6 -> 9.0-9.5 ms). */
static int64_t part_chunk(const ChainModel *m, const ChainPart *p, int64_t rows) {
    const int64_t per = (rows == 1 ? 1 : 4) * (m->team > 1 ? m->team : 1);
    const int64_t chunk = (p->out_features / per) & ~(int64_t)7;
    return chunk < FEATURE_CHUNK ? FEATURE_CHUNK : chunk;
}

static void set_status(int *status, int st) {
    if (st != 0) atomic_store_explicit((_Atomic int *)status, st, memory_order_relaxed);
}

/* y = x W^T (+ bias): the linear's output features over the team (x already
 * quantized), as one phase. */
static void team_linear(const ChainModel *m, const ChainStep *s, const ChainLinear *l, float *y,
                        Phase *P, int *status) {
    int64_t chunks[MAX_PARTS], counts[MAX_PARTS], total = 0;
    for (int p = 0; p < l->nparts; p++) {
        chunks[p] = part_chunk(m, &l->parts[p], s->rows);
        total += counts[p] = (l->parts[p].out_features + chunks[p] - 1) / chunks[p];
    }
    PIECES(P, t, total) {
        int p = 0;
        int64_t i = t;
        while (i >= counts[p]) i -= counts[p++];
        const ChainPart *part = &l->parts[p];
        const int64_t n = part->out_features, o0 = i * chunks[p];
        const int64_t o1 = o0 + chunks[p] < n ? o0 + chunks[p] : n;
        const void *acts = (const char *)s->acts +
                           (m->block_of[part->qtype] == 32 ? 0 : s->acts_bytes);
        const float *bias = l->bias != NULL ? l->bias + part->col : NULL;
        set_status(status, ((quant_part_fn)m->quant_part)(part->qtype, acts, s->rows,
                                                          l->in_features, part->weight, n, o0,
                                                          o1, bias, y + part->col,
                                                          l->out_total));
    }
    wait_done(P, total);
}

/* Phases a step walks: one before the layers, at most 13 a layer (4 of them
 * the one-row attention's). */
enum { PHASES_PER_LAYER = 13 };

static int decode_chain_team(const ChainModel *m, const ChainStep *s) {
    const int64_t n = s->rows;
    const int H = m->hidden, D = m->head_dim;
    const int64_t q_width = (int64_t)m->heads * D, kv_width = (int64_t)m->kv_heads * D;
    const int64_t qkv_width = q_width + 2 * kv_width;
    int status = 0;
    /* one row on a team: its attention in pieces over the team (scores by
     * keys, softmax by heads, values by key halves, outputs by heads), four
     * phases instead of one thread reading the layer's keys and values
     * alone */
    float *scratch = NULL;
    if (n == 1 && m->team > 1 && m->attn_piece != NULL) {
        const int64_t floats =
            ((attn_piece_floats_fn)m->attn_piece_floats)(m->heads, D, s->attn_lens[0]);
        scratch = malloc(sizeof(float) * (size_t)floats);
        if (scratch == NULL) return -1;
    }
    Phases ph = {NULL, 1 + (int64_t)m->num_layers * PHASES_PER_LAYER};
    ph.phases = aligned_alloc(64, sizeof(Phase) * (size_t)ph.count);
    if (ph.phases == NULL) {
        free(scratch);
        return -1;
    }
    memset(ph.phases, 0, sizeof(Phase) * (size_t)ph.count);
#pragma omp parallel num_threads(m->team)
    {
        int64_t k = 0; /* this thread's phase */
        Phase *P = phase_at(&ph, &k);
        PIECES(P, r, n) quant_rows_of(m, s, &m->layers[0].qkv, s->x, r);
        wait_done(P, n);
        for (int i = 0; i < m->num_layers; i++) {
            const ChainLayer *L = &m->layers[i];
            float *cache = (float *)L->cache;
            team_linear(m, s, &L->qkv, s->qkv, phase_at(&ph, &k), &status);
            P = phase_at(&ph, &k);
            PIECES(P, t, n) {
                float *row = s->qkv + t * qkv_width;
                ((rope_fn)m->rope)(s->positions + t, 1, row, qkv_width, m->heads, row + q_width,
                                   qkv_width, m->kv_heads, D, s->cos_sin, 1);
                store_row(m, s, cache, t);
            }
            wait_done(P, n);
            if (scratch != NULL) {
                for (int phase = 0; phase < 4; phase++) {
                    P = phase_at(&ph, &k);
                    PIECES(P, part, m->team) {
                        set_status(&status,
                                   ((attn_piece_fn)m->attn_piece)(
                                       s->q, 0, cache, 0, s->attn_out, s->attn_rows,
                                       s->attn_lens, s->attn_indptr, s->page_ids, m->page_size,
                                       m->heads, m->kv_heads, D, m->window, m->scale, 0.0f,
                                       1.0f, NULL, 0, phase, (int)part, m->team, scratch));
                    }
                    wait_done(P, m->team);
                }
            } else {
                /* a row's kv heads in one call: its pages read contiguously */
                P = phase_at(&ph, &k);
                PIECES(P, t, n) {
                    set_status(&status,
                               ((attn_range_fn)m->attn_range)(
                                   s->q, 0, cache, 0, s->attn_out, s->attn_rows, s->attn_lens,
                                   s->attn_indptr, s->page_ids, m->page_size, m->heads,
                                   m->kv_heads, D, m->window, m->scale, 0.0f, 1.0f, NULL,
                                   t * m->kv_heads, (t + 1) * m->kv_heads));
                }
                wait_done(P, n);
            }
            P = phase_at(&ph, &k);
            PIECES(P, r, n) quant_rows_of(m, s, &L->o, s->attn_out, r);
            wait_done(P, n);
            team_linear(m, s, &L->o, s->tmp, phase_at(&ph, &k), &status);
            P = phase_at(&ph, &k);
            PIECES(P, r, n) {
                ((add_rmsnorm_fn)m->add_rmsnorm)(s->tmp + r * H, s->residual + r * H,
                                                 L->post_norm, 1, H, m->eps, 1);
                quant_rows_of(m, s, &L->gate_up, s->tmp, r);
            }
            wait_done(P, n);
            team_linear(m, s, &L->gate_up, s->gate_up, phase_at(&ph, &k), &status);
            P = phase_at(&ph, &k);
            PIECES(P, r, n) {
                ((silu_fn)m->silu)(s->gate_up + r * 2 * (int64_t)m->inter,
                                   s->act + r * (int64_t)m->inter, 1, m->inter, 1);
                quant_rows_of(m, s, &L->down, s->act, r);
            }
            wait_done(P, n);
            team_linear(m, s, &L->down, s->x, phase_at(&ph, &k), &status);
            const ChainLinear *next = i + 1 < m->num_layers ? &m->layers[i + 1].qkv : NULL;
            P = phase_at(&ph, &k);
            PIECES(P, r, n) {
                ((add_rmsnorm_fn)m->add_rmsnorm)(s->x + r * H, s->residual + r * H,
                                                 L->next_norm, 1, H, m->eps, 1);
                if (next != NULL) quant_rows_of(m, s, next, s->x, r);
            }
            wait_done(P, n);
        }
    }
    free(ph.phases);
    free(scratch);
    return status;
}

/* Returns 0, or the first failing op's status (negative). */
int decode_chain(const ChainModel *m, const ChainStep *s) {
    const int64_t n = s->rows;
    const int H = m->hidden, D = m->head_dim;
    const int64_t q_width = (int64_t)m->heads * D, kv_width = (int64_t)m->kv_heads * D;
    if (m->team > 0) return decode_chain_team(m, s);
    const int64_t qkv_width = q_width + 2 * kv_width;
    for (int i = 0; i < m->num_layers; i++) {
        const ChainLayer *L = &m->layers[i];
        int st = linear(m, &L->qkv, s->x, n, s->qkv);
        if (st != 0) return st;
        ((rope_fn)m->rope)(s->positions, n, s->qkv, qkv_width, m->heads, s->qkv + q_width,
                           qkv_width, m->kv_heads, D, s->cos_sin, m->threads_ops);
        float *cache = (float *)L->cache;
        for (int64_t t = 0; t < n; t++) store_row(m, s, cache, t);
        const int64_t tasks = n * m->kv_heads;
        if (m->attn_parallel) {
            st = ((attn_parallel_fn)m->attn)(s->q, 0, cache, 0, s->attn_out, s->attn_rows,
                                             s->attn_lens, s->attn_indptr, s->page_ids,
                                             m->page_size, m->heads, m->kv_heads, D, m->window,
                                             m->scale, 0.0f, 1.0f, NULL, tasks,
                                             m->threads_attn);
        } else {
            st = ((attn_range_fn)m->attn)(s->q, 0, cache, 0, s->attn_out, s->attn_rows,
                                          s->attn_lens, s->attn_indptr, s->page_ids,
                                          m->page_size, m->heads, m->kv_heads, D, m->window,
                                          m->scale, 0.0f, 1.0f, NULL, 0, tasks);
        }
        if (st != 0) return st;
        if ((st = linear(m, &L->o, s->attn_out, n, s->tmp)) != 0) return st;
        ((add_rmsnorm_fn)m->add_rmsnorm)(s->tmp, s->residual, L->post_norm, n, H, m->eps,
                                         m->threads_ops);
        if ((st = linear(m, &L->gate_up, s->tmp, n, s->gate_up)) != 0) return st;
        ((silu_fn)m->silu)(s->gate_up, s->act, n, m->inter, m->threads_ops);
        if ((st = linear(m, &L->down, s->act, n, s->x)) != 0) return st;
        ((add_rmsnorm_fn)m->add_rmsnorm)(s->x, s->residual, L->next_norm, n, H, m->eps,
                                         m->threads_ops);
    }
    return 0;
}

/* 1 where this build has OpenMP (the team path's region has threads). */
int decode_chain_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}
