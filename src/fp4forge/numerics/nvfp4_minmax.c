/* NVFP4 min-max quantization of a bf16 weight in one pass per element (fp4forge.numerics.fast).
 *
 * Every float operation is the one the eager torch path (numerics/nvfp4.py, e2m1.py) performs,
 * in the same order and precision, so the bytes are identical; it must be compiled without
 * -ffast-math and with -ffp-contract=off (no fused multiply-add). The per-element code is
 * branch-free so that the compiler vectorises the 16 lanes of a block.
 */
#include <stdint.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define BLOCK 16
#define FLUSH_BLOCKS 64 /* blocks summed in F64 lanes before the totals take them */

static inline float f32_from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* bf16 nearest-even rounding of an F32 value (what storing an F32 result in a bf16 tensor does) */
static inline float round_bf16(float x) {
    uint32_t b = f32_bits(x);
    b = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
    return f32_from_bits(b);
}

/* F32 -> float8_e4m3fn bits, round to nearest even (c10's fp8e4m3fn_from_fp32_value); x in [0, 448] */
static inline uint8_t e4m3_bits(float x) {
    uint32_t f = f32_bits(x);
    const uint32_t denorm_mask = 141u << 23;
    if (f < (121u << 23)) {
        f = f32_bits(f32_from_bits(f) + f32_from_bits(denorm_mask));
        return (uint8_t)(f - denorm_mask);
    }
    uint32_t mant_odd = (f >> 20) & 1u;
    f += ((uint32_t)(7 - 127) << 23) + 0x7FFFFu;
    f += mant_odd;
    return (uint8_t)(f >> 20);
}

/* the value of positive E4M3 bits (code < 0x7F), exactly */
static float e4m3_value(uint8_t code) {
    int e = (code >> 3) & 15, m = code & 7;
    if (e == 0) return (float)m * f32_from_bits((127u - 9u) << 23); /* m * 2^-9 */
    return (float)(8 + m) * f32_from_bits((uint32_t)(127 + e - 10) << 23);
}

/* max |w| over n bf16 values, as bf16 bits (sign cleared; NaN and Inf patterns order above finite ones) */
uint16_t fp4forge_absmax_bf16(const uint16_t *w, int64_t n) {
    uint16_t lanes[BLOCK] = {0};
    int64_t i = 0;
    for (; i + BLOCK <= n; i += BLOCK)
        for (int j = 0; j < BLOCK; j++) {
            uint16_t v = w[i + j] & 0x7FFF;
            lanes[j] = v > lanes[j] ? v : lanes[j];
        }
    uint16_t m = 0;
    for (int j = 0; j < BLOCK; j++) m = lanes[j] > m ? lanes[j] : m;
    for (; i < n; i++) { uint16_t v = w[i] & 0x7FFF; m = v > m ? v : m; }
    return m;
}

/* Quantize n_blocks blocks of 16 bf16 values.
 * convention 0 (compressed-tensors): scalar = weight_global_scale g;
 *   raw = g * bf16(amax / 6), scale = e4m3(min(raw, 448)), 0 -> 0.125, step = scale / g.
 * convention 1 (ModelOpt): scalar = weight_scale_2 s2, scalar6 = 6 * s2 (F32, from the caller);
 *   raw = amax / scalar6, raw 0 -> 1, scale = e4m3(clamp(raw, 2^-9, 448)), step = scale * s2.
 * codes: e2m1(w / step) with the references' boundaries; sign iff w / step < 0.
 * With sums != 0: sums[0] += (value * step - |w|)^2, sums[1] += w^2 (F32 squares).
 * Returns 0, or 1 if some step is zero or not finite (nothing is promised then: the caller
 * quantizes that tensor by the general path). */

typedef struct {
    int convention;
    float scalar, scalar6;
    float table[128];
    double acc_err[BLOCK], acc_ref[BLOCK]; /* each F32 square added in F64, as the eager path sums */
    double total_err, total_ref;
    int64_t since_flush;
} state_t;

static void flush(state_t *st) {
    for (int j = 0; j < BLOCK; j++) {
        st->total_err += st->acc_err[j];
        st->total_ref += st->acc_ref[j];
        st->acc_err[j] = st->acc_ref[j] = 0.0;
    }
    st->since_flush = 0;
}

