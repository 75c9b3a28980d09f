/* The small vector layer hvdc_kernels.c writes its loops over, once for every
 * instruction set: AVX-512 (16 float lanes), AVX2 (8 lanes), and plain C (8 lanes
 * in arrays the compiler may vectorise; what a CPU without AVX2 runs, and what
 * tests/unit/test_kernels.py builds with -mno-avx2 -mno-avx512f to compare).
 *
 *   vf       VW floats                 vload, vstore, vstream, vset1, vzero, vadd, vsub, vmul, vdiv,
 *                                      vabs, vmin, vmax, vround_even, vfloor, vkeep_finite,
 *                                      vbf16_value (the float of a's bfloat16, round half to even),
 *                                      vreduce_add, vreduce_max
 *   vmask    a compare's result        vcmp_ge, vcmp_gt, visnan, vselect, vbits (lane k -> bit k),
 *                                      vmask_from_bits
 *   vhalf    VW IEEE halves            vto_half, vfrom_half, vstore_half
 *   vjoin_bytes, vjoin_bytes4          VW (4 VW) floats put together from four byte planes:
 *                                      byte k (little-endian) of float i from p[k stride + i]
 *   vsplit_bytes4                      the inverse: 4 VW floats into four byte planes
 *   vcompress_store                    the lanes of a mask and their positions, packed
 *   vcompress_i64                      the int64 entries of a mask, packed
 *   bit_positions                      the positions of a 64-bit word's set bits
 *   set_bits8                          eight ascending bits of a bit array set
 *   pack_low8                          eight indices' low bits side by side
 *
 * Every float operation rounds as its scalar C form does (no FMA, no reassociation), so
 * a kernel gives the same bits on every layer; only the reductions' lane counts differ
 * (16 under AVX-512, 8 otherwise).  vmin / vmax keep the x86 rule in all three: the
 * second operand where either is NaN.  The *_n forms read or write the first len lanes
 * (0 < len <= VW; the others read as 0), for the last part of an array: each kernel's
 * step is one inline function called with VW in its loop (the test folds away) and
 * with the remainder once.
 *
 * Private to hvdc_kernels.c (no exported names).
 */
#ifndef HVDC_SIMD_H
#define HVDC_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define HVDC_INLINE static inline __attribute__((always_inline))

static inline int is_finite(float v) { return (v - v) == 0.0f; } /* false for NaN and +-Inf */
static inline float keep_finite(float v) { return is_finite(v) ? v : 0.0f; }

#if defined(__AVX512F__) /* ------------------------------------------------------------ */
#define VW 16
typedef __m512 vf;
typedef __mmask16 vmask;
typedef __m256i vhalf;

HVDC_INLINE __mmask16 lanes_(int len) { return (__mmask16)(len >= 16 ? 0xFFFFu : (1u << len) - 1u); }
HVDC_INLINE vf vload(const float *p) { return _mm512_loadu_ps(p); }
HVDC_INLINE void vstore(float *p, vf v) { _mm512_storeu_ps(p, v); }
HVDC_INLINE vf vload_partial(const float *p, int len) { return _mm512_maskz_loadu_ps(lanes_(len), p); }
HVDC_INLINE void vstore_partial(float *p, vf v, int len) { _mm512_mask_storeu_ps(p, lanes_(len), v); }
HVDC_INLINE void vstream(float *p, vf v) { _mm512_stream_ps(p, v); }
HVDC_INLINE vf vset1(float a) { return _mm512_set1_ps(a); }
HVDC_INLINE vf vzero(void) { return _mm512_setzero_ps(); }
HVDC_INLINE vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
HVDC_INLINE vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
HVDC_INLINE vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
HVDC_INLINE vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
HVDC_INLINE vf vabs(vf a) { return _mm512_abs_ps(a); }
HVDC_INLINE vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
HVDC_INLINE vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
HVDC_INLINE vf vround_even(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
HVDC_INLINE vf vfloor(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
HVDC_INLINE vmask vcmp_ge(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
HVDC_INLINE vmask vcmp_gt(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
HVDC_INLINE vmask visnan(vf a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
HVDC_INLINE vf vselect(vmask m, vf if_set, vf if_clear) { return _mm512_mask_blend_ps(m, if_clear, if_set); }
HVDC_INLINE unsigned vbits(vmask m) { return (unsigned)m; }
HVDC_INLINE vmask vmask_from_bits(unsigned b) { return (vmask)b; }
HVDC_INLINE vf vkeep_finite(vf e) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(_mm512_sub_ps(e, e), _mm512_setzero_ps(), _CMP_EQ_OQ), e);
}
/* float(bfloat16(a)): round half to even as to_bf16; a NaN stays a NaN */
HVDC_INLINE vf vbf16_value(vf a) {
    const __m512i u = _mm512_castps_si512(a);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb)),
                                       _mm512_set1_epi32((int)0xFFFF0000u));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), _mm512_castsi512_ps(r), a);
}
HVDC_INLINE float vreduce_add(vf a) { return _mm512_reduce_add_ps(a); }
HVDC_INLINE float vreduce_max(vf a) { return _mm512_reduce_max_ps(a); }
/* q = (int8_t)v for the first len lanes, v integral and within int8 */
HVDC_INLINE void vstore_i8_n(int8_t *q, vf v, int len) {
    __m512i i = _mm512_cvtps_epi32(v);
    if (len == VW) _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(i));
    else _mm512_mask_cvtepi32_storeu_epi8(q, lanes_(len), i);
}
/* the lanes of a set in take, and base + their lane numbers, packed to the front of val and idx
 * (VW lanes written: room for VW at both); returns how many.  Compressed in a register and
 * stored whole: a compressing store to memory is microcoded and slow on some CPUs (AMD Zen 4). */
