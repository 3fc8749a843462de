/* paged_decode.c's numbers: bf16 and fp8 e4m3 to float, the vector types
 * (16 floats with AVX-512, else 8), horizontal sums, exp and tanh for the
 * softmax, a row read as float32. Included by paged_decode.c; not a header
 * of its own. */

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