/* one block, scalar code (the reference the vector path follows); returns 1 if the step is irregular */
static int block_scalar(state_t *st, const uint16_t *src, uint8_t *dst, uint8_t *scale, int sums) {
    static const float E2M1[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    const float six = 6.0f, fp8_max = 448.0f, min_scale = f32_from_bits((127u - 9u) << 23);
    uint16_t amax_bits = 0;
    for (int j = 0; j < BLOCK; j++) {
        uint16_t v = src[j] & 0x7FFF;
        amax_bits = v > amax_bits ? v : amax_bits;
    }
    float amax = f32_from_bits((uint32_t)amax_bits << 16);
    uint8_t code;
    float step;
    if (st->convention == 0) {
        float raw = st->scalar * round_bf16(amax / six);
        raw = raw > fp8_max ? fp8_max : raw;
        code = e4m3_bits(raw);
        if ((code & 0x7F) == 0) code = 0x20;
        step = st->table[code] / st->scalar;
    } else {
        float raw = amax / st->scalar6;
        if (raw == 0.0f) raw = 1.0f;
        raw = raw < min_scale ? min_scale : raw;
        raw = raw > fp8_max ? fp8_max : raw;
        code = e4m3_bits(raw);
        step = st->table[code] * st->scalar;
    }
    *scale = code;
    if (!(step > 0.0f && step < f32_from_bits(0x7F800000u))) return 1;
    float x[BLOCK];
    uint8_t codes[BLOCK];
    for (int j = 0; j < BLOCK; j++) {
        x[j] = f32_from_bits((uint32_t)src[j] << 16);
        float s = x[j] / step;
        float a = s < 0.0f ? -s : s;
        int idx = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
        codes[j] = (uint8_t)(idx | ((s < 0.0f) << 3));
    }
    for (int j = 0; j < BLOCK / 2; j++) dst[j] = (uint8_t)(codes[2 * j] | (codes[2 * j + 1] << 4));
    if (sums) {
        for (int j = 0; j < BLOCK; j++) {
            float a = x[j] < 0.0f ? -x[j] : x[j];
            float d = E2M1[codes[j] & 7] * step - a;
            float d2 = d * d, a2 = a * a; /* F32 squares, as the eager path rounds them */
            st->acc_err[j] += (double)d2;
            st->acc_ref[j] += (double)a2;
        }
        if (++st->since_flush == FLUSH_BLOCKS) flush(st);
    }
    return 0;
}

#ifdef __AVX2__
/* 8 blocks: their scales by the same operations as block_scalar, 8 lanes at a time */
static int scales8(state_t *st, const uint16_t *src, uint8_t *scale, float *steps) {
    uint32_t am[8];
    const __m128i mask = _mm_set1_epi16(0x7FFF), ones = _mm_set1_epi16(-1);
    for (int i = 0; i < 8; i++) {
        __m128i lo = _mm_and_si128(_mm_loadu_si128((const __m128i *)(src + 16 * i)), mask);
        __m128i hi = _mm_and_si128(_mm_loadu_si128((const __m128i *)(src + 16 * i + 8)), mask);
        __m128i m = _mm_max_epu16(lo, hi);
        /* horizontal max of 8 uint16 = 0xFFFF - min(0xFFFF - v) */
        am[i] = 0xFFFFu - (uint32_t)(_mm_cvtsi128_si32(_mm_minpos_epu16(_mm_xor_si128(m, ones))) & 0xFFFF);
    }
    __m256i bits = _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)am), 16);
    __m256 amax = _mm256_castsi256_ps(bits);
    __m256 raw;
    const __m256 fp8_max = _mm256_set1_ps(448.0f);
    if (st->convention == 0) {
        __m256 t = _mm256_div_ps(amax, _mm256_set1_ps(6.0f));
        __m256i tb = _mm256_castps_si256(t);
        __m256i odd = _mm256_and_si256(_mm256_srli_epi32(tb, 16), _mm256_set1_epi32(1));
        tb = _mm256_add_epi32(_mm256_add_epi32(tb, _mm256_set1_epi32(0x7FFF)), odd);
        tb = _mm256_and_si256(tb, _mm256_set1_epi32((int)0xFFFF0000u));
        raw = _mm256_mul_ps(_mm256_set1_ps(st->scalar), _mm256_castsi256_ps(tb));
        raw = _mm256_min_ps(raw, fp8_max);
    } else {
        raw = _mm256_div_ps(amax, _mm256_set1_ps(st->scalar6));
        __m256 zero = _mm256_cmp_ps(raw, _mm256_setzero_ps(), _CMP_EQ_OQ);
        raw = _mm256_blendv_ps(raw, _mm256_set1_ps(1.0f), zero);
        raw = _mm256_max_ps(raw, _mm256_set1_ps(f32_from_bits((127u - 9u) << 23)));
        raw = _mm256_min_ps(raw, fp8_max);
    }
    /* e4m3_bits, both branches, then a blend */
    __m256i f = _mm256_castps_si256(raw);
    const __m256i denorm_mask = _mm256_set1_epi32((int)(141u << 23));
    __m256i r_sub = _mm256_sub_epi32(_mm256_castps_si256(_mm256_add_ps(raw, _mm256_castsi256_ps(denorm_mask))), denorm_mask);
    __m256i mant_odd = _mm256_and_si256(_mm256_srli_epi32(f, 20), _mm256_set1_epi32(1));
    __m256i r_norm = _mm256_add_epi32(f, _mm256_set1_epi32((int)(((uint32_t)(7 - 127) << 23) + 0x7FFFFu)));
    r_norm = _mm256_srli_epi32(_mm256_add_epi32(r_norm, mant_odd), 20);
    __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(121u << 23)), f);
    __m256i code = _mm256_and_si256(_mm256_blendv_epi8(r_norm, r_sub, is_sub), _mm256_set1_epi32(0xFF));
    if (st->convention == 0) {
        __m256i zero = _mm256_cmpeq_epi32(_mm256_and_si256(code, _mm256_set1_epi32(0x7F)), _mm256_setzero_si256());
        code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x20), zero);
    }
    __m256 value = _mm256_i32gather_ps(st->table, code, 4);
    __m256 step = st->convention == 0 ? _mm256_div_ps(value, _mm256_set1_ps(st->scalar)) : _mm256_mul_ps(value, _mm256_set1_ps(st->scalar));
    __m256 ok = _mm256_and_ps(_mm256_cmp_ps(step, _mm256_setzero_ps(), _CMP_GT_OQ),
                              _mm256_cmp_ps(step, _mm256_castsi256_ps(_mm256_set1_epi32(0x7F800000)), _CMP_LT_OQ));
    _mm256_storeu_ps(steps, step);
    uint32_t c32[8];
    _mm256_storeu_si256((__m256i *)c32, code);
    for (int i = 0; i < 8; i++) scale[i] = (uint8_t)c32[i];
    return _mm256_movemask_ps(ok) != 0xFF;
}

