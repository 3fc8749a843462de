/* quant_linear.c's dot products with AVX2 (and AVX-512 VNNI or AVX-VNNI
 * where the build has them): a block group's weights unpacked in registers
 * and met by the activations' int8 blocks. Included by quant_linear.c after
 * its types and macros (QL_AVX2, QL_VNNI, acts, BLOCK, BYTES, GROUP,
 * STREAMS, AI); not a header of its own. */

/* acc + sums of 4 (VNNI) or 2x2 (AVX2) products u8 x s8, as int32x8 */
AI __m256i dot_us(__m256i acc, __m256i u, __m256i s) {
#if QL_VNNI == 1
    return _mm256_dpbusd_epi32(acc, u, s);
#elif QL_VNNI == 2
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

/* Sub-block scale in the layout scaled_dot wants: int32 per lane (VNNI) or
 * int16 per lane (AVX2); lanes 0-3 / 0-7 scale the first 16 bytes. */
AI __m256i scale_pair(int a, int b) {
#if defined(QL_VNNI)
    return _mm256_setr_epi32(a, a, a, a, b, b, b, b);
#else
    return _mm256_setr_epi16(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b);
#endif
}

/* acc + (u . s per group) * scale, int32x8. maddubs cannot saturate: weight
 * codes are at most 63 and activations at most 127 in magnitude. */
AI __m256i scaled_dot(__m256i acc, __m256i u, __m256i s, __m256i scale) {
#if defined(QL_VNNI)
    return _mm256_add_epi32(acc, _mm256_mullo_epi32(dot_us(_mm256_setzero_si256(), u, s), scale));
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), scale));
#endif
}

AI __m256 fmadd(__m256 a, __m256 b, __m256 c) {
#if defined(__FMA__)
    return _mm256_fmadd_ps(a, b, c);
#else
    return _mm256_add_ps(_mm256_mul_ps(a, b), c);
#endif
}

AI float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

AI int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
    return _mm_cvtsi128_si32(s);
}

AI __m256i nibbles(const uint8_t *p) { /* 16 bytes: low nibbles, then high */
    const __m128i q = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0x0F));
}

#define LOAD(p) _mm256_loadu_si256((const __m256i *)(p))

/* One output feature (row `w` of nb 32-blocks) against R activation rows. */
AI void dot_32(const int type, const int R, const uint8_t *w, const acts *a, int64_t r0,
               float *res) {
    const int bytes = BYTES[type];
    __m256 acc[ROW_TILE];
    float accm[ROW_TILE];
    for (int r = 0; r < R; r++) {
        acc[r] = _mm256_setzero_ps();
        accm[r] = 0.0f;
    }
    for (int64_t b = 0; b < a->nb; b++) {
        const uint8_t *blk = w + b * bytes;
        const float dw = f16(blk);
        __m256i u, wv = _mm256_setzero_si256();
        /* signed codes (Q8_0, Q4_0 less its offset 8) as |w| times x with w's
         * sign, so that each lane holds the products' sum (no offset to cancel) */
        if (type == Q4_1) {
            u = nibbles(blk + 4);
        } else {
            wv = type == Q8_0 ? LOAD(blk + 2) : _mm256_sub_epi8(nibbles(blk + 2), _mm256_set1_epi8(8));
            u = _mm256_sign_epi8(wv, wv);
        }
        const float mw = type == Q4_1 ? f16(blk + 2) : 0.0f;
        for (int r = 0; r < R; r++) {
            const int64_t row = r0 + r;
            __m256i xv = LOAD(a->q + row * a->k + b * 32);
            if (type != Q4_1) xv = _mm256_sign_epi8(xv, wv);
            const __m256i p = dot_us(_mm256_setzero_si256(), u, xv);
            acc[r] = fmadd(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * a->d[row * a->nb + b]), acc[r]);
            if (type == Q4_1) accm[r] += mw * a->xs[row * a->nb + b];
        }
    }
    for (int r = 0; r < R; r++) res[r] = hsum(acc[r]) + accm[r];
}