HVDC_INLINE int vcompress_store(float *val, int32_t *idx, unsigned take, vf a, int32_t base) {
    const __mmask16 m = (__mmask16)take;
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    _mm512_storeu_ps(val, _mm512_maskz_compress_ps(m, a));
    _mm512_storeu_si512((void *)idx, _mm512_maskz_compress_epi32(m, _mm512_add_epi32(_mm512_set1_epi32(base), lane)));
    return __builtin_popcount(take);
}
/* the entries of src[0..VW) whose bit is set in take, packed to the front of dst (VW written: room
 * for VW); returns how many.  Two 8-lane halves compressed in registers. */
HVDC_INLINE int vcompress_i64(int64_t *dst, const int64_t *src, unsigned take) {
    const __mmask8 lo = (__mmask8)take, hi = (__mmask8)(take >> 8);
    const int nlo = __builtin_popcount(lo);
    _mm512_storeu_si512((void *)dst, _mm512_maskz_compress_epi64(lo, _mm512_loadu_si512((const void *)src)));
    _mm512_storeu_si512((void *)(dst + nlo), _mm512_maskz_compress_epi64(hi, _mm512_loadu_si512((const void *)(src + 8))));
    return nlo + __builtin_popcount(hi);
}
HVDC_INLINE vhalf vto_half(vf a) { return _mm512_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
HVDC_INLINE vf vfrom_half(vhalf h) { return _mm512_cvtph_ps(h); }
HVDC_INLINE void vstore_half_(void *p, vhalf h) { _mm256_storeu_si256((__m256i *)p, h); }
HVDC_INLINE __m512i join_plane_(const uint8_t *p, int shift) {
    return _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)), shift);
}
HVDC_INLINE vf vjoin_bytes(const uint8_t *p, int64_t stride) {
    const __m512i lo = _mm512_or_si512(join_plane_(p, 0), join_plane_(p + stride, 8));
    return _mm512_castsi512_ps(_mm512_or_si512(lo, _mm512_or_si512(join_plane_(p + 2 * stride, 16),
                                                                   join_plane_(p + 3 * stride, 24))));
}
#if defined(__AVX512BW__)
#define HVDC_BYTE_PLANES4
/* the 4 x 4 transpose of the 128-bit lanes of a, b, c, d */
HVDC_INLINE void transpose_lanes_(__m512i *a, __m512i *b, __m512i *c, __m512i *d) {
    const __m512i u0 = _mm512_shuffle_i32x4(*a, *b, 0x44), u1 = _mm512_shuffle_i32x4(*a, *b, 0xEE);
    const __m512i u2 = _mm512_shuffle_i32x4(*c, *d, 0x44), u3 = _mm512_shuffle_i32x4(*c, *d, 0xEE);
    *a = _mm512_shuffle_i32x4(u0, u2, 0x88), *b = _mm512_shuffle_i32x4(u0, u2, 0xDD);
    *c = _mm512_shuffle_i32x4(u1, u3, 0x88), *d = _mm512_shuffle_i32x4(u1, u3, 0xDD);
}
HVDC_INLINE void vjoin_bytes4(const uint8_t *p, int64_t stride, vf v[4]) {
    const __m512i a0 = _mm512_loadu_si512(p), a1 = _mm512_loadu_si512(p + stride);
    const __m512i a2 = _mm512_loadu_si512(p + 2 * stride), a3 = _mm512_loadu_si512(p + 3 * stride);
    const __m512i t0 = _mm512_unpacklo_epi8(a0, a1), t1 = _mm512_unpackhi_epi8(a0, a1);
    const __m512i t2 = _mm512_unpacklo_epi8(a2, a3), t3 = _mm512_unpackhi_epi8(a2, a3);
    /* lane L of w_j: the floats 16 L + 4 j .. 16 L + 4 j + 3 */
    __m512i w0 = _mm512_unpacklo_epi16(t0, t2), w1 = _mm512_unpackhi_epi16(t0, t2);
    __m512i w2 = _mm512_unpacklo_epi16(t1, t3), w3 = _mm512_unpackhi_epi16(t1, t3);
    transpose_lanes_(&w0, &w1, &w2, &w3);
    v[0] = _mm512_castsi512_ps(w0), v[1] = _mm512_castsi512_ps(w1);
    v[2] = _mm512_castsi512_ps(w2), v[3] = _mm512_castsi512_ps(w3);
}
HVDC_INLINE void vsplit_bytes4(const float *x, uint8_t *p, int64_t stride) {
    __m512i w0 = _mm512_loadu_si512(x), w1 = _mm512_loadu_si512(x + 16);
    __m512i w2 = _mm512_loadu_si512(x + 32), w3 = _mm512_loadu_si512(x + 48);
    transpose_lanes_(&w0, &w1, &w2, &w3); /* lane L of w_j: the floats 16 L + 4 j .. + 3 */
    /* each lane's four floats as [their byte 0 | byte 1 | byte 2 | byte 3] */
    const __m512i by_byte = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
    w0 = _mm512_shuffle_epi8(w0, by_byte), w1 = _mm512_shuffle_epi8(w1, by_byte);
    w2 = _mm512_shuffle_epi8(w2, by_byte), w3 = _mm512_shuffle_epi8(w3, by_byte);
    const __m512i lo01 = _mm512_unpacklo_epi32(w0, w1), hi01 = _mm512_unpackhi_epi32(w0, w1);
    const __m512i lo23 = _mm512_unpacklo_epi32(w2, w3), hi23 = _mm512_unpackhi_epi32(w2, w3);
    _mm512_storeu_si512(p, _mm512_unpacklo_epi64(lo01, lo23));
    _mm512_storeu_si512(p + stride, _mm512_unpackhi_epi64(lo01, lo23));
    _mm512_storeu_si512(p + 2 * stride, _mm512_unpacklo_epi64(hi01, hi23));
    _mm512_storeu_si512(p + 3 * stride, _mm512_unpackhi_epi64(hi01, hi23));
}
#endif