/* one block's codes (and error lanes) under a regular step */
static inline void elements16(state_t *st, const uint16_t *src, uint8_t *dst, float step_s, int sums,
                              __m256d err[4], __m256d ref[4]) {
    const __m256 step = _mm256_set1_ps(step_s);
    const __m256 sign_mask = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
    const __m256 c025 = _mm256_set1_ps(0.25f), c075 = _mm256_set1_ps(0.75f), c125 = _mm256_set1_ps(1.25f),
                 c175 = _mm256_set1_ps(1.75f), c25 = _mm256_set1_ps(2.5f), c35 = _mm256_set1_ps(3.5f), c5 = _mm256_set1_ps(5.0f);
    const __m256 grid = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
    __m256i codes[2];
    for (int h = 0; h < 2; h++) {
        __m256 x = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + 8 * h))), 16));
        __m256 s = _mm256_div_ps(x, step);
        __m256 a = _mm256_andnot_ps(sign_mask, s);
        __m256i idx = _mm256_castps_si256(_mm256_cmp_ps(a, c025, _CMP_GT_OQ));
        idx = _mm256_add_epi32(idx, _mm256_castps_si256(_mm256_cmp_ps(a, c075, _CMP_GE_OQ)));
        idx = _mm256_add_epi32(idx, _mm256_castps_si256(_mm256_cmp_ps(a, c125, _CMP_GT_OQ)));
        idx = _mm256_add_epi32(idx, _mm256_castps_si256(_mm256_cmp_ps(a, c175, _CMP_GE_OQ)));
        idx = _mm256_add_epi32(idx, _mm256_castps_si256(_mm256_cmp_ps(a, c25, _CMP_GT_OQ)));
        idx = _mm256_add_epi32(idx, _mm256_castps_si256(_mm256_cmp_ps(a, c35, _CMP_GE_OQ)));
        idx = _mm256_add_epi32(idx, _mm256_castps_si256(_mm256_cmp_ps(a, c5, _CMP_GT_OQ)));
        idx = _mm256_sub_epi32(_mm256_setzero_si256(), idx); /* the masks are -1 each */
        __m256i neg = _mm256_castps_si256(_mm256_cmp_ps(s, _mm256_setzero_ps(), _CMP_LT_OQ));
        codes[h] = _mm256_or_si256(idx, _mm256_and_si256(neg, _mm256_set1_epi32(8)));
        if (sums) {
            __m256 ax = _mm256_andnot_ps(sign_mask, x);
            __m256 d = _mm256_sub_ps(_mm256_mul_ps(_mm256_permutevar8x32_ps(grid, idx), step), ax);
            /* F32 squares, each added in F64 (4 lanes per half of the 8) */
            __m256 d2 = _mm256_mul_ps(d, d), a2 = _mm256_mul_ps(ax, ax);
            err[2 * h] = _mm256_add_pd(err[2 * h], _mm256_cvtps_pd(_mm256_castps256_ps128(d2)));
            err[2 * h + 1] = _mm256_add_pd(err[2 * h + 1], _mm256_cvtps_pd(_mm256_extractf128_ps(d2, 1)));
            ref[2 * h] = _mm256_add_pd(ref[2 * h], _mm256_cvtps_pd(_mm256_castps256_ps128(a2)));
            ref[2 * h + 1] = _mm256_add_pd(ref[2 * h + 1], _mm256_cvtps_pd(_mm256_extractf128_ps(a2, 1)));
        }
    }
    /* byte j = code[2j] | code[2j+1] << 4 */
    const __m256i shift = _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4);
    __m256i p = _mm256_hadd_epi32(_mm256_sllv_epi32(codes[0], shift), _mm256_sllv_epi32(codes[1], shift));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));
    const __m256i take = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                          0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    p = _mm256_shuffle_epi8(p, take);
    uint32_t lo = (uint32_t)_mm_cvtsi128_si32(_mm256_castsi256_si128(p));
    uint32_t hi = (uint32_t)_mm_cvtsi128_si32(_mm256_extracti128_si256(p, 1));
    memcpy(dst, &lo, 4);
    memcpy(dst + 4, &hi, 4);
    (void)st;
}
#endif

