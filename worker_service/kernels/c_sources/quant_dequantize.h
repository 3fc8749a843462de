/* quant_linear.c's dequantization of one block to float32: gguf.quants'
 * dequantizers' arithmetic bit for bit (the build has -ffp-contract=off:
 * no fused multiply-adds). Included by quant_linear.c after its types;
 * not a header of its own. */

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