#elif defined(__AVX2__) /* ---------------------------------------------------------------- */
#define VW 8
typedef __m256 vf;
typedef __m256 vmask; /* all ones where set */
#if defined(__F16C__)
typedef __m128i vhalf;
#else
typedef struct { _Float16 h[8]; } vhalf;
#endif

HVDC_INLINE vf vload(const float *p) { return _mm256_loadu_ps(p); }
HVDC_INLINE void vstore(float *p, vf v) { _mm256_storeu_ps(p, v); }
HVDC_INLINE vf vload_partial(const float *p, int len) {
    float t[8] = {0};
    memcpy(t, p, (size_t)len * sizeof(float));
    return _mm256_loadu_ps(t);
}
HVDC_INLINE void vstore_partial(float *p, vf v, int len) {
    float t[8];
    _mm256_storeu_ps(t, v);
    memcpy(p, t, (size_t)len * sizeof(float));
}
HVDC_INLINE void vstream(float *p, vf v) { _mm256_stream_ps(p, v); }
HVDC_INLINE vf vset1(float a) { return _mm256_set1_ps(a); }
HVDC_INLINE vf vzero(void) { return _mm256_setzero_ps(); }
HVDC_INLINE vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
HVDC_INLINE vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
HVDC_INLINE vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
HVDC_INLINE vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
HVDC_INLINE vf vabs(vf a) { return _mm256_and_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF))); }
HVDC_INLINE vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
HVDC_INLINE vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
HVDC_INLINE vf vround_even(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
HVDC_INLINE vf vfloor(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
HVDC_INLINE vmask vcmp_ge(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_GE_OQ); }
HVDC_INLINE vmask vcmp_gt(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
HVDC_INLINE vmask visnan(vf a) { return _mm256_cmp_ps(a, a, _CMP_UNORD_Q); }
HVDC_INLINE vf vselect(vmask m, vf if_set, vf if_clear) { return _mm256_blendv_ps(if_clear, if_set, m); }
HVDC_INLINE unsigned vbits(vmask m) { return (unsigned)_mm256_movemask_ps(m); }
HVDC_INLINE vmask vmask_from_bits(unsigned b) {
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)b), bit), bit));
}
HVDC_INLINE vf vkeep_finite(vf e) {
    return _mm256_and_ps(_mm256_cmp_ps(_mm256_sub_ps(e, e), _mm256_setzero_ps(), _CMP_EQ_OQ), e);
}
HVDC_INLINE vf vbf16_value(vf a) {
    const __m256i u = _mm256_castps_si256(a);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb)),
                                       _mm256_set1_epi32((int)0xFFFF0000u));
    return _mm256_blendv_ps(_mm256_castsi256_ps(r), a, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
}
HVDC_INLINE float vreduce_add(vf a) { /* pairwise, as the plain layer sums */
    float t[8];
    _mm256_storeu_ps(t, a);
    return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
}
HVDC_INLINE float vreduce_max(vf a) {
    float t[8], m = 0.0f;
    _mm256_storeu_ps(t, a);
    for (int k = 0; k < 8; k++) m = t[k] > m ? t[k] : m;
    return m;
}
HVDC_INLINE void vstore_i8_n(int8_t *q, vf v, int len) {
    __m256i i = _mm256_cvtps_epi32(v);
    __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    __m128i b = _mm_packs_epi16(w, w);
    if (len == VW) _mm_storel_epi64((__m128i *)q, b);
    else { int8_t t[16]; _mm_storeu_si128((__m128i *)t, b); memcpy(q, t, (size_t)len); }
}
/* the lanes of a set in take, and base + their lane numbers, packed to the front of val and idx
 * (VW lanes written: room for VW at both); returns how many.  A permutation per 8-bit mask
 * from a table of 256 (2 KiB) built once; no pext, which older AMD CPUs microcode. */