/* One output feature of K-quant super-blocks against R activation rows. */
AI void dot_k(const int type, const int R, const uint8_t *w, const acts *a, int64_t r0,
              float *res) {
    const int bytes = BYTES[type];
    float accm[ROW_TILE] = {0};
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < a->nb; b++) {
        const uint8_t *blk = w + b * bytes;
        __m256i u[8], sc[8];
        float dw, dmin = 0.0f;
        int mins[8] = {0}, sc6[16];
        if (type == Q6_K) {
            dw = f16(blk + 208);
            const int8_t *s = (const int8_t *)(blk + 192);
            for (int h = 0; h < 2; h++) {
                const uint8_t *ql = blk + 64 * h, *qhp = blk + 128 + 32 * h;
                const __m256i l0 = LOAD(ql), l1 = LOAD(ql + 32), qh = LOAD(qhp);
                const __m256i three = _mm256_set1_epi8(3);
                const __m256i h0 = _mm256_and_si256(qh, three);
                const __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(qh, 2), three);
                const __m256i h2 = _mm256_and_si256(_mm256_srli_epi16(qh, 4), three);
                const __m256i h3 = _mm256_and_si256(_mm256_srli_epi16(qh, 6), three);
                u[4 * h + 0] = _mm256_or_si256(_mm256_and_si256(l0, low), _mm256_slli_epi16(h0, 4));
                u[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, low), _mm256_slli_epi16(h1, 4));
                u[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low),
                                               _mm256_slli_epi16(h2, 4));
                u[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low),
                                               _mm256_slli_epi16(h3, 4));
            }
            for (int v = 0; v < 8; v++) sc[v] = scale_pair(s[2 * v], s[2 * v + 1]);
            for (int j = 0; j < 16; j++) sc6[j] = s[j];
        } else {
            dw = f16(blk);
            dmin = f16(blk + 2);
            const uint8_t *qs = blk + (type == Q5_K ? 48 : 16);
            __m256i hb = type == Q5_K ? LOAD(blk + 16) : _mm256_setzero_si256();
            for (int j = 0; j < 4; j++) {
                const __m256i q = LOAD(qs + 32 * j);
                u[2 * j] = _mm256_and_si256(q, low);
                u[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
            }
            if (type == Q5_K) {
                const __m256i bit4 = _mm256_set1_epi8(0x10);
                for (int j = 0; j < 8; j++) {
                    u[j] = _mm256_or_si256(u[j], _mm256_and_si256(_mm256_slli_epi16(hb, 4), bit4));
                    hb = _mm256_srli_epi16(hb, 1);
                }
            }
            for (int j = 0; j < 8; j++) {
                int s, m;
                scale_min_k4(blk + 4, j, &s, &m);
                sc[j] = scale_pair(s, s);
                mins[j] = m;
            }
        }
        for (int r = 0; r < R; r++) {
            const int64_t row = r0 + r;
            const int8_t *x = a->q + row * a->k + b * 256;
            const int32_t *s16 = a->s16 + row * (a->k / 16) + b * 16;
            __m256i isum = _mm256_setzero_si256();
            for (int v = 0; v < 8; v++) isum = scaled_dot(isum, u[v], LOAD(x + 32 * v), sc[v]);
            /* the super-block's integer total: the Q6_K offset cancels in integers */
            int32_t total = hsum_i32(isum), off = 0;
            if (type == Q6_K) {
                for (int j = 0; j < 16; j++) off += sc6[j] * s16[j];
                total -= 32 * off;
            }
            accm[r] += dw * a->d[row * a->nb + b] * (float)total;
            if (type != Q6_K) {
                for (int j = 0; j < 8; j++) off += mins[j] * (s16[2 * j] + s16[2 * j + 1]);
                accm[r] -= dmin * a->d[row * a->nb + b] * (float)off;
            }
        }
    }
    for (int r = 0; r < R; r++) res[r] = accm[r];
}

AI __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* The integer sums of one weight block of a group (g: its scales, then its
 * codes; see "layout") against R rows' activation blocks x[r] (xu[r]: the
 * same + 128, VNNI's Q8_0 only): isum[r], one lane a feature. */
AI void block_isums(const int type, const int R, const uint8_t *g, const int8_t *const *x,
                    const uint8_t *const *xu, __m256i *isum) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    /* chunk by chunk, each unpacked chunk meeting every row: few live
     * registers (two accumulators a row), no spills */
    __m256i s0[ROW_TILE], s1[ROW_TILE];
    for (int r = 0; r < R; r++) s0[r] = s1[r] = _mm256_setzero_si256();
    if (type == Q8_0 && xu[0] != NULL) {
        /* VNNI: x + 128 (unsigned) times the signed codes, less 128 * sum(w)
         * per row (the sums by the same instruction, once per weight chunk) */
        const uint8_t *codes = g + 16;
        const __m256i ones = _mm256_set1_epi8(1);
        __m256i wsum = _mm256_setzero_si256();
        for (int c = 0; c < 8; c += 2) {
            const __m256i w0 = LOAD(codes + 32 * c), w1 = LOAD(codes + 32 * c + 32);
            wsum = dot_us(dot_us(wsum, ones, w0), ones, w1);
            for (int r = 0; r < R; r++) {
                s0[r] = dot_us(s0[r], bcast4((const int8_t *)xu[r] + 4 * c), w0);
                s1[r] = dot_us(s1[r], bcast4((const int8_t *)xu[r] + 4 * c + 4), w1);
            }
        }
        const __m256i offset = _mm256_slli_epi32(wsum, 7);
        for (int r = 0; r < R; r++) s0[r] = _mm256_sub_epi32(s0[r], offset);
    } else if (type == Q8_0) {
        const uint8_t *codes = g + 16;
        for (int c = 0; c < 8; c += 2) {
            const __m256i w0 = LOAD(codes + 32 * c), w1 = LOAD(codes + 32 * c + 32);
            const __m256i u0 = _mm256_sign_epi8(w0, w0), u1 = _mm256_sign_epi8(w1, w1);
            for (int r = 0; r < R; r++) {
                s0[r] = dot_us(s0[r], u0, _mm256_sign_epi8(bcast4(x[r] + 4 * c), w0));
                s1[r] = dot_us(s1[r], u1, _mm256_sign_epi8(bcast4(x[r] + 4 * c + 4), w1));
            }
        }
    } else {
        const uint8_t *codes = g + (type == Q4_1 ? 32 : 16);
#if defined(QL_VNNI)
        for (int c = 0; c < 4; c++) {
            const __m256i q = LOAD(codes + 32 * c);
            const __m256i lo = _mm256_and_si256(q, low);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
            for (int r = 0; r < R; r++) {
                s0[r] = dot_us(s0[r], lo, bcast4(x[r] + 4 * c));
                s1[r] = dot_us(s1[r], hi, bcast4(x[r] + 16 + 4 * c));
            }
        }
#else
        /* AVX2: the block's eight maddubs pair sums add up in int16 and
         * widen once. Exact: a pair is at most 2 * 15 * 127 = 3810 in
         * magnitude, eight of them 30480 < 32767. */
        __m256i p16[ROW_TILE];
        for (int r = 0; r < R; r++) p16[r] = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            const __m256i q = LOAD(codes + 32 * c);
            const __m256i lo = _mm256_and_si256(q, low);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
            for (int r = 0; r < R; r++) {
                p16[r] = _mm256_add_epi16(p16[r], _mm256_maddubs_epi16(lo, bcast4(x[r] + 4 * c)));
                p16[r] = _mm256_add_epi16(p16[r], _mm256_maddubs_epi16(hi, bcast4(x[r] + 16 + 4 * c)));
            }
        }
        for (int r = 0; r < R; r++) s0[r] = _mm256_madd_epi16(p16[r], _mm256_set1_epi16(1));
