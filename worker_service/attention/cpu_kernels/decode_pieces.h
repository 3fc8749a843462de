/* paged_decode.c's pieces of one sequence's attention (scores, softmax,
 * weighted values, outputs), shared by the whole-task path and the team's
 * pieces. Included by paged_decode.c after its numbers and limits; not a
 * header of its own. */

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