static inline const uint8_t *compress_table_(void) {
    static uint8_t table[256][8];
    static int built = 0;
    if (!__atomic_load_n(&built, __ATOMIC_ACQUIRE)) {
        for (int m = 0; m < 256; m++) {
            int o = 0;
            for (int k = 0; k < 8; k++) if (m >> k & 1) table[m][o++] = (uint8_t)k;
            for (; o < 8; o++) table[m][o] = 0;
        }
        __atomic_store_n(&built, 1, __ATOMIC_RELEASE);  /* every thread builds the same bytes */
    }
    return &table[0][0];
}
HVDC_INLINE int vcompress_store(float *val, int32_t *idx, unsigned take, vf a, int32_t base) {
    const uint8_t *row = compress_table_() + 8 * (take & 0xFF);
    __m256i perm = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)row));
    _mm256_storeu_ps(val, _mm256_permutevar8x32_ps(a, perm));
    _mm256_storeu_si256((__m256i *)idx, _mm256_add_epi32(_mm256_set1_epi32(base), perm));
    return __builtin_popcount(take & 0xFF);
}
#if defined(__F16C__)
HVDC_INLINE vhalf vto_half(vf a) { return _mm256_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
HVDC_INLINE vf vfrom_half(vhalf h) { return _mm256_cvtph_ps(h); }
HVDC_INLINE void vstore_half_(void *p, vhalf h) { _mm_storeu_si128((__m128i *)p, h); }
#else
HVDC_INLINE vhalf vto_half(vf a) {
    float t[8]; vhalf h;
    _mm256_storeu_ps(t, a);
    for (int k = 0; k < 8; k++) h.h[k] = (_Float16)t[k];
    return h;
}
HVDC_INLINE vf vfrom_half(vhalf h) {
    float t[8];
    for (int k = 0; k < 8; k++) t[k] = (float)h.h[k];
    return _mm256_loadu_ps(t);
}
HVDC_INLINE void vstore_half_(void *p, vhalf h) { memcpy(p, h.h, sizeof h.h); }
#endif
HVDC_INLINE __m256i join_plane_(const uint8_t *p, int shift) {
    return _mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)), shift);
}
HVDC_INLINE vf vjoin_bytes(const uint8_t *p, int64_t stride) {
    const __m256i lo = _mm256_or_si256(join_plane_(p, 0), join_plane_(p + stride, 8));
    return _mm256_castsi256_ps(_mm256_or_si256(lo, _mm256_or_si256(join_plane_(p + 2 * stride, 16),
                                                                   join_plane_(p + 3 * stride, 24))));
}
#define HVDC_BYTE_PLANES4
HVDC_INLINE void vjoin_bytes4(const uint8_t *p, int64_t stride, vf v[4]) {
    const __m256i a0 = _mm256_loadu_si256((const __m256i *)p), a1 = _mm256_loadu_si256((const __m256i *)(p + stride));
    const __m256i a2 = _mm256_loadu_si256((const __m256i *)(p + 2 * stride));
    const __m256i a3 = _mm256_loadu_si256((const __m256i *)(p + 3 * stride));
    const __m256i t0 = _mm256_unpacklo_epi8(a0, a1), t1 = _mm256_unpackhi_epi8(a0, a1);
    const __m256i t2 = _mm256_unpacklo_epi8(a2, a3), t3 = _mm256_unpackhi_epi8(a2, a3);
    /* lane L of w_j: the floats 16 L + 4 j .. 16 L + 4 j + 3 */
    const __m256i w0 = _mm256_unpacklo_epi16(t0, t2), w1 = _mm256_unpackhi_epi16(t0, t2);
    const __m256i w2 = _mm256_unpacklo_epi16(t1, t3), w3 = _mm256_unpackhi_epi16(t1, t3);
    v[0] = _mm256_castsi256_ps(_mm256_permute2x128_si256(w0, w1, 0x20));
    v[1] = _mm256_castsi256_ps(_mm256_permute2x128_si256(w2, w3, 0x20));
    v[2] = _mm256_castsi256_ps(_mm256_permute2x128_si256(w0, w1, 0x31));
    v[3] = _mm256_castsi256_ps(_mm256_permute2x128_si256(w2, w3, 0x31));
}
HVDC_INLINE void vsplit_bytes4(const float *x, uint8_t *p, int64_t stride) {
    const __m256i v0 = _mm256_loadu_si256((const __m256i *)x), v1 = _mm256_loadu_si256((const __m256i *)(x + 8));
    const __m256i v2 = _mm256_loadu_si256((const __m256i *)(x + 16)), v3 = _mm256_loadu_si256((const __m256i *)(x + 24));
    /* lane L of w_j: the floats 16 L + 4 j .. + 3, each lane's four as [their byte 0 | 1 | 2 | 3] */
    const __m256i by_byte = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                             0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m256i w0 = _mm256_shuffle_epi8(_mm256_permute2x128_si256(v0, v2, 0x20), by_byte);
    const __m256i w1 = _mm256_shuffle_epi8(_mm256_permute2x128_si256(v0, v2, 0x31), by_byte);
    const __m256i w2 = _mm256_shuffle_epi8(_mm256_permute2x128_si256(v1, v3, 0x20), by_byte);
    const __m256i w3 = _mm256_shuffle_epi8(_mm256_permute2x128_si256(v1, v3, 0x31), by_byte);
    const __m256i lo01 = _mm256_unpacklo_epi32(w0, w1), hi01 = _mm256_unpackhi_epi32(w0, w1);
    const __m256i lo23 = _mm256_unpacklo_epi32(w2, w3), hi23 = _mm256_unpackhi_epi32(w2, w3);
    _mm256_storeu_si256((__m256i *)p, _mm256_unpacklo_epi64(lo01, lo23));
    _mm256_storeu_si256((__m256i *)(p + stride), _mm256_unpackhi_epi64(lo01, lo23));
    _mm256_storeu_si256((__m256i *)(p + 2 * stride), _mm256_unpacklo_epi64(hi01, hi23));
    _mm256_storeu_si256((__m256i *)(p + 3 * stride), _mm256_unpackhi_epi64(hi01, hi23));
}