#endif
    }
    for (int r = 0; r < R; r++) isum[r] = _mm256_add_epi32(s0[r], s1[r]);
}

/* NG groups of GROUP output features each (interleaved, see "layout") against
 * R activation rows, block by block in step: res[j * R + r] is group j's 8
 * features for row r. Several groups at once are several weight streams
 * (STREAMS): one core reading one sequential stream got ~15 GB/s here, four
 * ~26, and a one-row product is that stream and little else. Each feature's
 * arithmetic does not depend on NG. */
AI void group_32(const int type, const int R, const int NG, const uint8_t *const *gs,
                 const acts *a, int64_t r0, __m256 *res) {
    const int bytes = BYTES[type];
    __m256 acc[ROW_TILE * STREAMS], accm[ROW_TILE * STREAMS];
    for (int i = 0; i < R * NG; i++) acc[i] = accm[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a->nb; b++) {
        const int8_t *x[ROW_TILE];
        const uint8_t *xu[ROW_TILE];
        for (int r = 0; r < R; r++) {
            x[r] = a->q + (r0 + r) * a->k + b * 32;
            xu[r] = a->qu ? a->qu + (r0 + r) * a->k + b * 32 : NULL;
        }
        for (int j = 0; j < NG; j++) {
            const uint8_t *g = gs[j] + b * GROUP * bytes;
            /* past the task's last group it reads the next group's first blocks
             * (or nothing: a prefetch never faults) */
            for (int l = 0; l < GROUP * bytes; l += 64)
                __builtin_prefetch(g + PREFETCH_BLOCKS * GROUP * bytes + l);
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));
            __m256i isums[ROW_TILE];
            block_isums(type, R, g, x, xu, isums);
            const __m256 mw = type == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 16)))
                                           : _mm256_setzero_ps();
            for (int r = 0; r < R; r++) {
                const int64_t row = r0 + r;
                __m256i isum = isums[r];
                if (type == Q4_0) { /* codes - 8, in integers */
                    const int32_t *s16 = a->s16 + row * (a->k / 16) + 2 * b;
                    isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(8 * (s16[0] + s16[1])));
                }
                const __m256 dd = _mm256_mul_ps(dw, _mm256_set1_ps(a->d[row * a->nb + b]));
                acc[j * R + r] = fmadd(_mm256_cvtepi32_ps(isum), dd, acc[j * R + r]);
                if (type == Q4_1)
                    accm[j * R + r] = fmadd(mw, _mm256_set1_ps(a->xs[row * a->nb + b]), accm[j * R + r]);
            }
        }
    }
    for (int i = 0; i < R * NG; i++) res[i] = _mm256_add_ps(acc[i], accm[i]);
}

/* Stores group results res[j * R + r] (+ bias) at features os[j]. */
AI void store_groups(const int R, const int NG, const __m256 *res, const int64_t *os,
                     const float *bias, float *y, int64_t ys, int64_t r0) {
    for (int j = 0; j < NG; j++) {
        const __m256 bv = bias ? _mm256_loadu_ps(bias + os[j]) : _mm256_setzero_ps();
        for (int r = 0; r < R; r++)
            _mm256_storeu_ps(y + (r0 + r) * ys + os[j], _mm256_add_ps(res[j * R + r], bv));
    }
}