/* Quantize n_blocks blocks of 16 bf16 values.
 * convention 0 (compressed-tensors): scalar = weight_global_scale g;
 *   raw = g * bf16(amax / 6), scale = e4m3(min(raw, 448)), 0 -> 0.125, step = scale / g.
 * convention 1 (ModelOpt): scalar = weight_scale_2 s2, scalar6 = 6 * s2 (F32, from the caller);
 *   raw = amax / scalar6, raw 0 -> 1, scale = e4m3(clamp(raw, 2^-9, 448)), step = scale * s2.
 * codes: e2m1(w / step) with the references' boundaries; sign iff w / step < 0.
 * With sums != 0: sums[0] += (value * step - |w|)^2, sums[1] += w^2 (F32 squares summed in F64,
 * as the eager path sums them: the totals differ from its by summation order only, ~1e-15 relative).
 * Returns 0, or 1 if some step is zero or not finite (nothing is promised then: the caller
 * quantizes that tensor by the general path). */
int fp4forge_nvfp4_minmax_bf16(const uint16_t *w, int64_t n_blocks, int convention, float scalar, float scalar6,
                               uint8_t *packed, uint8_t *scales, double *sums) {
    state_t st;
    memset(&st, 0, sizeof st);
    st.convention = convention;
    st.scalar = scalar;
    st.scalar6 = scalar6;
    for (int c = 0; c < 127; c++) st.table[c] = e4m3_value((uint8_t)c);
    st.table[127] = 0.0f;
    int do_sums = sums != 0;
    int64_t b = 0;
#ifdef __AVX2__
    for (; b + 8 <= n_blocks; b += 8) {
        float steps[8];
        if (scales8(&st, w + b * BLOCK, scales + b, steps)) return 1;
        __m256d err[4], ref[4];
        for (int k = 0; k < 4; k++) err[k] = ref[k] = _mm256_setzero_pd();
        for (int i = 0; i < 8; i++)
            elements16(&st, w + (b + i) * BLOCK, packed + (b + i) * (BLOCK / 2), steps[i], do_sums, err, ref);
        if (do_sums) {
            double e[16], r[16];
            for (int k = 0; k < 4; k++) { _mm256_storeu_pd(e + 4 * k, err[k]); _mm256_storeu_pd(r + 4 * k, ref[k]); }
            for (int j = 0; j < BLOCK; j++) { st.total_err += e[j]; st.total_ref += r[j]; }
        }
    }
#endif
    for (; b < n_blocks; b++)
        if (block_scalar(&st, w + b * BLOCK, packed + b * (BLOCK / 2), scales + b, do_sums)) return 1;
    if (do_sums) {
        flush(&st);
        sums[0] += st.total_err;
        sums[1] += st.total_ref;
    }
    return 0;
}