#else /* plain C --------------------------------------------------------------------------- */
#define VW 8
typedef struct { float v[8]; } vf;
typedef unsigned vmask; /* bit k: lane k */
typedef struct { _Float16 h[8]; } vhalf;

#define VLANES(k) for (int k = 0; k < VW; k++)
HVDC_INLINE vf vload(const float *p) { vf r; memcpy(r.v, p, sizeof r.v); return r; }
HVDC_INLINE void vstore(float *p, vf v) { memcpy(p, v.v, sizeof v.v); }
HVDC_INLINE vf vload_partial(const float *p, int len) {
    vf r = {{0}};
    memcpy(r.v, p, (size_t)len * sizeof(float));
    return r;
}
HVDC_INLINE void vstore_partial(float *p, vf v, int len) { memcpy(p, v.v, (size_t)len * sizeof(float)); }
HVDC_INLINE void vstream(float *p, vf v) { vstore(p, v); }
HVDC_INLINE vf vset1(float a) { vf r; VLANES(k) r.v[k] = a; return r; }
HVDC_INLINE vf vzero(void) { return vset1(0.0f); }
HVDC_INLINE vf vadd(vf a, vf b) { VLANES(k) a.v[k] += b.v[k]; return a; }
HVDC_INLINE vf vsub(vf a, vf b) { VLANES(k) a.v[k] -= b.v[k]; return a; }
HVDC_INLINE vf vmul(vf a, vf b) { VLANES(k) a.v[k] *= b.v[k]; return a; }
HVDC_INLINE vf vdiv(vf a, vf b) { VLANES(k) a.v[k] /= b.v[k]; return a; }
HVDC_INLINE vf vabs(vf a) { VLANES(k) a.v[k] = fabsf(a.v[k]); return a; }
HVDC_INLINE vf vmin(vf a, vf b) { VLANES(k) a.v[k] = a.v[k] < b.v[k] ? a.v[k] : b.v[k]; return a; }
HVDC_INLINE vf vmax(vf a, vf b) { VLANES(k) a.v[k] = a.v[k] > b.v[k] ? a.v[k] : b.v[k]; return a; }
HVDC_INLINE vf vround_even(vf a) { VLANES(k) a.v[k] = rintf(a.v[k]); return a; }
HVDC_INLINE vf vfloor(vf a) { VLANES(k) a.v[k] = floorf(a.v[k]); return a; }
HVDC_INLINE vmask vcmp_ge(vf a, vf b) { vmask m = 0; VLANES(k) m |= (unsigned)(a.v[k] >= b.v[k]) << k; return m; }
HVDC_INLINE vmask vcmp_gt(vf a, vf b) { vmask m = 0; VLANES(k) m |= (unsigned)(a.v[k] > b.v[k]) << k; return m; }
HVDC_INLINE vmask visnan(vf a) { vmask m = 0; VLANES(k) m |= (unsigned)(a.v[k] != a.v[k]) << k; return m; }
HVDC_INLINE vf vselect(vmask m, vf if_set, vf if_clear) {
    VLANES(k) if_clear.v[k] = ((m >> k) & 1u) ? if_set.v[k] : if_clear.v[k];
    return if_clear;
}
HVDC_INLINE unsigned vbits(vmask m) { return m; }
HVDC_INLINE vmask vmask_from_bits(unsigned b) { return b; }
HVDC_INLINE vf vkeep_finite(vf e) { VLANES(k) e.v[k] = keep_finite(e.v[k]); return e; }
HVDC_INLINE vf vbf16_value(vf a) {
    VLANES(k) {
        uint32_t u;
        memcpy(&u, &a.v[k], 4);
        u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
        float f;
        memcpy(&f, &u, 4);
        if (a.v[k] == a.v[k]) a.v[k] = f;
    }
    return a;
}
HVDC_INLINE float vreduce_add(vf a) {
    return ((a.v[0] + a.v[1]) + (a.v[2] + a.v[3])) + ((a.v[4] + a.v[5]) + (a.v[6] + a.v[7]));
}
HVDC_INLINE float vreduce_max(vf a) { float m = 0.0f; VLANES(k) m = a.v[k] > m ? a.v[k] : m; return m; }
HVDC_INLINE void vstore_i8_n(int8_t *q, vf v, int len) { for (int k = 0; k < len; k++) q[k] = (int8_t)(int)v.v[k]; }
/* the lanes of a set in take, and base + their lane numbers, packed to the front of val and idx
 * (VW lanes written: room for VW at both); returns how many.  Branch-free: every lane is
 * written, the position advances past the set ones. */
