/* quant_linear.c's dot products in plain C, for CPUs without AVX2: the
 * same integer arithmetic, a block unpacked to int16 codes and per-16
 * scales. Included by quant_linear.c after its types and macros; not a
 * header of its own. */

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
