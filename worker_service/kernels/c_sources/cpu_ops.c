/* The model's small per-token ops on the CPU in float32, one call each instead
 * of a handful of torch ops: residual add + RMSNorm, RMSNorm, RoPE in place,
 * SiLU-and-mul, GeGLU; and the sampler's logprobs. A decode step of the
 * default model runs about 25 such torch ops per layer, each a dispatch and
 * an allocation for a few thousand floats.
 *
 * The arithmetic follows worker_service/kernels/torch_kernels.py: RoPE and the
 * products bit for bit (built with -ffp-contract=off, so no multiply-add is
 * fused); RMSNorm's mean sums in another order and SiLU's exp is this file's,
 * both to within a few float32 ulp.
 *
 * Rows split over OpenMP threads (torch's own runtime, as in
 * attention/cpu_kernels/paged_decode.c) when there are enough of them;
 * `threads` is torch's thread count. Called through ctypes with raw pointers;
 * built by kernels/cpu_kernels.py with the host compiler. */

#include <math.h>
#include <stdint.h>

/* Below this many floats an op stays on the calling thread: waking a team
 * costs more than the work (a decode batch's rows are a few thousand floats). */
#define PARALLEL_FLOATS (1 << 16)

static inline float rms_inverse(const float *x, int dim, float eps) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int d = 0; d < dim; d++) sum += x[d] * x[d];
    return 1.0f / sqrtf(sum / (float)dim + eps);
}

/* residual += x; x = weight * rmsnorm(residual). Both (rows, dim), contiguous. */
void add_rmsnorm(float *x, float *residual, const float *weight, int64_t rows, int dim,
                 float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * dim >= PARALLEL_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * dim, *rr = residual + r * dim;
#pragma omp simd
        for (int d = 0; d < dim; d++) rr[d] = rr[d] + xr[d];
        const float inv = rms_inverse(rr, dim, eps);
#pragma omp simd
        for (int d = 0; d < dim; d++) xr[d] = weight[d] * (rr[d] * inv);
    }
}

/* out = weight * rmsnorm(x) over rows of dim floats, contiguous. */
void rmsnorm(const float *x, const float *weight, float *out, int64_t rows, int dim, float eps,
             int threads) {
#pragma omp parallel for num_threads(threads) if (rows * dim >= PARALLEL_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *o = out + r * dim;
        const float inv = rms_inverse(xr, dim, eps);
#pragma omp simd
        for (int d = 0; d < dim; d++) o[d] = weight[d] * (xr[d] * inv);
    }
}

/* Rotate-half RoPE in place. x: token t's head h starts at t * row_stride +
 * h * head_dim; cos_sin: per position, head_dim / 2 cosines then as many sines. */
static inline void rotate(float *x, const float *cs, int half) {
    const float *cos = cs, *sin = cs + half;
#pragma omp simd
    for (int d = 0; d < half; d++) {
        const float x1 = x[d], x2 = x[d + half];
        x[d] = x1 * cos[d] - x2 * sin[d];
        x[d + half] = x2 * cos[d] + x1 * sin[d];
    }
}

void rope(const int64_t *positions, int64_t tokens, float *q, int64_t q_stride, int heads,
          float *k, int64_t k_stride, int kv_heads, int head_dim, const float *cos_sin,
          int threads) {
    const int half = head_dim / 2;
#pragma omp parallel for num_threads(threads) if (tokens * (heads + kv_heads) * head_dim >= PARALLEL_FLOATS)
    for (int64_t t = 0; t < tokens; t++) {
        const float *cs = cos_sin + positions[t] * head_dim;
        for (int h = 0; h < heads; h++) rotate(q + t * q_stride + (int64_t)h * head_dim, cs, half);
        for (int h = 0; h < kv_heads; h++)
            rotate(k + t * k_stride + (int64_t)h * head_dim, cs, half);
    }
}

/* e^x to within a few ulp over float32's range (x clamped to [-104, 88.7]):
 * 2^n * e^r, |r| <= ln2 / 2, a degree-6 polynomial; vectorisable. */
static inline float exp_f32(float x) {
    x = x < -104.0f ? -104.0f : (x > 88.7f ? 88.7f : x);
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const float r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    /* 2^n in two halves: n reaches -150 below the normal range */
    const int32_t ni = (int32_t)n, a = ni / 2, b = ni - a;
    union { uint32_t u; float f; } sa = {.u = (uint32_t)(a + 127) << 23},
                                   sb = {.u = (uint32_t)(b + 127) << 23};
    return p * sa.f * sb.f;
}

/* out (rows, inter) = silu(gate) * up for gate_up (rows, 2 * inter) = [gate | up]. */
void silu_and_mul(const float *gate_up, float *out, int64_t rows, int inter, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * inter >= PARALLEL_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * (int64_t)inter, *u = g + inter;
        float *o = out + r * (int64_t)inter;
#pragma omp simd
        for (int i = 0; i < inter; i++) o[i] = g[i] / (1.0f + exp_f32(-g[i])) * u[i];
    }
}

/* out (rows, inter) = gelu_tanh(gate) * up (Gemma's GeGLU). gelu_tanh(x) =
 * x (1 + tanh(z)) / 2 with z = sqrt(2 / pi) (x + 0.044715 x^3), which is
 * x / (1 + e^(-2z)): this file's exp, no tanh (torch's 1 + tanh(z) cancels
 * where z is very negative; both are within 1e-6 of each other there). */