HVDC_INLINE int vcompress_store(float *val, int32_t *idx, unsigned take, vf a, int32_t base) {
    int o = 0;
    VLANES(k) { val[o] = a.v[k]; idx[o] = base + k; o += (int)((take >> k) & 1u); }
    return o;
}
HVDC_INLINE vhalf vto_half(vf a) { vhalf h; VLANES(k) h.h[k] = (_Float16)a.v[k]; return h; }
HVDC_INLINE vf vfrom_half(vhalf h) { vf r; VLANES(k) r.v[k] = (float)h.h[k]; return r; }
HVDC_INLINE void vstore_half_(void *p, vhalf h) { memcpy(p, h.h, sizeof h.h); }
HVDC_INLINE vf vjoin_bytes(const uint8_t *p, int64_t stride) {
    uint32_t u[VW];
    VLANES(k) u[k] = (uint32_t)p[k] | (uint32_t)p[stride + k] << 8 | (uint32_t)p[2 * stride + k] << 16
                     | (uint32_t)p[3 * stride + k] << 24;
    vf r;
    memcpy(r.v, u, sizeof u);
    return r;
}
#undef VLANES
#endif /* ---------------------------------------------------------------------------------- */

#if !defined(__AVX512F__)
/* the entries of src[0..VW) whose bit is set in take, packed to the front of dst (VW written: room
 * for VW); returns how many.  Branch-free: every entry is written, the position advances past the
 * set ones. */
