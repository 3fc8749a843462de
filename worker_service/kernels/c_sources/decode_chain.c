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

#include <stdint.h>
#include <string.h>

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

/* Returns 0, or the first failing op's status (negative). */
int decode_chain(const ChainModel *m, const ChainStep *s) {
    const int64_t n = s->rows;
    const int H = m->hidden, D = m->head_dim;
    const int64_t q_width = (int64_t)m->heads * D, kv_width = (int64_t)m->kv_heads * D;
    const int64_t qkv_width = q_width + 2 * kv_width;
    const int64_t slot = kv_width, page_floats = 2 * (int64_t)m->page_size * kv_width;
    for (int i = 0; i < m->num_layers; i++) {
        const ChainLayer *L = &m->layers[i];
        int st = linear(m, &L->qkv, s->x, n, s->qkv);
        if (st != 0) return st;
        ((rope_fn)m->rope)(s->positions, n, s->qkv, qkv_width, m->heads, s->qkv + q_width,
                           qkv_width, m->kv_heads, D, s->cos_sin, m->threads_ops);
        float *cache = (float *)L->cache;
        for (int64_t t = 0; t < n; t++) {
            const float *row = s->qkv + t * qkv_width;
            float *k_dst = cache + s->write_pages[t] * page_floats + s->write_offsets[t] * slot;
            memcpy(k_dst, row + q_width, (size_t)kv_width * sizeof(float));
            memcpy(k_dst + (int64_t)m->page_size * slot, row + q_width + kv_width,
                   (size_t)kv_width * sizeof(float));
            memcpy(s->q + t * q_width, row, (size_t)q_width * sizeof(float));
        }
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