void gelu_tanh_and_mul(const float *gate_up, float *out, int64_t rows, int inter, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * inter >= PARALLEL_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * (int64_t)inter, *u = g + inter;
        float *o = out + r * (int64_t)inter;
#pragma omp simd
        for (int i = 0; i < inter; i++) {
            const float x = g[i];
            const float two_z = 1.5957691216057308f * (x + 0.044715f * x * x * x);
            o[i] = x / (1.0f + exp_f32(-two_z)) * u[i];
        }
    }
}

/* The sampler's logprobs (sampling/logprobs.py): for each row r of x (rows,
 * vocab; row stride xs), lse[r] = logsumexp(x[r]) and out[r, j] =
 * x[r, ids[r, j]] - lse[r] for the row's `width` ids; NaN for an id outside
 * [0, vocab). torch.logsumexp's rules at the edges: an infinite maximum is the
 * result (all -inf gives -inf, a +inf gives +inf), a NaN anywhere gives NaN.
 * The sum of exponentials goes in this file's exp and float32 lanes, so it
 * differs from torch's within a few ulp. One pass for the maximum, one for the
 * sum; a 49k vocabulary's row in a few tens of microseconds on one thread,
 * where torch's handful of ops and allocations took a few hundred. */
void token_logprobs(const float *x, int64_t rows, int64_t vocab, int64_t xs, const int64_t *ids,
                    int64_t width, float *out, float *lse, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * vocab >= PARALLEL_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * xs;
        float m = -INFINITY;
        int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
        for (int64_t i = 0; i < vocab; i++) {
            m = row[i] > m ? row[i] : m;
            nan |= row[i] != row[i];
        }
        float total;
        if (nan) {
            total = NAN;
        } else if (isinf(m)) {
            total = m;
        } else {
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int64_t i = 0; i < vocab; i++) s += exp_f32(row[i] - m);
            total = m + logf(s);
        }
        lse[r] = total;
        for (int64_t j = 0; j < width; j++) {
            const int64_t id = ids[r * width + j];
            out[r * width + j] = id >= 0 && id < vocab ? row[id] - total : NAN;
        }
    }
}

/* The sampler's draw for rows that only scale by a temperature (no top-k,
 * top-p or min-p; sampling/filters.py draw's definition): for each listed row
 * of x (row stride xs), probabilities softmax(x / t[j]), their cumulative sums
 * accumulated in double and rounded to float (torch's CPU cumsum), and the
 * first id whose cumulative mass exceeds u[j] times the total, at most the
 * last id with mass. The exponentials are this file's and the
 * double sums go by blocks of DRAW_BLOCK ids (a block's sum, then the blocks
 * in order), so a draw whose u falls within rounding of a boundary may pick
 * the neighbour of torch's token: the same distribution. Only the block
 * holding the answer is walked id by id. `scratch` holds vocab floats plus
 * vocab / DRAW_BLOCK + 1 doubles. out[j] is -1 for a row with a NaN or an
 * infinite maximum (the caller's torch ops keep their rules for those). One
 * thread: a 49k vocabulary in a few tens of microseconds, where torch's ops
 * and allocations took about 600. */
enum { DRAW_BLOCK = 64 };

int64_t temperature_draw_scratch_floats(int64_t vocab) {
    return vocab + 2 * (vocab / DRAW_BLOCK + 1) + 2;
}

void temperature_draw(const float *x, int64_t xs, int64_t vocab, const int64_t *rows, int64_t n,
                      const float *t, const float *u, float *scratch, int64_t *out) {
    const int64_t blocks = (vocab + DRAW_BLOCK - 1) / DRAW_BLOCK;
    /* the block sums, 8-byte aligned after the probabilities */
    double *bsum = (double *)(scratch + ((vocab + 1) & ~(int64_t)1));
    for (int64_t j = 0; j < n; j++) {
        const float *row = x + rows[j] * xs;
        const float tj = t[j];
        float m = -INFINITY;
        int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
        for (int64_t i = 0; i < vocab; i++) {
            const float v = row[i] / tj;
            m = v > m ? v : m;
            nan |= v != v;
        }
        if (nan || isinf(m)) {
            out[j] = -1;
            continue;
        }
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < vocab; i++) {
            const float e = exp_f32(row[i] / tj - m);
            scratch[i] = e;
            s += e;
        }
        const float inv = 1.0f / s;
        double total = 0.0;
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t end = (b + 1) * DRAW_BLOCK < vocab ? (b + 1) * DRAW_BLOCK : vocab;
            double c = 0.0;
#pragma omp simd reduction(+ : c)
            for (int64_t i = b * DRAW_BLOCK; i < end; i++) c += (double)(scratch[i] * inv);
            bsum[b] = c;
            total += c;
        }
        const float total_f = (float)total, target = u[j] * total_f;
        int64_t pick = -1;
        if (target < total_f) {
            /* the first block whose end's cumulative mass exceeds the
             * target, then ids one by one (a cumulative sum rises only at an
             * id with mass, so the id found has mass) */
            double c = 0.0;
            int64_t b = 0;
            for (; b < blocks - 1 && (float)(c + bsum[b]) <= target; b++) c += bsum[b];
            for (int64_t i = b * DRAW_BLOCK; i < vocab && pick < 0; i++) {
                c += (double)(scratch[i] * inv);
                if ((float)c > target) pick = i;
            }
        }
        if (pick < 0) {
            /* u * total rounded to the total, or past what the id-by-id
             * sums reach: the last id with mass */
            pick = vocab - 1;
            while (pick > 0 && !(scratch[pick] * inv > 0.0f)) pick--;
        }
        out[j] = pick;
    }
}