HVDC_INLINE int vcompress_i64(int64_t *dst, const int64_t *src, unsigned take) {
    int o = 0;
    for (int k = 0; k < VW; k++) { dst[o] = src[k]; o += (int)((take >> k) & 1u); }
    return o;
}
#endif

/* base + the position of each set bit of w - ramp * its rank (ramp 0 or 1), ascending, into out
 * (room for 64 + 8: whole groups of 8 are written); returns how many.  With AVX-512 VBMI2 the
 * positions are compressed from a vector of 0..63 by w as a byte mask, eight widened at a time;
 * else one per set bit. */
#if defined(__AVX512VBMI2__) && defined(__AVX512BW__)
HVDC_INLINE int bit_positions(uint64_t w, int64_t base, int ramp, int64_t *out) {
    static const uint8_t iota8[64] = {0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15,
                                      16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31,
                                      32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47,
                                      48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63};
    uint8_t pos[64];
    _mm512_storeu_si512((void *)pos, _mm512_maskz_compress_epi8((__mmask64)w, _mm512_loadu_si512((const void *)iota8)));
    const int cnt = __builtin_popcountll(w);
    const __m512i rank8 = _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7);
    __m512i b = _mm512_sub_epi64(_mm512_set1_epi64(base), ramp ? rank8 : _mm512_setzero_si512());
    const __m512i step = _mm512_set1_epi64(ramp ? 8 : 0);
    for (int q = 0; q < cnt; q += 8, b = _mm512_sub_epi64(b, step))
        _mm512_storeu_si512((void *)(out + q),
                            _mm512_add_epi64(_mm512_cvtepu8_epi64(_mm_loadl_epi64((const __m128i *)(pos + q))), b));
    return cnt;
}
#else
HVDC_INLINE int bit_positions(uint64_t w, int64_t base, int ramp, int64_t *out) {
    int cnt = 0;
    for (; w; w &= w - 1, cnt++) out[cnt] = base + __builtin_ctzll(w) - (ramp ? cnt : 0);
    return cnt;
}
#endif

/* the bits at the 8 ascending positions (idx[q] >> shift) + base + ramp * q (ramp 0 or 1) of a
 * little-endian bit array set; the 64-bit word of the first lies inside the array.  With AVX-512,
 * where all eight fall in that word (Elias-Fano's high parts at densities of a few percent and more:
 * eight span a few dozen bits), their bits are or'ed in a register and the word read and written
 * once; else one byte at a time. */
#if defined(__AVX512F__)
HVDC_INLINE void set_bits8(uint8_t *bits, const int64_t *idx, int shift, int64_t base, int ramp) {
    const int64_t first = (idx[0] >> shift) + base, last = (idx[7] >> shift) + base + 7 * ramp;
    if ((first >> 6) == (last >> 6)) {
        const __m512i rank = ramp ? _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7) : _mm512_setzero_si512();
        const __m512i p = _mm512_add_epi64(_mm512_srli_epi64(_mm512_loadu_si512((const void *)idx), (unsigned)shift),
                                           _mm512_add_epi64(_mm512_set1_epi64(base), rank));
        const __m512i b = _mm512_sllv_epi64(_mm512_set1_epi64(1), _mm512_and_si512(p, _mm512_set1_epi64(63)));
        uint64_t v;
        memcpy(&v, bits + 8 * (first >> 6), 8);
        v |= (uint64_t)_mm512_reduce_or_epi64(b);
        memcpy(bits + 8 * (first >> 6), &v, 8);
        return;
    }
    for (int q = 0; q < 8; q++) {
        const int64_t pos = (idx[q] >> shift) + base + ramp * q;
        bits[pos >> 3] |= (uint8_t)(1u << (pos & 7));
    }
}
#else
HVDC_INLINE void set_bits8(uint8_t *bits, const int64_t *idx, int shift, int64_t base, int ramp) {
    for (int q = 0; q < 8; q++) {
        const int64_t pos = (idx[q] >> shift) + base + ramp * q;
        bits[pos >> 3] |= (uint8_t)(1u << (pos & 7));
    }
}
#endif

/* the low `low` bits (low <= 8) of idx[0..8) side by side, idx[q]'s at bit q * low: Elias-Fano's
 * low parts of eight indices, their `low` bytes */
#if defined(__AVX512F__)
HVDC_INLINE uint64_t pack_low8(const int64_t *idx, int low) {
    const __m512i mask = _mm512_set1_epi64((int64_t)((1u << low) - 1u));
    const __m512i at = _mm512_setr_epi64(0, low, 2 * low, 3 * low, 4 * low, 5 * low, 6 * low, 7 * low);
    return (uint64_t)_mm512_reduce_or_epi64(_mm512_sllv_epi64(_mm512_and_si512(_mm512_loadu_si512((const void *)idx), mask), at));
}
#else
HVDC_INLINE uint64_t pack_low8(const int64_t *idx, int low) {
    const uint64_t mask = ((uint64_t)1 << low) - 1;
    uint64_t v = 0;
    for (int q = 0; q < 8; q++) v |= ((uint64_t)idx[q] & mask) << (q * low);
    return v;
}
#endif

/* vstream: a store that bypasses the caches (p aligned to VW floats), for an output larger
 * than the caches that nothing reads soon; the caller fences with vstream_fence() */
#if defined(__AVX512F__) || defined(__AVX2__)
HVDC_INLINE void vstream_fence(void) { _mm_sfence(); }
#else
HVDC_INLINE void vstream_fence(void) {}
#endif
/* the first len lanes; with len == VW (a constant in a kernel's loop) the test folds away */
HVDC_INLINE vf vload_n(const float *p, int len) { return len == VW ? vload(p) : vload_partial(p, len); }
HVDC_INLINE void vstore_n(float *p, vf v, int len) {
    if (len == VW) vstore(p, v);
    else vstore_partial(p, v, len);
}
/* the floats whose byte k (little-endian: 0 the lowest) is p[k stride + i], i < len */
HVDC_INLINE vf vjoin_bytes_n(const uint8_t *p, int64_t stride, int len) {
    if (len == VW) return vjoin_bytes(p, stride);
    uint32_t u[VW] = {0};
    for (int i = 0; i < len; i++)
        u[i] = (uint32_t)p[i] | (uint32_t)p[stride + i] << 8 | (uint32_t)p[2 * stride + i] << 16
               | (uint32_t)p[3 * stride + i] << 24;
    float f[VW];
    memcpy(f, u, sizeof u);
    return vload(f);
}
#if !defined(HVDC_BYTE_PLANES4) /* the layers without their own: VW floats at a time */
HVDC_INLINE void vjoin_bytes4(const uint8_t *p, int64_t stride, vf v[4]) {
    for (int j = 0; j < 4; j++) v[j] = vjoin_bytes(p + j * VW, stride);
}
HVDC_INLINE void vsplit_bytes4(const float *x, uint8_t *p, int64_t stride) {
    const uint8_t *b = (const uint8_t *)x;
    for (int i = 0; i < 4 * VW; i++) {
        p[i] = b[4 * i], p[stride + i] = b[4 * i + 1], p[2 * stride + i] = b[4 * i + 2], p[3 * stride + i] = b[4 * i + 3];
    }
}
#endif
/* VW halves (2 bytes each) at p, the first len of them */
HVDC_INLINE void vstore_half(void *p, vhalf h, int len) {
    if (len == VW) { vstore_half_(p, h); return; }
    uint16_t t[VW];
    vstore_half_(t, h);
    memcpy(p, t, (size_t)len * 2);
}
/* the mask of the first len lanes, as vbits gives them */
HVDC_INLINE unsigned lane_bits(int len) { return len >= 32 ? ~0u : (1u << len) - 1u; }
/* bits b of VW lanes into ceil(len / 8) bytes at p, little-endian; b's bits from len on are 0 */
HVDC_INLINE void store_lane_bits(uint8_t *p, unsigned b, int len) {
    for (int k = 0; k < (len + 7) / 8; k++) p[k] = (uint8_t)(b >> (8 * k));
}
HVDC_INLINE unsigned load_lane_bits(const uint8_t *p, int len) {
    unsigned b = 0;
    for (int k = 0; k < (len + 7) / 8; k++) b |= (unsigned)p[k] << (8 * k);
    return b;
}

#endif /* HVDC_SIMD_H */
