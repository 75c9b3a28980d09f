/* hvd_compress's fused CPU kernels: error feedback, encode and decode of the
 * hot schemes in one or two passes over memory, into caller-owned buffers.
 *
 * Each function is the same math as the scheme's eager code in
 * hvd_compress/schemes (the reference the tests compare against, bit for bit
 * where the math is element-wise): same float32 operations in the same order,
 * round half to even, non-finite residuals replaced by 0.  Reductions (sums
 * for scales) accumulate in double, so they may differ from the eager sum in
 * the last bits.
 *
 * The exported functions, their conventions and the enums they take are declared
 * once, in hvdc_kernels.h.  Each vector loop is written once, over the vector layer of
 * hvdc_simd.h (AVX-512, AVX2 or plain C, chosen at compile time): a kernel's step is
 * an inline function of (position, lane count), run over whole vectors and then once
 * over the last, partial one.  Single-threaded: one Horovod rank per core is the common
 * CPU layout, and the passes are bound by memory bandwidth, not arithmetic.
 * Timings of the choices made here: docs/design/kernels.md.
 */
#include "hvdc_kernels.h"
#include "hvdc_simd.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ---- compensation -------------------------------------------------------- */

/* one step of compensate_l1: acc = x + r into r (with r); part + |acc| */
HVDC_INLINE vf l1_step(const float *x, float *r, i64 i, int len, vf part) {
    vf a = vload_n(x + i, len);
    if (r) {
        a = vadd(a, vload_n(r + i, len));
        vstore_n(r + i, a, len);
    }
    return vadd(part, vabs(a));
}

/* acc = x + r, written into r (with r); returns sum |acc| if want_l1.  Used by the
 * schemes whose scale needs the whole accumulated tensor before anything can be sent.
 * Float lanes are summed over 4096 elements at a time, each block's sum added in
 * double: one double accumulator would be a serial chain of adds. */
static double compensate_l1(const float *x, float *r, i64 n, int want_l1) {
    double l1 = 0.0;
    if (!r && !want_l1) return 0.0;
    for (i64 lo = 0; lo < n; lo += 4096) {
        i64 hi = lo + 4096 < n ? lo + 4096 : n, i = lo;
        vf part = vzero();
        for (; i + VW <= hi; i += VW) part = l1_step(x, r, i, VW, part);
        if (i < hi) part = l1_step(x, r, i, (int)(hi - i), part);
        l1 += want_l1 ? (double)vreduce_add(part) : 0.0;
    }
    return l1;
}

/* ---- momentum-aware error feedback (hvd_compress.feedback.memory.MomentumMemory) ---- */

/* u = m u + x (kept only where finite); d = u, or x + m u with nesterov,
 * written into d (which may be x itself): the tensor whose acc = d + r every
 * encode kernel then forms, exactly as MomentumMemory.compensate does. */
void hvdc_momentum(const float *x, float *u, i64 n, float m, int nesterov, float *d) {
    for (i64 i = 0; i < n; i++) {
        float xi = x[i];
        float v = u[i] * m + xi;
        d[i] = nesterov ? xi + v * m : v;
        u[i] = keep_finite(v);
    }
}

/* ---- PowerSGD's passes over M (hvd_compress/codecs/torch_lowrank.py) ---- */

/* M is n x m row-major, the Q's r x m row-major (Q^T contiguous), a P element (i, k) at
 * p[i * p_row + k * p_col] (the QR's column-major P and the row-major P as sent alike).
 * Each pass reads M once, a block of columns at a time, the r rows of that block of the
 * thin factor kept in the L1/L2 cache; the rank is a constant in the instances of the
 * usual ranks (1, 2, 4, 8), so the r accumulators stay in registers.  Products and sums round as their scalar C forms (no FMA); the order of
 * a sum over the columns (first pass) is the vector layer's lane split, so those agree
 * with a BLAS to float32 rounding, not bit for bit. */

/* outputs of at least this many floats (16 MB) are streamed past the caches */
#ifndef LOWRANK_STREAM_MIN
#define LOWRANK_STREAM_MIN ((i64)1 << 22)
#endif

/* columns per block: 2 r rows of that many floats (the finish's two Q's) in 64 KB */
static i64 lowrank_cols(int rank) {
    i64 w = ((i64)8192 / rank) / VW * VW;
    return w < VW ? VW : w;
}

/* one step of the first pass over a row: acc = x + r into r (with r); acc[k] += a q_k */
HVDC_INLINE void lowrank_dot_step(const float *x, float *r, const float *qt, i64 m, i64 j, int len, int R,
                                  vf *acc) {
    vf a = vload_n(x + j, len);
    if (r) {
        a = vadd(a, vload_n(r + j, len));
        vstore_n(r + j, a, len);
    }
    for (int k = 0; k < R; k++) acc[k] = vadd(acc[k], vmul(a, vload_n(qt + k * m + j, len)));
}

HVDC_INLINE void lowrank_first(const float *x, float *r, i64 n, i64 m, int R, const float *qt, float *p) {
    const i64 w = lowrank_cols(R);
    for (i64 i = 0; i < n * R; i++) p[i] = 0.0f;
    for (i64 j0 = 0; j0 < m; j0 += w) {
        const i64 j1 = j0 + w < m ? j0 + w : m;
        for (i64 i = 0; i < n; i++) {
            const float *xi = x + i * m;
            float *ri = r ? r + i * m : NULL;
            vf acc[HVDC_LOWRANK_MAX_RANK];
            for (int k = 0; k < R; k++) acc[k] = vzero();
            i64 j = j0;
            for (; j + VW <= j1; j += VW) lowrank_dot_step(xi, ri, qt, m, j, VW, R, acc);
            if (j < j1) lowrank_dot_step(xi, ri, qt, m, j, (int)(j1 - j), R, acc);
            for (int k = 0; k < R; k++) p[i * R + k] += vreduce_add(acc[k]);
        }
    }
}

/* one step of the projection over up to 4 rows a: qt[k] += p_0k a_0 + p_1k a_1 + ..., the
 * rows added one after the other (the order of a row at a time) */
HVDC_INLINE void lowrank_project_step(const float *mat, i64 m, i64 i, int rows, const vf *pv, i64 j, int len,
                                      int R, float *qt) {
    vf a[4];
    for (int t = 0; t < rows; t++) a[t] = vload_n(mat + (i + t) * m + j, len);
    for (int k = 0; k < R; k++) {
        vf q = vload_n(qt + k * m + j, len);
        for (int t = 0; t < rows; t++) q = vadd(q, vmul(pv[t * R + k], a[t]));
        vstore_n(qt + k * m + j, q, len);
    }
}

HVDC_INLINE void lowrank_project_rows(const float *mat, i64 m, i64 i, int rows, const float *p, i64 p_row,
                                      i64 p_col, i64 j0, i64 j1, int R, float *qt) {
    vf pv[4 * HVDC_LOWRANK_MAX_RANK];
    for (int t = 0; t < rows; t++)
        for (int k = 0; k < R; k++) pv[t * R + k] = vset1(p[(i + t) * p_row + k * p_col]);
    i64 j = j0;
    for (; j + VW <= j1; j += VW) lowrank_project_step(mat, m, i, rows, pv, j, VW, R, qt);
    if (j < j1) lowrank_project_step(mat, m, i, rows, pv, j, (int)(j1 - j), R, qt);
}

HVDC_INLINE void lowrank_project(const float *mat, i64 n, i64 m, int R, const float *p, i64 p_row, i64 p_col,
                                 float *qt) {
    const i64 w = lowrank_cols(R);
    for (i64 i = 0; i < (i64)R * m; i++) qt[i] = 0.0f;
    for (i64 j0 = 0; j0 < m; j0 += w) {
        const i64 j1 = j0 + w < m ? j0 + w : m;
        i64 i = 0;
        for (; i + 4 <= n; i += 4) lowrank_project_rows(mat, m, i, 4, p, p_row, p_col, j0, j1, R, qt);
        for (; i < n; i++) lowrank_project_rows(mat, m, i, 1, p, p_row, p_col, j0, j1, R, qt);
    }
}

/* the sum of p_k q_k over the rank, from k = 0 up (the codec's order of multiply-adds) */
HVDC_INLINE vf lowrank_outer(const vf *pv, const float *qt, i64 m, i64 j, int len, int R) {
    vf s = vmul(pv[0], vload_n(qt + j, len));
    for (int k = 1; k < R; k++) s = vadd(s, vmul(pv[k], vload_n(qt + k * m + j, len)));
    return s;
}

/* one step of the finish over a row: out = p q_agg; mat = keep_finite(mat - p q_local) */
HVDC_INLINE void lowrank_finish_step(const vf *pv, const float *qa, const float *ql, i64 m, i64 j, int len, int R,
                                     float *mrow, float *orow, int stream) {
    if (stream && len == VW) vstream(orow + j, lowrank_outer(pv, qa, m, j, len, R));
    else vstore_n(orow + j, lowrank_outer(pv, qa, m, j, len, R), len);
    if (mrow) {
        vf s = lowrank_outer(pv, ql, m, j, len, R);
        vstore_n(mrow + j, vkeep_finite(vsub(vload_n(mrow + j, len), s)), len);
    }
}

HVDC_INLINE void lowrank_finish(const float *p, i64 p_row, i64 p_col, i64 n, i64 m, int R, const float *qa,
                                const float *ql, float *mat, float *out) {
    const i64 w = lowrank_cols(R);
    /* out streamed past the caches where it is far larger than they are and every
     * row's vectors are aligned */
    const int stream = n * m >= LOWRANK_STREAM_MIN && m % VW == 0 && ((uintptr_t)out % (VW * sizeof(float))) == 0;
    for (i64 j0 = 0; j0 < m; j0 += w) {
        const i64 j1 = j0 + w < m ? j0 + w : m;
        for (i64 i = 0; i < n; i++) {
            vf pv[HVDC_LOWRANK_MAX_RANK];
            for (int k = 0; k < R; k++) pv[k] = vset1(p[i * p_row + k * p_col]);
            float *mrow = mat ? mat + i * m : NULL, *orow = out + i * m;
            i64 j = j0;
            for (; j + VW <= j1; j += VW) lowrank_finish_step(pv, qa, ql, m, j, VW, R, mrow, orow, stream);
            if (j < j1) lowrank_finish_step(pv, qa, ql, m, j, (int)(j1 - j), R, mrow, orow, stream);
        }
    }
    if (stream) vstream_fence();
}

/* an instance of each pass with the rank a constant in its loops for the usual ranks
 * (each instance adds to the build time); the others run one instance with it a variable */
#define LOWRANK_RANKS(F) F(1) F(2) F(4) F(8)
#define LOWRANK_INSTANCES(R)                                                                                      \
    static void lowrank_first_##R(const float *x, float *r, i64 n, i64 m, const float *qt, float *p) {         \
        lowrank_first(x, r, n, m, R, qt, p);                                                                   \
    }                                                                                                          \
    static void lowrank_project_##R(const float *mat, i64 n, i64 m, const float *p, i64 pr, i64 pc, float *qt) { \
        lowrank_project(mat, n, m, R, p, pr, pc, qt);                                                          \
    }                                                                                                          \
    static void lowrank_finish_##R(const float *p, i64 pr, i64 pc, i64 n, i64 m, const float *qa,              \
                                   const float *ql, float *mat, float *out) {                                  \
        lowrank_finish(p, pr, pc, n, m, R, qa, ql, mat, out);                                                  \
    }
LOWRANK_RANKS(LOWRANK_INSTANCES)
#define LOWRANK_CASE_FIRST(R) case R: lowrank_first_##R(x, r, n, m, qt, p); return 0;
#define LOWRANK_CASE_PROJECT(R) case R: lowrank_project_##R(mat, n, m, p, p_row, p_col, qt); return 0;
#define LOWRANK_CASE_FINISH(R) case R: lowrank_finish_##R(p, p_row, p_col, n, m, q_agg, q_local, mat, out); return 0;

static int lowrank_rank_ok(int rank) { return rank >= 1 && rank <= HVDC_LOWRANK_MAX_RANK; }

int hvdc_lowrank_first(const float *x, float *r, i64 n, i64 m, int rank, const float *qt, float *p) {
    switch (rank) { LOWRANK_RANKS(LOWRANK_CASE_FIRST) default: break; }
    if (!lowrank_rank_ok(rank)) return -1;
    lowrank_first(x, r, n, m, rank, qt, p);
    return 0;
}

int hvdc_lowrank_project(const float *mat, i64 n, i64 m, int rank, const float *p, i64 p_row, i64 p_col,
                         float *qt) {
    switch (rank) { LOWRANK_RANKS(LOWRANK_CASE_PROJECT) default: break; }
    if (!lowrank_rank_ok(rank)) return -1;
    lowrank_project(mat, n, m, rank, p, p_row, p_col, qt);
    return 0;
}

int hvdc_lowrank_finish(const float *p, i64 p_row, i64 p_col, i64 n, i64 m, int rank, const float *q_agg,
                        const float *q_local, float *mat, float *out) {
    switch (rank) { LOWRANK_RANKS(LOWRANK_CASE_FINISH) default: break; }
    if (!lowrank_rank_ok(rank)) return -1;
    lowrank_finish(p, p_row, p_col, n, m, rank, q_agg, q_local, mat, out);
    return 0;
}

/* ---- Int8: q = clip(rint(acc / scale), -127, 127), scale = max|acc| / 127 per block ---- */

/* one step of pass 1 over a block: acc = x + r into r; the max |acc| so far, and the NaN lanes */
HVDC_INLINE vf int8_amax_step(const float *x, float *r, i64 i, int len, vf amax, unsigned *nan) {
    vf a = vload_n(x + i, len);
    if (r) {
        a = vadd(a, vload_n(r + i, len));
        vstore_n(r + i, a, len);
    }
    *nan |= vbits(visnan(a));
    return vmax(amax, vabs(a));
}

/* pass 1 over one block: acc = x + r into r; returns max |acc|, NaN if any acc is NaN */
static float int8_block_amax(const float *x, float *r, i64 lo, i64 hi) {
    vf amax = vzero();
    unsigned nan = 0;
    i64 i = lo;
    for (; i + VW <= hi; i += VW) amax = int8_amax_step(x, r, i, VW, amax, &nan);
    if (i < hi) amax = int8_amax_step(x, r, i, (int)(hi - i), amax, &nan);
    return nan ? NAN : vreduce_max(amax);
}

/* one step of pass 2: q = clip(rint(acc / scale)) (NaN -> 0, as torch's cast gives);
 * r = acc - q * scale.  vmax / vmin return their second operand where one is NaN: a
 * NaN stays NaN through the clip, as in torch.clamp. */
HVDC_INLINE void int8_quantize_step(const float *acc, float *r, i64 i, int len, vf vs, int8_t *q) {
    const vf lo127 = vset1(-127.0f), hi127 = vset1(127.0f);
    vf a = vload_n(acc + i, len);
    vf v = vmin(hi127, vmax(lo127, vround_even(vdiv(a, vs))));
    vstore_i8_n(q + i, vselect(visnan(v), vzero(), v), len);
    if (r) vstore_n(r + i, vkeep_finite(vsub(a, vmul(v, vs))), len);
}

/* pass 2 over one block: q = clip(rint(acc / scale)); r = acc - q * scale */
static void int8_block_quantize(const float *acc, float *r, i64 lo, i64 hi, float scale, int8_t *q) {
    const vf vs = vset1(scale);
    i64 i = lo;
    for (; i + VW <= hi; i += VW) int8_quantize_step(acc, r, i, VW, vs, q);
    if (i < hi) int8_quantize_step(acc, r, i, (int)(hi - i), vs, q);
}

/* Per block: scale = amax / 127, or amax * (1 / 127) with `reciprocal`: inside a
 * tf.function, TF's graph optimizer rewrites the eager scheme's amax / 127 (a division
 * by a constant) into that multiplication, so the TF ops take this form
 * (hvdc_int8_encode_rcp) to give the bits the eager TF path gives under Horovod. */
static void int8_encode(const float *x, float *r, i64 n, i64 block, int8_t *q, float *scales, int reciprocal) {
    const float rcp = 1.0f / 127.0f;
    if (n == 0) { scales[0] = 1.0f; return; }
    for (i64 lo = 0; lo < n; lo += block) {
        i64 hi = lo + block < n ? lo + block : n;
        float amax = int8_block_amax(x, r, lo, hi);
        float scale = amax != amax ? NAN : (amax == 0.0f ? 1.0f : (reciprocal ? amax * rcp : amax / 127.0f));
        scales[lo / block] = scale;
        int8_block_quantize(r ? r : x, r, lo, hi, scale, q);
    }
}

void hvdc_int8_encode(const float *x, float *r, i64 n, i64 block, int8_t *q, float *scales) {
    int8_encode(x, r, n, block, q, scales, 0);
}

void hvdc_int8_encode_rcp(const float *x, float *r, i64 n, i64 block, int8_t *q, float *scales) {
    int8_encode(x, r, n, block, q, scales, 1);
}

/* out = ((d_0 + d_1) + ...) [* s], d_j = q_j * scale_j (rank order, as every rank sums) */
void hvdc_int8_decode_sum(int nr, const int8_t *const *qs, const float *const *scales, i64 n, i64 block,
                          float s, int scaled, float *out) {
    for (i64 b = 0; b * block < n; b++) {
        i64 lo = b * block, hi = lo + block < n ? lo + block : n;
        const int8_t *q0 = qs[0]; float s0 = scales[0][b];
        for (i64 i = lo; i < hi; i++) out[i] = (float)q0[i] * s0;
        for (int j = 1; j < nr; j++) {
            const int8_t *qj = qs[j]; float sj = scales[j][b];
            for (i64 i = lo; i < hi; i++) out[i] += (float)qj[i] * sj;
        }
        if (scaled) for (i64 i = lo; i < hi; i++) out[i] *= s;
    }
}

/* ---- the sign family ------------------------------------------------------ */

/* one step: bits = (acc >= 0) and, with r, the residual acc - (bit ? vpos : vneg),
 * non-finite -> 0; a select, not a branch on the sign, which a random sign mispredicts
 * half the time.  i is a multiple of VW, so the lanes' bits fill whole bytes. */
HVDC_INLINE void sign_step(const float *acc, float *r, i64 i, int len, vf vpos, vf vneg, uint8_t *bits) {
    vf a = vload_n(acc + i, len);
    vmask ge = vcmp_ge(a, vzero()); /* NaN: false, as a >= 0 is */
    store_lane_bits(bits + i / 8, vbits(ge) & lane_bits(len), len);
    if (r) vstore_n(r + i, vkeep_finite(vsub(a, vselect(ge, vpos, vneg))), len);
}

/* bits = (acc >= 0) and, with r, the residual acc - (bit ? pos : neg), non-finite -> 0:
 * the second pass of the sign family and of OneBit */
static void sign_bits_residual(const float *acc, float *r, i64 n, float pos, float neg, uint8_t *bits) {
    const vf vpos = vset1(pos), vneg = vset1(neg);
    i64 i = 0;
    for (; i + VW <= n; i += VW) sign_step(acc, r, i, VW, vpos, vneg, bits);
    if (i < n) sign_step(acc, r, i, (int)(n - i), vpos, vneg, bits);
}

/* bits = (acc >= 0); SignSGD: sent = +-1; EFSignSGD: sent = +-scale with
 * scale = sum|acc| / n, written to *scale_out. */
void hvdc_sign_encode(const float *x, float *r, i64 n, enum hvdc_sign_mode mode, uint8_t *bits, float *scale_out) {
    const int scaled_signs = mode == HVDC_SIGN_EFSIGNSGD;
    double l1 = compensate_l1(x, r, n, scaled_signs);
    float scale = scaled_signs ? (float)l1 / (float)n : 1.0f;
    if (scale_out) *scale_out = scale;
    sign_bits_residual(r ? r : x, r, n, scale, -scale, bits);
}

/* one step of rank j's decoded signs, +-value, added onto out (first: written) */
HVDC_INLINE void sign_accumulate_step(const uint8_t *bits, i64 i, int len, vf pos, vf neg, int first, float *out) {
    vf d = vselect(vmask_from_bits(load_lane_bits(bits + i / 8, len)), pos, neg);
    vstore_n(out + i, first ? d : vadd(vload_n(out + i, len), d), len);
}

static void sign_accumulate(const uint8_t *bits, float value, i64 n, int first, float *out) {
    const vf pos = vset1(value), neg = vset1(-value);
    i64 i = 0;
    for (; i + VW <= n; i += VW) sign_accumulate_step(bits, i, VW, pos, neg, first, out);
    if (i < n) sign_accumulate_step(bits, i, (int)(n - i), pos, neg, first, out);
}

/* SignSGD: out = sign(sum_j (+-1)); EFSignSGD: out = (sum_j (+-scale_j)) [* s] */
void hvdc_sign_decode_sum(int nr, const uint8_t *const *bits, const float *scales, i64 n, enum hvdc_sign_mode mode,
                          float s, int scaled, float *out) {
    const int vote = mode == HVDC_SIGN_SIGNSGD;
    const i64 chunk = 4096;  /* the ranks are summed chunk by chunk, while out stays in cache */
    for (i64 lo = 0; lo < n; lo += chunk) {
        i64 len = lo + chunk < n ? chunk : n - lo;
        for (int j = 0; j < nr; j++)
            sign_accumulate(bits[j] + lo / 8, vote ? 1.0f : scales[j], len, j == 0, out + lo);
        float *o = out + lo;
        if (vote) for (i64 i = 0; i < len; i++) o[i] = (float)((o[i] > 0.0f) - (o[i] < 0.0f));
        if (scaled) for (i64 i = 0; i < len; i++) o[i] *= s;
    }
}

/* OneBit (1-bit SGD, Seide et al. 2014): bits = (acc >= 0), means[0] = the mean of
 * acc over the set bits, means[1] over the clear ones, each count at least 1 in the
 * division, as the eager scheme's max(count, 1).  The eager code's arithmetic is kept
 * where it decides non-finite cases: its sums are of acc * p and acc * (1 - p), so an
 * infinite or NaN element makes both means non-finite as it does there.  The decode
 * forms p * m0 + (1 - p) * m1 as the eager code does; the residual selects m0 or m1
 * (sign_bits_residual: a select vectorises, the product form does not), which is the
 * same value whenever both means are finite or both are not, the only cases the sums
 * above produce short of a float overflow.  Two passes: acc into r with the three sums
 * (eight float lanes per 4096-element block, each block added in double: plain C,
 * written once, which the compiler vectorises for every instruction set), then the
 * bits and the residual. */
/* the three sums over one block of acc: a >= 0 as 0/1 (a compare, no branch on the data) */
static inline void onebit_block(const float *acc, i64 len, float *c8, float *p8, float *n8) {
    for (i64 i = 0; i < len; i += 8)
        for (int k = 0; k < 8; k++) {
            float a = acc[i + k], p = (float)(a >= 0.0f);
            c8[k] += p; p8[k] += a * p; n8[k] += a * (1.0f - p);
        }
}

static void onebit_sums(const float *x, float *r, i64 n, double *npos, double *spos, double *sneg) {
    double cnt = 0.0, sp = 0.0, sn = 0.0;
    i64 i = 0;
    while (i + 8 <= n) {
        float c8[8] = {0}, p8[8] = {0}, n8[8] = {0};
        i64 end = i + 4096 <= n ? i + 4096 : n - (n - i) % 8;
        if (r) for (i64 j = i; j < end; j++) r[j] += x[j];  /* acc into r, while the block is in cache */
        onebit_block(r ? r + i : x + i, end - i, c8, p8, n8);
        i = end;
        for (int k = 0; k < 8; k++) { cnt += c8[k]; sp += p8[k]; sn += n8[k]; }
    }
    for (; i < n; i++) {
        float a = r ? x[i] + r[i] : x[i];
        if (r) r[i] = a;
        float p = (float)(a >= 0.0f);
        cnt += p; sp += a * p; sn += a * (1.0f - p);
    }
    *npos = cnt; *spos = sp; *sneg = sn;
}

void hvdc_onebit_encode(const float *x, float *r, i64 n, uint8_t *bits, float *means) {
    double cnt, sp, sn;
    onebit_sums(x, r, n, &cnt, &sp, &sn);
    float npos = (float)cnt, nneg = (float)n - npos;
    float m0 = (float)sp / (npos > 1.0f ? npos : 1.0f), m1 = (float)sn / (nneg > 1.0f ? nneg : 1.0f);
    means[0] = m0; means[1] = m1;
    sign_bits_residual(r ? r : x, r, n, m0, m1, bits);
}

/* one step of rank j's OneBit decode: p = the bits as 0/1 lanes, d = p * m0 + (1 - p) * m1
 * (the eager formula, so a non-finite mean propagates as there), added onto out (first: written) */
HVDC_INLINE void onebit_accumulate_step(const uint8_t *bits, i64 i, int len, vf m0, vf m1, int first, float *out) {
    const vf one = vset1(1.0f);
    vf p = vselect(vmask_from_bits(load_lane_bits(bits + i / 8, len)), one, vzero());
    vf d = vadd(vmul(p, m0), vmul(vsub(one, p), m1));
    vstore_n(out + i, first ? d : vadd(vload_n(out + i, len), d), len);
}

/* out = sum_j (p * means[2j] + (1 - p) * means[2j + 1]) [* s], ranks in order, chunk by chunk
 * (while out stays in cache); p from the bits by a lane mask, no branch on the data */
void hvdc_onebit_decode_sum(int nr, const uint8_t *const *bits, const float *means, i64 n, float s, int scaled,
                            float *out) {
    const i64 chunk = 4096;
    const vf vs = vset1(s);
    for (i64 lo = 0; lo < n; lo += chunk) {
        i64 len = lo + chunk < n ? chunk : n - lo;
        float *o = out + lo;
        for (int j = 0; j < nr; j++) {
            const uint8_t *b = bits[j] + lo / 8;
            const vf m0 = vset1(means[2 * j]), m1 = vset1(means[2 * j + 1]);
            i64 i = 0;
            for (; i + VW <= len; i += VW) onebit_accumulate_step(b, i, VW, m0, m1, j == 0, o);
            if (i < len) onebit_accumulate_step(b, i, (int)(len - i), m0, m1, j == 0, o);
        }
        if (scaled) {
            i64 i = 0;
            for (; i + VW <= len; i += VW) vstore(o + i, vmul(vload(o + i), vs));
            if (i < len) vstore_n(o + i, vmul(vload_n(o + i, (int)(len - i)), vs), (int)(len - i));
        }
    }
}

/* ---- 16-bit floats ---------------------------------------------------------- */

static inline uint16_t to_bf16(float f) {  /* round half to even; every NaN becomes 0x7FC0, as in torch */
    uint32_t u; memcpy(&u, &f, 4);
    if (f != f) return (uint16_t)0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
static inline float from_bf16(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }

/* one step of the IEEE half encode: h = half(acc), rounding to nearest even as the scalar
 * cast does; with r, r = acc - float(h), non-finite -> 0 */
HVDC_INLINE void fp16_step(const float *x, float *r, i64 i, int len, uint16_t *out) {
    vf a = vload_n(x + i, len);
    if (r) a = vadd(a, vload_n(r + i, len));
    vhalf h = vto_half(a);
    vstore_half(out + i, h, len);
    if (r) vstore_n(r + i, vkeep_finite(vsub(a, vfrom_half(h))), len);
}

static void fp16_encode(const float *x, float *r, i64 n, uint16_t *out) {
    i64 i = 0;
    for (; i + VW <= n; i += VW) fp16_step(x, r, i, VW, out);
    if (i < n) fp16_step(x, r, i, (int)(n - i), out);
}

/* bfloat16: plain C, one loop per case without branches, which the compiler vectorises */
static void bf16_encode(const float *x, float *r, i64 n, uint16_t *out) {
    if (!r) { for (i64 i = 0; i < n; i++) out[i] = to_bf16(x[i]); return; }
    for (i64 i = 0; i < n; i++) {
        float a = x[i] + r[i];
        uint16_t h = to_bf16(a);
        out[i] = h;
        r[i] = keep_finite(a - from_bf16(h));
    }
}

/* sent = the value cast back to float */
void hvdc_half_encode(const float *x, float *r, i64 n, enum hvdc_half_dtype dtype, uint16_t *out) {
    if (dtype == HVDC_HALF_FP16)
        fp16_encode(x, r, n, out);
    else
        bf16_encode(x, r, n, out);
}

/* bfloat16 payloads of nr ranks: out = (sum_j float(h_j)) [* s] */
void hvdc_bf16_decode_sum(int nr, const uint16_t *const *hs, i64 n, float s, int scaled, float *out) {
    for (i64 i = 0; i < n; i++) {
        float acc = from_bf16(hs[0][i]);
        for (int j = 1; j < nr; j++) acc += from_bf16(hs[j][i]);
        out[i] = scaled ? acc * s : acc;
    }
}

/* ---- sparsification ------------------------------------------------------------ */

static inline float magnitude(float a, int nan_large) { return (a != a) ? (nan_large ? INFINITY : a) : fabsf(a); }

/* one step of the candidate pass: acc = x + r into r (x NULL: acc is r's content; a NaN
 * dropped to 0 unless it is the largest), and the lanes whose magnitude passes thr
 * appended as candidates (only counted beyond cap: the caller retries with room).  The
 * vector part forms acc and the mask of taken lanes; with room for a whole vector the
 * taken lanes are packed in registers (vcompress_store), else the set bits are visited
 * one by one.  With a sent rule other than HVDC_SENT_KEPT, each recorded candidate's
 * residual is written as if it were sent (0, or acc - float(bfloat16(acc))), so that
 * only the candidates the selection drops are written again. */
HVDC_INLINE i64 select_step(const float *x, float *r, i64 i, int len, vf vthr, int strict, int nan_large, int sent,
                            vf vsent, i64 *cand, float *cand_val, i64 c, i64 cap) {
    vf a = x ? vload_n(x + i, len) : vload_n(r + i, len);
    if (x && r) a = vadd(a, vload_n(r + i, len));
    vmask nan = visnan(a);
    vf m = vabs(a);
    if (nan_large) m = vselect(nan, vset1(INFINITY), m);
    unsigned take = vbits(strict ? vcmp_gt(m, vthr) : vcmp_ge(m, vthr)) & lane_bits(len);
    const unsigned as_sent = sent != HVDC_SENT_KEPT ? take & vbits(vcmp_ge(m, vsent)) : 0u;
    const vf kept = nan_large ? a : vselect(nan, vzero(), a);
    const vf prov = sent == HVDC_SENT_ZERO ? vzero() : vkeep_finite(vsub(a, vbf16_value(a)));
    if (c + VW <= cap) {  /* room for a whole vector: packed in registers, no branch per lane */
        if (r) vstore_n(r + i, sent != HVDC_SENT_KEPT ? vselect(vmask_from_bits(as_sent), prov, kept) : kept, len);
        int32_t at[VW];
        int got = vcompress_store(cand_val + c, at, take, a, (int32_t)i);
        for (int t = 0; t < VW; t++) cand[c + t] = at[t];
        return c + got;
    }
    if (r) vstore_n(r + i, kept, len);
    if (take) {
        float av[VW], pv[VW];
        vstore(av, a);
        vstore(pv, prov);
        while (take) {
            int t = __builtin_ctz(take);
            take &= take - 1;
            if (c < cap) {
                cand[c] = i + t; cand_val[c] = av[t];
                if (r && ((as_sent >> t) & 1u)) r[i + t] = pv[t];
            }
            c++;
        }
    }
    return c;
}

static i64 compensate_select(const float *x, float *r, i64 n, float thr, enum hvdc_threshold_rule rule,
                             enum hvdc_nan_rule nan_rule, int sent, float thr_sent, i64 *cand, float *cand_val,
                             i64 cap) {
    const int strict = rule == HVDC_ABOVE, nan_large = nan_rule == HVDC_NAN_LARGEST;
    const vf vthr = vset1(thr), vsent = vset1(thr_sent);
    i64 c = 0, i = 0;
    if (sent == HVDC_SENT_KEPT) {  /* separate instances: the rule folds away in each */
        for (; i + VW <= n; i += VW) c = select_step(x, r, i, VW, vthr, strict, nan_large, HVDC_SENT_KEPT, vsent, cand, cand_val, c, cap);
        if (i < n) c = select_step(x, r, i, (int)(n - i), vthr, strict, nan_large, HVDC_SENT_KEPT, vsent, cand, cand_val, c, cap);
    } else if (sent == HVDC_SENT_ZERO) {
        for (; i + VW <= n; i += VW) c = select_step(x, r, i, VW, vthr, strict, nan_large, HVDC_SENT_ZERO, vsent, cand, cand_val, c, cap);
        if (i < n) c = select_step(x, r, i, (int)(n - i), vthr, strict, nan_large, HVDC_SENT_ZERO, vsent, cand, cand_val, c, cap);
    } else {
        for (; i + VW <= n; i += VW) c = select_step(x, r, i, VW, vthr, strict, nan_large, HVDC_SENT_BF16, vsent, cand, cand_val, c, cap);
        if (i < n) c = select_step(x, r, i, (int)(n - i), vthr, strict, nan_large, HVDC_SENT_BF16, vsent, cand, cand_val, c, cap);
    }
    return c;
}

/* acc = x + r into r (r != NULL), and the indices where |acc| >= thr (> thr
 * with HVDC_ABOVE) into cand and their acc values into cand_val, up to cap of
 * them; returns how many there are.
 * HVDC_NAN_LARGEST: a NaN counts as the largest magnitude (torch.topk's order)
 * and is a candidate; with HVDC_NAN_DROPPED it never is, and its residual
 * becomes 0 here. */
i64 hvdc_compensate_select(const float *x, float *r, i64 n, float thr, enum hvdc_threshold_rule rule,
                           enum hvdc_nan_rule nan_rule, i64 *cand, float *cand_val, i64 cap) {
    return compensate_select(x, r, n, thr, rule, nan_rule, HVDC_SENT_KEPT, thr, cand, cand_val, cap);
}

i64 hvdc_compensate_select_sent(const float *x, float *r, i64 n, float thr, enum hvdc_threshold_rule rule,
                                enum hvdc_nan_rule nan_rule, enum hvdc_sent_rule sent, float thr_sent, i64 *cand,
                                float *cand_val, i64 cap) {
    return compensate_select(x, r, n, thr, rule, nan_rule, (int)sent, thr_sent, cand, cand_val, cap);
}

void hvdc_restore_candidates(float *r, const i64 *cand, const float *cand_val, i64 c, int finite) {
    if (finite) for (i64 j = 0; j < c; j++) r[cand[j]] = keep_finite(cand_val[j]);
    else for (i64 j = 0; j < c; j++) r[cand[j]] = cand_val[j];
}

/* ---- Threshold and DGC: every element past the threshold is sent ---------------- */

/* one step of hvdc_select_sent: acc (x + r, or r alone where x is NULL); the lanes whose
 * |acc| passes thr (never a NaN) are packed into idx / val, and r becomes 0 there and at
 * a NaN, acc elsewhere.  With room for a whole vector the lanes are packed in registers;
 * near the end of the room lane by lane, and a lane past the room keeps acc in r. */
HVDC_INLINE i64 select_sent_step(const float *x, float *r, i64 i, int len, vf vthr, int strict, int32_t *idx,
                                 float *val, i64 c, i64 cap) {
    vf a = x ? vload_n(x + i, len) : vload_n(r + i, len);
    if (x && r) a = vadd(a, vload_n(r + i, len));
    vf m = vabs(a);
    vmask takem = strict ? vcmp_gt(m, vthr) : vcmp_ge(m, vthr);  /* false for a NaN */
    a = vselect(visnan(a), vzero(), a);  /* a NaN's residual: 0 */
    unsigned take = vbits(takem) & lane_bits(len);
    if (c + VW <= cap) {
        if (r) vstore_n(r + i, vselect(takem, vzero(), a), len);
        return c + vcompress_store(val + c, idx + c, take, a, (int32_t)i);
    }
    float av[VW];
    vstore(av, a);
    for (int t = 0; t < len; t++) {
        int taken = (int)((take >> t) & 1u), stored = taken && c < cap;
        if (stored) { idx[c] = (int32_t)(i + t); val[c] = av[t]; }
        if (r) r[i + t] = stored ? 0.0f : av[t];
        c += taken;
    }
    return c;
}

i64 hvdc_select_sent(const float *x, float *r, i64 n, float thr, enum hvdc_threshold_rule rule, int32_t *idx,
                     float *val, i64 cap) {
    const int strict = rule == HVDC_ABOVE;
    const vf vthr = vset1(thr);
    i64 c = 0, i = 0;
    for (; i + VW <= n; i += VW) c = select_sent_step(x, r, i, VW, vthr, strict, idx, val, c, cap);
    if (i < n) c = select_sent_step(x, r, i, (int)(n - i), vthr, strict, idx, val, c, cap);
    return c;
}

/* The scale of a block summed in cache ([* s] where touched): where s is finite and not
 * negative every element of the block is multiplied (an untouched +0 stays +0), one vector
 * loop; else only the touched ones, from their bitmap (an untouched element stays +0 whatever
 * s is, as the reference scales only what it added). */
static inline int scales_whole_block(float s) { return isfinite(s) && !signbit(s); }

static void scale_block(float *out, i64 len, float s, int whole, const uint64_t *touched) {
    if (whole) {
        for (i64 i = 0; i < len; i++) out[i] *= s;
        return;
    }
    for (i64 w = 0; w < (len + 63) / 64; w++)
        for (uint64_t b = touched[w]; b; b &= b - 1) out[64 * w + __builtin_ctzll(b)] *= s;
}

/* Every rank's values at indices in [pos[j], hi) added onto out in rank order (the block
 * sums of hvdc_sparse_sum_i32 and hvdc_sparse_sum, one body for either index type), each
 * rank's position advanced past the block, and the touched bitmap of [lo, hi) set where
 * mark. */
#define DEFINE_ADD_BLOCK(NAME, INDEX)                                                              \
    static inline void NAME(int nr, const INDEX *const *idx, const float *const *vals, const i64 *ks, \
                            i64 *pos, i64 lo, i64 hi, int mark, uint64_t *touched, float *out) {    \
        for (int j = 0; j < nr; j++) {                                                             \
            const INDEX *ix = idx[j];                                                              \
            const float *v = vals[j];                                                              \
            i64 t = pos[j];                                                                        \
            for (; t < ks[j] && ix[t] < hi; t++) {                                                 \
                out[ix[t]] += v[t];                                                                \
                if (mark) touched[(ix[t] - lo) >> 6] |= (uint64_t)1 << ((ix[t] - lo) & 63);        \
            }                                                                                      \
            pos[j] = t;                                                                            \
        }                                                                                          \
    }
DEFINE_ADD_BLOCK(add_block_i32, int32_t)
DEFINE_ADD_BLOCK(add_block_i64, i64)

/* The sum of nr raw-coded sparse payloads (int32 indices, ascending within a rank) into a
 * dense out of n, as hvdc_sparse_sum: out = 0, every index's values added onto 0 in rank
 * order, [* s] where touched.  Block by block (4096 elements): the block is zeroed and the
 * ranks' values added while it is in cache, so the output is written once.  Returns 0; -1
 * where a rank's indices are not strictly ascending, -2 where one is outside [0, n) (out
 * is then unspecified: the caller sorts, or fails). */
i64 hvdc_sparse_sum_i32(int nr, const int32_t *const *idx, const float *const *vals, const i64 *ks, i64 n, float s,
                        int scaled, float *out) {
    enum { BLOCK = 4096 };
    i64 small[64] = {0};
    i64 *pos = nr <= 64 ? small : calloc((size_t)nr, sizeof(i64));
    uint64_t touched[BLOCK / 64];
    const int whole = scales_whole_block(s), mark = scaled && !whole;  /* mark: the touched bitmap is needed */
    i64 status = 0;
    if (!pos) return -2;
    for (int j = 0; j < nr && !status; j++)
        for (i64 t = 0; t < ks[j]; t++) {
            if (idx[j][t] < 0 || idx[j][t] >= n) { status = -2; break; }
            if (t && idx[j][t] <= idx[j][t - 1]) { status = -1; break; }
        }
    for (i64 lo = 0; lo < n && !status; lo += BLOCK) {
        const i64 hi = lo + BLOCK < n ? lo + BLOCK : n;
        memset(out + lo, 0, (size_t)(hi - lo) * sizeof(float));
        if (nr == 1) {  /* one rank: (0 + v) [* s] written directly */
            const int32_t *ix = idx[0];
            const float *v = vals[0];
            i64 t = pos[0];
            for (; t < ks[0] && ix[t] < hi; t++) out[ix[t]] = scaled ? (0.0f + v[t]) * s : 0.0f + v[t];
            pos[0] = t;
            continue;
        }
        if (mark) memset(touched, 0, sizeof touched);
        add_block_i32(nr, idx, vals, ks, pos, lo, hi, mark, touched, out);
        if (scaled) scale_block(out + lo, hi - lo, s, whole, touched);
    }
    if (pos != small) free(pos);
    return status;
}

/* r[idx[j]] = val[j] for j < c: the residual of a hvdc_select_sent that ran out of room
 * put back, so that the selection can run again from r with room */
void hvdc_unsend(float *r, const int32_t *idx, const float *val, i64 c) {
    for (i64 j = 0; j < c; j++) r[idx[j]] = val[j];
}

/* |acc| at every stride-th element (ceil(n / stride) of them): the sample
 * a top-k threshold is estimated from, before acc is formed */
void hvdc_sample_magnitudes(const float *x, const float *r, i64 n, i64 stride, enum hvdc_nan_rule nan_rule,
                            float *out) {
    const int nan_large = nan_rule == HVDC_NAN_LARGEST;
    enum { AHEAD = 16 };  /* each sample a cache miss in x and r: the lines AHEAD samples on are asked for now */
    for (i64 i = 0, j = 0; i < n; i += stride, j++) {
        if (i + AHEAD * stride < n) {
            __builtin_prefetch(x + i + AHEAD * stride);
            if (r) __builtin_prefetch(r + i + AHEAD * stride);
        }
        out[j] = magnitude(r ? x[i] + r[i] : x[i], nan_large);
    }
}

/* the k-th largest of v[0..m) (1 <= k <= m) by quickselect, v permuted so that its k largest come first */
static float kth_largest_quickselect(float *v, i64 m, i64 k) {
    i64 lo = 0, hi = m - 1, want = k - 1;  /* descending order position */
    while (lo < hi) {
        float p = v[lo + (hi - lo) / 2];
        i64 i = lo, j = hi;
        while (i <= j) {
            while (v[i] > p) i++;
            while (v[j] < p) j--;
            if (i <= j) { float t = v[i]; v[i] = v[j]; v[j] = t; i++; j--; }
        }
        if (want <= j) hi = j; else if (want >= i) lo = i; else return v[want];
    }
    return v[want];
}

static inline uint32_t float_bits(const float *p) { uint32_t u; memcpy(&u, p, 4); return u; }

/* The k-th largest of v[0..m) (1 <= k <= m); v is permuted so that its k largest come first (a second
 * call on v[0..k) then selects among them).  Many magnitudes (no sign bit set, no NaN: as floats they
 * order as their bits) by a radix select: a histogram of the bits' top 16, then of the low 16 among
 * those in the bin of the k-th largest, and one partition; anything else, and a few thousand, by
 * quickselect.  Either returns the same value. */
float hvdc_kth_largest(float *v, i64 m, i64 k) {
    enum { RADIX_MIN = 32768 };  /* below, clearing the 256 KB histogram costs more than quickselect */
    uint32_t odd = 0;
    for (i64 j = 0; j < m && m >= RADIX_MIN; j++) odd |= float_bits(v + j) > 0x7F800000u;  /* a sign bit or a NaN */
    uint32_t *hist = m < RADIX_MIN || odd ? NULL : calloc((size_t)1 << 16, sizeof(uint32_t));
    if (!hist) return kth_largest_quickselect(v, m, k);
    for (i64 j = 0; j < m; j++) hist[float_bits(v + j) >> 16]++;
    i64 above = 0;  /* elements in the bins above bin */
    uint32_t bin = 0xFFFFu;
    while (above + hist[bin] < k) above += hist[bin--];
    memset(hist, 0, ((size_t)1 << 16) * sizeof(uint32_t));
    for (i64 j = 0; j < m; j++) {
        const uint32_t u = float_bits(v + j);
        if ((u >> 16) == bin) hist[u & 0xFFFFu]++;
    }
    uint32_t low = 0xFFFFu;
    while (above + hist[low] < k) above += hist[low--];
    free(hist);
    const uint32_t t = (bin << 16) | low;
    i64 i = 0;
    for (i64 j = 0; j < m; j++)  /* the larger ones first, then ties with the k-th up to k */
        if (float_bits(v + j) > t) { const float x = v[i]; v[i++] = v[j]; v[j] = x; }
    for (i64 j = i; j < m && i < k; j++)
        if (float_bits(v + j) == t) { const float x = v[i]; v[i++] = v[j]; v[j] = x; }
    float f;
    memcpy(&f, &t, 4);
    return f;
}

/* The magnitude of a candidate as an unsigned key with the magnitudes' order: the bits
 * of |v| (non-negative floats order as their bits), a NaN as +Inf where it is the largest
 * magnitude (HVDC_NAN_LARGEST: a NaN ties with an infinity, as magnitude() makes them). */
static inline uint32_t magnitude_key(float v, int nan_large) {
    uint32_t u;
    memcpy(&u, &v, 4);
    u &= 0x7FFFFFFFu;
    return (nan_large && u > 0x7F800000u) ? 0x7F800000u : u;
}

/* Whether magnitudes compare with the float of key `bound` as their keys compare with it, whatever
 * the floating-point environment: a bound of at least the smallest normal float (a caller that treats
 * denormals as zero, as TensorFlow's threads do, then compares a denormal magnitude as 0, below it, as
 * its key is).  The vector passes of the selection compare floats only where this holds. */
static inline int float_order_holds(uint32_t bound) { return bound >= 0x00800000u; }

/* the residual of a candidate of value v sent by `sent` (0, or v - float(bfloat16(v))), non-finite -> 0 */
static inline float sent_residual(float v, int sent) {
    return sent == HVDC_SENT_BF16 ? keep_finite(v - from_bf16(to_bf16(v))) : 0.0f;
}

/* The index code of k ascending, distinct indices of [0, n) (hvdc_index_encode's, in
 * hvd_compress.schemes.bit_coding's layout) written a chunk at a time, so that a selection can pack
 * the indices it keeps as it keeps them.  Raw: int32; the bitmap's or Elias-Fano's high
 * parts: a bit set per index; Elias-Fano's low parts eight at a time where low <= 8 (eight
 * fill exactly `low` bytes: no bit writer's state through every step), else or'ed in at
 * their bit offsets.  Every chunk but the last holds a multiple of 8 indices. */
typedef struct {
    int code, low;
    i64 j;                 /* indices written so far */
    uint8_t *out, *bits;   /* the code; the bitmap or Elias-Fano's high parts */
    i64 low_nbytes, bits_len;
} index_writer;

static void index_writer_init(index_writer *iw, enum hvdc_index_code code, int low, i64 k, uint8_t *out,
                              i64 nbytes) {
    iw->low_nbytes = code == HVDC_CODE_ELIAS_FANO ? (k * low + 7) / 8 : 0;
    iw->code = code; iw->low = code == HVDC_CODE_ELIAS_FANO ? low : 0; iw->j = 0; iw->out = out;
    iw->bits = out + iw->low_nbytes;
    iw->bits_len = nbytes - iw->low_nbytes;
    if (code != HVDC_CODE_RAW) memset(out, 0, (size_t)nbytes);
}

/* value v's len bits (len + 7 <= 64) or'ed in at bit offset pos of out */
static inline void or_bits(uint8_t *out, i64 pos, uint64_t v, int len) {
    uint8_t *p = out + (pos >> 3);
    const int sh = (int)(pos & 7), nb = (sh + len + 7) / 8;
    v <<= sh;
    for (int q = 0; q < nb; q++) p[q] |= (uint8_t)(v >> (8 * q));
}

/* Elias-Fano's low parts of the next m indices (ordinals iw->j on) */
static void index_writer_low(index_writer *iw, const i64 *idx, i64 m) {
    const int low = iw->low;
    const uint64_t mask = ((uint64_t)1 << low) - 1;
    if (low > 8 || iw->j % 8) {
        for (i64 t = 0; t < m; t++) or_bits(iw->out, (iw->j + t) * low, (uint64_t)idx[t] & mask, low);
        return;
    }
    uint8_t *lp = iw->out + (iw->j / 8) * low, *const end = iw->out + iw->low_nbytes;
    for (i64 t = 0; t < m; t += 8, lp += low) {
        const int cnt = m - t < 8 ? (int)(m - t) : 8;
        uint64_t v = 0;
        if (cnt == 8) v = pack_low8(idx + t, low);
        else for (int q = 0; q < cnt; q++) v |= ((uint64_t)idx[t + q] & mask) << (q * low);
        if (end - lp >= 8) memcpy(lp, &v, 8);  /* past its `low` bytes: zeros the next octets overwrite */
        else memcpy(lp, &v, (size_t)((cnt * low + 7) / 8));  /* little-endian */
    }
}

/* the next m indices (ascending, after those written) */
static void index_writer_put(index_writer *iw, const i64 *idx, i64 m) {
    if (iw->code == HVDC_CODE_RAW) {
        int32_t *o = (int32_t *)iw->out + iw->j;
        for (i64 t = 0; t < m; t++) o[t] = (int32_t)idx[t];
        iw->j += m;
        return;
    }
    const int ef = iw->code == HVDC_CODE_ELIAS_FANO, low = iw->low;
    uint8_t *bits = iw->bits;
    const i64 ord = ef ? iw->j : 0, whole = iw->bits_len / 8;  /* the area's whole 64-bit words */
    i64 t = 0;
    /* Elias-Fano (its high part + its ordinal): eight at a time while their first word lies inside the area
     * (a bitmap's eight rarely share a word: one at a time) */
    if (ef)
        for (; t + 8 <= m && (((idx[t] >> low) + ord + t) >> 6) < whole; t += 8) set_bits8(bits, idx + t, low, ord + t, 1);
    for (; t < m; t++) {
        const i64 pos = ef ? (idx[t] >> low) + ord + t : idx[t];
        bits[pos >> 3] |= (uint8_t)(1u << (pos & 7));
    }
    if (low) index_writer_low(iw, idx, m);
    iw->j += m;
}

/* Where a selection packs what it keeps (hvdc_topk_select_pack): the index code, and the
 * values as float32 or bfloat16 bits */
typedef struct {
    index_writer iw;
    int bf16;
    void *vals;
} topk_pack;

/* the kept candidates of a chunk (m of them, ascending) into the payload */
static void topk_pack_put(topk_pack *pk, const i64 *idx, const float *vals, i64 m) {
    const i64 at = pk->iw.j;
    if (pk->bf16) {
        uint16_t *b = (uint16_t *)pk->vals + at;
        for (i64 t = 0; t < m; t++) b[t] = to_bf16(vals[t]);
    } else {
        memcpy((float *)pk->vals + at, vals, (size_t)m * sizeof(float));
    }
    index_writer_put(&pk->iw, idx, m);
}

/* The compaction of topk_select packing as it keeps (pk), where a NaN is the largest magnitude:
 * a vector of candidates at a time, their magnitudes compared with the k-th largest t (and
 * thr_sent's key) as floats, which order as the keys do (a NaN as +Inf, as its key); the kept
 * lanes' values and positions packed in registers (vcompress_store) into a chunk in L1, their
 * indices looked up and the chunk packed once it is full.  A lane equal to t is kept while
 * `ties` lasts, in index order, as in the scalar loop.  With settle, the candidates kept below
 * thr_sent or dropped at or above it into fix (kept ones flagged); returns how many. */
static i64 topk_compact_pack(const i64 *cand, const float *cand_val, i64 c, uint32_t t, i64 ties, int settle,
                             uint32_t sent_key, uint32_t *fix, topk_pack *pk) {
    enum { CHUNK = 256 };  /* a multiple of 8 */
    int32_t pos[CHUNK + VW];  /* vcompress_store's positions: not read */
    float val[CHUNK + VW];
    i64 idx[CHUNK + VW];
    float t_f, s_f;
    memcpy(&t_f, &t, 4);
    memcpy(&s_f, &sent_key, 4);
    const vf vt = vset1(t_f), vs = vset1(s_f);
    i64 nfix = 0;
    int oc = 0;
    for (i64 j = 0; j < c; j += VW) {
        const int len = c - j < VW ? (int)(c - j) : VW;
        const vf a = vload_n(cand_val + j, len);
        const vf mg = vselect(visnan(a), vset1(INFINITY), vabs(a));
        const unsigned lanes = lane_bits(len);
        unsigned keep = vbits(vcmp_gt(mg, vt)) & lanes;
        for (unsigned tie = vbits(vcmp_ge(mg, vt)) & lanes & ~keep; tie && ties > 0; tie &= tie - 1, ties--)
            keep |= 1u << __builtin_ctz(tie);
        if (settle)
            for (unsigned f = keep ^ (vbits(vcmp_ge(mg, vs)) & lanes); f; f &= f - 1) {
                const int q = __builtin_ctz(f);
                fix[nfix++] = (uint32_t)(j + q) | (((keep >> q) & 1u) << 31);
            }
        vcompress_store(val + oc, pos + oc, keep, a, (int32_t)j);
        if (len == VW) {
            oc += vcompress_i64(idx + oc, cand + j, keep);
        } else {
            for (int q = 0; q < len; q++) { idx[oc] = cand[j + q]; oc += (int)((keep >> q) & 1u); }
        }
        if (oc >= CHUNK) {
            topk_pack_put(pk, idx, val, CHUNK);
            oc -= CHUNK;
            memmove(val, val + CHUNK, (size_t)oc * sizeof(float));
            memmove(idx, idx + CHUNK, (size_t)oc * sizeof(i64));
        }
    }
    topk_pack_put(pk, idx, val, oc);
    return nfix;
}

/* From c candidates (ascending indices, with their values), the k (<= c)
 * with the largest magnitudes, ties taken in index order: their indices
 * (ascending) into out and values into out_val.  Three passes over the candidates'
 * values: a histogram of the keys' top 16 bits (the bin of the k-th largest), the keys
 * in that bin collected into tmp (c floats of room) and ranked by a histogram of their
 * low 15 bits, then the compaction, whose only branch is a tie with the k-th largest.
 * Each key is recomputed from its value, so nothing of size c is written but the bin's
 * few keys.  With acc, the residuals hvdc_compensate_select_sent wrote are settled: a
 * kept candidate below thr_sent gets its sent residual, a dropped one at or above it its
 * value back (non-finite -> 0); where thr_sent is near the k-th largest both are few. */
static void topk_select(const i64 *cand, const float *cand_val, i64 c, i64 k, enum hvdc_nan_rule nan_rule,
                        i64 *out, float *out_val, float *tmp, float *acc, int sent, float thr_sent, topk_pack *pk) {
    enum { HI = 16, LO = 31 - HI };
    const int nan_large = nan_rule == HVDC_NAN_LARGEST;
    const uint32_t sent_key = magnitude_key(thr_sent, nan_large);
    if (k >= c) {
        if (pk) {
            topk_pack_put(pk, cand, cand_val, c);
        } else {
            memcpy(out, cand, (size_t)c * sizeof(i64));
            memcpy(out_val, cand_val, (size_t)c * sizeof(float));
        }
        if (acc)
            for (i64 j = 0; j < c; j++)
                if (magnitude_key(cand_val[j], nan_large) < sent_key) acc[cand[j]] = sent_residual(cand_val[j], sent);
        return;
    }
    if (k <= 0) {
        if (acc)
            for (i64 j = 0; j < c; j++)
                if (magnitude_key(cand_val[j], nan_large) >= sent_key) acc[cand[j]] = keep_finite(cand_val[j]);
        return;
    }
    /* two histograms, even and odd candidates, summed after: neighbouring candidates often share a
     * bin, and one histogram would chain their increments through memory */
    uint32_t *hist = calloc((size_t)2 << HI, sizeof(uint32_t));
    if (!hist) return;
    uint32_t *hist2 = hist + ((size_t)1 << HI);
    i64 j2 = 0;
    for (; j2 + 2 <= c; j2 += 2) {
        hist[magnitude_key(cand_val[j2], nan_large) >> LO]++;
        hist2[magnitude_key(cand_val[j2 + 1], nan_large) >> LO]++;
    }
    if (j2 < c) hist[magnitude_key(cand_val[j2], nan_large) >> LO]++;
    for (size_t b = 0; b < (size_t)1 << HI; b++) hist[b] += hist2[b];
    i64 above = 0;  /* keys in the bins above bin */
    uint32_t bin = (1u << HI) - 1;
    while (above + hist[bin] < k) above += hist[bin--];
    uint32_t *bin_keys = (uint32_t *)tmp;  /* the low bits of the keys in bin */
    i64 m = 0;
    if (!float_order_holds(bin << LO)) {
        for (i64 j = 0; j < c; j++) {  /* a branch taken by about one candidate in the used bins' count */
            const uint32_t key = magnitude_key(cand_val[j], nan_large);
            if ((key >> LO) == bin) bin_keys[m++] = key & ((1u << LO) - 1);
        }
    } else {  /* a vector of magnitudes compared with the bin's bounds as floats (a NaN as +Inf where it is the
               * largest, as its key); only the lanes in between (about one in the used bins' count) are checked
               * by their keys */
        uint32_t lo_bits = bin << LO, hi_bits = (bin + 1) << LO;
        float lo_f, hi_f;
        memcpy(&lo_f, &lo_bits, 4);
        memcpy(&hi_f, &hi_bits, 4);  /* past +Inf: a NaN, no lane at or above it: every lane from lo_f is checked */
        const vf vlo = vset1(lo_f), vhi = vset1(hi_f);
        i64 j = 0;
        for (; j < c; j += VW) {
            const int len = c - j < VW ? (int)(c - j) : VW;
            vf a = vload_n(cand_val + j, len);
            vf mg = vabs(a);
            if (nan_large) mg = vselect(visnan(a), vset1(INFINITY), mg);
            unsigned in_bin = vbits(vcmp_ge(mg, vlo)) & ~vbits(vcmp_ge(mg, vhi)) & lane_bits(len);
            if (!nan_large) in_bin |= vbits(visnan(a)) & lane_bits(len);  /* a NaN's own key decides */
            while (in_bin) {
                const int t = __builtin_ctz(in_bin);
                in_bin &= in_bin - 1;
                const uint32_t key = magnitude_key(cand_val[j + t], nan_large);
                if ((key >> LO) == bin) bin_keys[m++] = key & ((1u << LO) - 1);
            }
        }
    }
    memset(hist, 0, ((size_t)1 << LO) * sizeof(uint32_t));
    for (i64 j = 0; j < m; j++) hist[bin_keys[j]]++;
    uint32_t low = (1u << LO) - 1;
    while (above + hist[low] < k) above += hist[low--];
    free(hist);
    const uint32_t t = (bin << LO) | low;
    i64 ties = k - above, o = 0, j = 0, nfix = 0;  /* the first `ties` candidates equal to t, in index order, are kept */
    uint32_t *fix = (uint32_t *)tmp;  /* with acc: candidates whose residual is settled below (c < 2^31), kept ones flagged */
    const int vector_pack = pk && nan_large && float_order_holds(t) && (!acc || float_order_holds(sent_key));
    if (vector_pack) {  /* the vector compaction; fix then holds every candidate to settle */
        nfix = topk_compact_pack(cand, cand_val, c, t, ties, acc != NULL, sent_key, fix, pk);
        j = c;
    }
    enum { CHUNK = 256 };  /* with pk: the kept candidates gathered here in L1, then packed (a multiple of 8) */
    i64 chunk_idx[CHUNK];
    float chunk_val[CHUNK];
    i64 *o_idx = pk ? chunk_idx : out;
    float *o_val = pk ? chunk_val : out_val;
    i64 oc = 0;  /* written into o_idx / o_val */
    for (; j < c && o < k; j++) {  /* compaction: write, then advance if kept */
        const uint32_t v = magnitude_key(cand_val[j], nan_large);
        i64 keep = v > t;
        if (v == t) {  /* rare: a branch, so that `ties` is no chain through every step */
            keep = ties > 0;
            ties -= keep;
        }
        o_idx[oc] = cand[j];
        o_val[oc] = cand_val[j];
        oc += keep;
        o += keep;
        if (acc) {  /* kept below thr_sent, or dropped at or above it */
            fix[nfix] = (uint32_t)j | ((uint32_t)keep << 31);
            nfix += keep ^ (v >= sent_key);
        }
        if (pk && oc == CHUNK) {
            topk_pack_put(pk, chunk_idx, chunk_val, CHUNK);
            oc = 0;
        }
    }
    if (pk && !vector_pack) topk_pack_put(pk, chunk_idx, chunk_val, oc);
    if (acc) {
        for (i64 d = 0; d < nfix; d++) {
            const i64 jj = fix[d] & 0x7FFFFFFFu;
            const float v = cand_val[jj];
            acc[cand[jj]] = (fix[d] >> 31) ? sent_residual(v, sent) : keep_finite(v);
        }
        for (; j < c; j++)
            if (magnitude_key(cand_val[j], nan_large) >= sent_key) acc[cand[j]] = keep_finite(cand_val[j]);
    }
}

void hvdc_topk_fixup(const i64 *cand, const float *cand_val, i64 c, i64 k, enum hvdc_nan_rule nan_rule,
                     i64 *out, float *out_val, float *tmp) {
    topk_select(cand, cand_val, c, k, nan_rule, out, out_val, tmp, NULL, HVDC_SENT_KEPT, 0.0f, NULL);
}

void hvdc_topk_select_settle(const i64 *cand, const float *cand_val, i64 c, i64 k, enum hvdc_nan_rule nan_rule,
                             i64 *out, float *out_val, float *tmp, float *acc, enum hvdc_sent_rule sent,
                             float thr_sent) {
    topk_select(cand, cand_val, c, k, nan_rule, out, out_val, tmp, acc, (int)sent, thr_sent, NULL);
}

void hvdc_topk_select_pack(const i64 *cand, const float *cand_val, i64 c, i64 k, enum hvdc_nan_rule nan_rule,
                           float *tmp, float *acc, enum hvdc_sent_rule sent, float thr_sent,
                           enum hvdc_index_code code, int low, uint8_t *idx_out, i64 nbytes, int bf16,
                           void *val_out) {
    topk_pack pk;
    index_writer_init(&pk.iw, code, low, k, idx_out, nbytes);
    pk.bf16 = bf16;
    pk.vals = val_out;
    topk_select(cand, cand_val, c, k, nan_rule, NULL, NULL, tmp, acc, (int)sent, thr_sent, &pk);
}

/* Top-K with values=BF16: bits = the kept values as bfloat16 (round half to even, every NaN
 * 0x7FC0) and, with acc, the residual at each kept index acc - float(bits), non-finite -> 0 */
void hvdc_sparse_bf16_encode(const float *vals, i64 k, const i64 *idx, float *acc, uint16_t *bits) {
    for (i64 j = 0; j < k; j++) bits[j] = to_bf16(vals[j]);
    if (acc)
        for (i64 j = 0; j < k; j++) acc[idx[j]] = keep_finite(vals[j] - from_bf16(bits[j]));
}

/* Error feedback after a selection: the residual at the k kept elements
 * becomes 0 (acc - acc), and so does that of candidates that were not kept
 * and are not finite. */
void hvdc_clear_sent(float *acc, const i64 *idx, i64 k, const i64 *cand, const float *cand_val, i64 c) {
    for (i64 j = 0; j < c; j++) if (!is_finite(cand_val[j])) acc[cand[j]] = 0.0f;
    for (i64 j = 0; j < k; j++) acc[idx[j]] = 0.0f;
}

/* ---- index codes (hvd_compress.schemes.bit_coding): raw int32, bitmap, Elias-Fano ---- */

/* idx ascending and distinct; out holds the code's byte count (zeroed here) */
void hvdc_index_encode(const i64 *idx, i64 k, i64 n, enum hvdc_index_code code, int low, uint8_t *out,
                       i64 nbytes) {
    (void)n;
    index_writer iw;
    index_writer_init(&iw, code, low, k, out, nbytes);
    index_writer_put(&iw, idx, k);
}

/* inverse of hvdc_index_encode: k ascending indices into out */
void hvdc_index_decode(const uint8_t *in, i64 k, i64 n, enum hvdc_index_code code, int low, i64 *out) {
    if (code == HVDC_CODE_RAW) { const int32_t *p = (const int32_t *)in; for (i64 j = 0; j < k; j++) out[j] = p[j]; return; }
    const uint8_t *bits = in;
    i64 len = n, shift_low = 0;
    if (code == HVDC_CODE_ELIAS_FANO) { bits = in + (k * low + 7) / 8; len = k + (n >> low) + 1; shift_low = low; }
    i64 j = 0;
    const i64 len_bytes = (len + 7) / 8;
    for (i64 byte = 0; byte < len_bytes && j < k; byte += 8) {  /* 64 bits at a time */
        uint64_t v = 0;
        memcpy(&v, bits + byte, (size_t)(len_bytes - byte < 8 ? len_bytes - byte : 8));  /* little-endian */
        while (v && j < k) {
            int t = __builtin_ctzll(v); v &= v - 1;
            i64 pos = byte * 8 + t;
            out[j] = code == HVDC_CODE_BITMAP ? pos : ((pos - j) << shift_low);
            j++;
        }
    }
    if (code == HVDC_CODE_ELIAS_FANO && low) {  /* little-endian bit reader */
        uint64_t acc = 0, mask = ((uint64_t)1 << low) - 1; int filled = 0; i64 byte = 0;
        for (i64 jj = 0; jj < k; jj++) {
            while (filled < low) { acc |= (uint64_t)in[byte++] << filled; filled += 8; }
            out[jj] |= (i64)(acc & mask);
            acc >>= low; filled -= low;
        }
    }
}

/* One rank's index code (raw int32, bitmap, or Elias-Fano) decoded a chunk of indices at a
 * time into a buffer that stays in L1, as hvdc_index_decode writes them: the bit area's set
 * bits 64 at a time, a word drained in one tight loop; Elias-Fano's low parts eight at a time
 * where low <= 8 (eight of them fill exactly `low` bytes), else by a little-endian bit reader. */
enum { INDEX_CHUNK = 512 };  /* a multiple of 8: every chunk but the last starts an octet of low parts */
typedef struct {
    int code, low;
    i64 k, j, n, prev;               /* j: indices decoded so far; prev: the last one (raw's order check) */
    const uint8_t *in, *bits, *end;  /* the whole code; the bitmap, or Elias-Fano's high parts; the code's end */
    i64 len_bytes, byte;             /* the bit area's bytes; the next 64-bit word's offset in it */
    uint64_t word;                   /* the current word's bits not yet read */
    i64 first;                       /* the ordinal of buf[0] */
    i64 top;                         /* the largest index in buf */
    int have, at;                    /* buf[at..have): decoded, not yet added */
    int status;                      /* 0, -1 raw indices not ascending, -2 an index outside [0, n) or too few */
    i64 buf[INDEX_CHUNK + 64];       /* room past the chunk: bit_positions writes whole groups of 8 */
} index_stream;

/* the positions of the next m set bits of the stream's bit area, minus their ordinal where ef,
 * into buf; returns how many (fewer: the bits ran out) */
static int index_stream_high(index_stream *st, i64 m, int ef) {
    uint64_t w = st->word;
    i64 byte = st->byte, got = 0;
    const i64 ord = ef ? st->j : 0;
    i64 *buf = st->buf;
    while (got < m) {
        while (!w) {
            byte += 8;
            if (byte >= st->len_bytes) break;
            const i64 left = st->len_bytes - byte;
            if (left >= 8) memcpy(&w, st->bits + byte, 8);  /* little-endian */
            else { w = 0; memcpy(&w, st->bits + byte, (size_t)left); }
        }
        if (!w) break;
        const i64 at = byte * 8 - (ef ? ord : 0);
        if (got + __builtin_popcountll(w) <= m) {  /* the whole word */
            got += bit_positions(w, at - (ef ? got : 0), ef, buf + got);
            w = 0;
        } else if (ef) {  /* the chunk ends inside it */
            do { buf[got] = at + __builtin_ctzll(w) - got; w &= w - 1; got++; } while (w && got < m);
        } else {
            do { buf[got++] = at + __builtin_ctzll(w); w &= w - 1; } while (w && got < m);
        }
    }
    st->word = w;
    st->byte = byte;
    return (int)got;
}

/* Elias-Fano's low parts of buf[0..got) (high parts in place) or'ed in: ordinal st->j on */
static void index_stream_low(index_stream *st, int got) {
    const int low = st->low;
    const uint64_t mask = ((uint64_t)1 << low) - 1;
    i64 *buf = st->buf;
    if (low <= 8 && st->j % 8 == 0) {  /* eight parts in `low` whole bytes */
        const uint8_t *lp = st->in + (st->j / 8) * low;
        for (int t = 0; t < got; t += 8, lp += low) {
            uint64_t w = 0;
            const i64 left = st->end - lp;
            if (left >= 8) memcpy(&w, lp, 8);
            else memcpy(&w, lp, (size_t)left);
            for (int q = 0; q < 8; q++) buf[t + q] = (buf[t + q] << low) | (i64)((w >> (q * low)) & mask);
        }
        return;
    }
    uint64_t acc = 0;
    const i64 bit0 = st->j * low;
    const uint8_t *lp = st->in + bit0 / 8;
    int filled = 0, skip = (int)(bit0 % 8);
    for (int t = 0; t < got; t++) {
        while (filled < low + skip) { acc |= (uint64_t)*lp++ << filled; filled += 8; }
        acc >>= skip; filled -= skip; skip = 0;
        buf[t] = (buf[t] << low) | (i64)(acc & mask);
        acc >>= low;
        filled -= low;
    }
}

static void index_stream_fill(index_stream *st) {
    const i64 m = st->k - st->j < INDEX_CHUNK ? st->k - st->j : INDEX_CHUNK;
    i64 *buf = st->buf;
    int got = 0;
    st->first = st->j;
    if (st->code == HVDC_CODE_RAW) {
        const int32_t *raw = (const int32_t *)st->in + st->j;
        i64 prev = st->prev;
        int bad = 0;
        for (; got < m; got++) {
            const i64 v = raw[got];
            bad |= (st->j + got > 0 && v <= prev) ? 1 : 0;
            buf[got] = v;
            prev = v;
        }
        if (bad) st->status = -1;
        st->prev = prev;
    } else {
        const int ef = st->code == HVDC_CODE_ELIAS_FANO;
        got = index_stream_high(st, m, ef);
        if (got < m) st->status = -2;  /* fewer than k set bits */
        else if (ef && st->low) index_stream_low(st, got);
    }
    i64 lo = 0, hi = 0;  /* the chunk's extremes, checked once */
    for (int t = 0; t < got; t++) {
        lo = buf[t] < lo ? buf[t] : lo;
        hi = buf[t] > hi ? buf[t] : hi;
    }
    if (lo < 0 || hi >= st->n) st->status = -2;
    st->top = hi;
    st->j += got;
    st->have = st->status ? 0 : got;
    st->at = 0;
}

static void index_stream_init(index_stream *st, const uint8_t *in, enum hvdc_index_code code, int low, i64 k, i64 n) {
    st->code = code; st->k = k; st->n = n; st->in = in;
    st->j = 0; st->prev = 0; st->word = 0; st->byte = -8;
    st->have = st->at = 0; st->status = 0; st->first = 0;
    st->low = code == HVDC_CODE_ELIAS_FANO ? low : 0;
    st->end = in;
    if (code == HVDC_CODE_BITMAP) {
        st->bits = in; st->len_bytes = (n + 7) / 8;
    } else if (code == HVDC_CODE_ELIAS_FANO) {
        st->bits = in + (k * low + 7) / 8; st->len_bytes = (k + (n >> low) + 1 + 7) / 8;
        st->end = st->bits + st->len_bytes;
    }
}

/* One rank's payload (the usual case of a one-rank decode, and every rank's own share of the
 * work): the code decoded a chunk of indices at a time into the stream's buffer in L1 (a tight
 * loop per part of the code, not one branchy step per index); the output zeroed block by block
 * up to the block of the chunk's largest index, just ahead of the chunk's values written into it
 * (in cache: the output is written once, with no copy through a block buffer and no test per
 * index but whether the indices ascend).  Same results as the general path below; a code whose
 * indices do not strictly ascend is rejected (-2) after its chunk was written. */
static i64 sparse_decode_one(const uint8_t *in, enum hvdc_index_code code, int low, i64 k, const void *vals,
                             int bf16, i64 n, float s, int scaled, float *out) {
    enum { BLOCK = 4096 };
    const float *vf = (const float *)vals;
    const uint16_t *vh = (const uint16_t *)vals;
    index_stream st;
    index_stream_init(&st, in, code, low, k, n);
    i64 zeroed = 0, prev = -1;  /* out[0, zeroed) is zeroed */
    while (st.j < k) {
        index_stream_fill(&st);
        if (st.status) return st.status;
        const i64 *ib = st.buf, base = st.first;
        const i64 upto = st.have ? ((st.top / BLOCK + 1) * BLOCK < n ? (st.top / BLOCK + 1) * BLOCK : n) : zeroed;
        for (; zeroed < upto; zeroed += BLOCK) {
            const i64 end = zeroed + BLOCK < n ? zeroed + BLOCK : n;
            memset(out + zeroed, 0, (size_t)(end - zeroed) * sizeof(float));
        }
        zeroed = upto > zeroed ? upto : zeroed;
        int bad = 0;
        for (int t = 0; t < st.have; t++) {  /* 0 + v as index_add_ into zeros (-0 -> +0), [* s] */
            const i64 at = ib[t];
            const float v = 0.0f + (bf16 ? from_bf16(vh[base + t]) : vf[base + t]);
            out[at] = scaled ? v * s : v;
            bad |= at <= prev;
            prev = at;
        }
        if (bad) return -2;
    }
    if (zeroed < n) memset(out + zeroed, 0, (size_t)(n - zeroed) * sizeof(float));
    return 0;
}

/* the sparse payloads' sum, decoded and added block by block (see hvdc_kernels.h) */
i64 hvdc_sparse_decode_sum(int nr, const uint8_t *const *codes, enum hvdc_index_code code, int low, const i64 *ks,
                           const void *const *vals, int bf16, i64 n, float s, int scaled, float *out) {
    enum { BLOCK = 4096 };
    float blk[BLOCK] __attribute__((aligned(64)));
    uint64_t touched[BLOCK / 64];
    if (nr == 1) return sparse_decode_one(codes[0], code, low, ks[0], vals[0], bf16, n, s, scaled, out);
    index_stream *st = malloc((size_t)(nr > 0 ? nr : 1) * sizeof(index_stream));
    i64 status = 0;
    if (!st) return -3;
    for (int j = 0; j < nr; j++) index_stream_init(&st[j], codes[j], code, low, ks[j], n);
    for (i64 lo = 0; lo < n && !status; lo += BLOCK) {
        const i64 hi = lo + BLOCK < n ? lo + BLOCK : n;
        const int len = (int)(hi - lo);
        memset(blk, 0, (size_t)len * sizeof(float));
        if (nr > 1 && scaled) memset(touched, 0, sizeof touched);
        for (int j = 0; j < nr && !status; j++) {
            index_stream *q = &st[j];
            const float *vf = (const float *)vals[j];
            const uint16_t *vh = (const uint16_t *)vals[j];
            for (;;) {
                if (q->at == q->have) {
                    if (q->j >= q->k) break;
                    index_stream_fill(q);
                    if (q->status) { status = q->status; break; }
                }
                const i64 *ib = q->buf;
                const i64 base = q->first;
                int t = q->at;
                const int have = q->have;
                if (nr == 1) {  /* 0 + v as index_add_ into zeros (-0 -> +0), [* s] */
                    if (bf16) for (; t < have && ib[t] < hi; t++) { float v = 0.0f + from_bf16(vh[base + t]); blk[ib[t] - lo] = scaled ? v * s : v; }
                    else for (; t < have && ib[t] < hi; t++) { float v = 0.0f + vf[base + t]; blk[ib[t] - lo] = scaled ? v * s : v; }
                } else {
                    for (; t < have && ib[t] < hi; t++) {
                        const i64 at = ib[t] - lo;
                        blk[at] += bf16 ? from_bf16(vh[base + t]) : vf[base + t];
                        if (scaled) touched[at >> 6] |= (uint64_t)1 << (at & 63);
                    }
                }
                q->at = t;
                if (t < have) break;  /* the next index is past this block */
            }
        }
        if (nr > 1 && scaled)
            for (int w = 0; w < BLOCK / 64; w++)
                for (uint64_t b = touched[w]; b; b &= b - 1) blk[64 * w + __builtin_ctzll(b)] *= s;
        memcpy(out + lo, blk, (size_t)len * sizeof(float));
    }
    for (int j = 0; j < nr && !status; j++)
        if (st[j].at != st[j].have || st[j].j != st[j].k) status = -2;  /* an index left over: at or past n */
    free(st);
    return status;
}

/* whether idx[0..k) is strictly ascending (the eager Top-K sends raw indices in torch.topk's order) */
int hvdc_is_ascending(const i64 *idx, i64 k) {
    for (i64 j = 1; j < k; j++) if (idx[j] <= idx[j - 1]) return 0;
    return 1;
}

/* Sum of nr sparse payloads (each idx ascending, distinct within a rank)
 * into a dense out of n: out = 0, then for every index the ranks' values
 * added in rank order onto 0 (as index_add_ into zeros does), [* s] where
 * touched.  One rank: the output zeroed, then a scatter.  More: block by block
 * (4096 elements) as hvdc_sparse_sum_i32, the block zeroed, every rank's
 * values added and the block scaled while it is in cache (a merge over the
 * ranks' next indices mispredicts which rank comes next about every other
 * element: 7.9 ms against 3.7-3.9 ms for two ranks' 1% of 12.6M). */
void hvdc_sparse_sum(int nr, const i64 *const *idx, const float *const *vals, const i64 *ks, i64 n,
                     float s, int scaled, float *out) {
    enum { BLOCK = 4096 };
    if (nr == 1) {  /* one rank: a scatter; 0 + v as index_add_ into zeros gives (-0 becomes +0) */
        const i64 *ix = idx[0];
        const float *v = vals[0];
        memset(out, 0, (size_t)n * sizeof(float));
        if (scaled) for (i64 j = 0; j < ks[0]; j++) out[ix[j]] = (0.0f + v[j]) * s;
        else for (i64 j = 0; j < ks[0]; j++) out[ix[j]] = 0.0f + v[j];
        return;
    }
    i64 small[64] = {0};
    i64 *pos = nr <= 64 ? small : calloc((size_t)nr, sizeof(i64));
    uint64_t touched[BLOCK / 64];
    const int whole = scales_whole_block(s), mark = scaled && !whole;
    if (!pos) return;
    for (i64 lo = 0; lo < n; lo += BLOCK) {
        const i64 hi = lo + BLOCK < n ? lo + BLOCK : n;
        memset(out + lo, 0, (size_t)(hi - lo) * sizeof(float));
        if (mark) memset(touched, 0, sizeof touched);
        add_block_i64(nr, idx, vals, ks, pos, lo, hi, mark, touched, out);
        if (scaled) scale_block(out + lo, hi - lo, s, whole, touched);
    }
    if (pos != small) free(pos);
}

/* ---- the randomised schemes: QSGD, TernGrad, Random-K ---------------------------------------------- */

/* The seeded draws are the framework's own, reproduced word for word, so a fused encode
 * sends what the eager scheme sends for the same seed:
 *   torch: torch.rand on a CPU generator after manual_seed(seed) -- mt19937 seeded by the
 *          seed's low 32 bits, each draw one 32-bit word w as (w & 0xFFFFFF) * 2^-24;
 *          randint(0, n) is w % n, randperm a Fisher-Yates shuffle drawing w % (m - i);
 *   TF:    tf.random.stateless_uniform with the seed pair (seed / 2^31, seed % 2^31) --
 *          Philox4x32-10 whose key and counter TF derives from the pair by one Philox
 *          call, four words per counter, each draw float(0x3F800000 | (w & 0x7FFFFF)) - 1.
 * Both are drawn in blocks of DRAW_BLOCK words (a whole mt19937 state, 156 Philox
 * counters), so an encode walks the gradient block by block with the block's draws in
 * cache.  tests/unit/test_kernels.py holds hvdc_uniform to torch.rand and to
 * tf.random.stateless_uniform bit for bit. */
enum { MT_N = 624, MT_M = 397, DRAW_BLOCK = MT_N };

typedef struct {
    int tf;
    uint32_t mt[MT_N];                  /* torch: the mt19937 state */
    uint32_t key[2]; uint64_t ctr[2];   /* TF: the Philox key and 128-bit counter */
} draw_stream;

static void stream_seed(draw_stream *st, enum hvdc_framework fw, i64 seed);
static void stream_next(draw_stream *st, uint32_t *w);  /* the next DRAW_BLOCK words */

static const uint32_t MT_UPPER = 0x80000000u, MT_LOWER = 0x7fffffffu, MT_MATRIX = 0x9908b0dfu;

static inline uint32_t mt_mix(uint32_t a, uint32_t b, uint32_t m) {
    uint32_t y = (a & MT_UPPER) | (b & MT_LOWER);
    return m ^ (y >> 1) ^ ((0u - (y & 1u)) & MT_MATRIX);
}

/* one mt19937 generation of MT_N words, tempered into w (two loops without a branch, each
 * vectorised by the compiler: the second reads words the first wrote 227 places back) */
static void mt_block(uint32_t *s, uint32_t *w) {
    for (int i = 0; i < MT_N - MT_M; i++) s[i] = mt_mix(s[i], s[i + 1], s[i + MT_M]);
    for (int i = MT_N - MT_M; i < MT_N - 1; i++) s[i] = mt_mix(s[i], s[i + 1], s[i + MT_M - MT_N]);
    s[MT_N - 1] = mt_mix(s[MT_N - 1], s[0], s[MT_M - 1]);
    for (int i = 0; i < MT_N; i++) {
        uint32_t y = s[i];
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c5680u;
        y ^= (y << 15) & 0xefc60000u;
        y ^= y >> 18;
        w[i] = y;
    }
}

/* Philox4x32-10 of counter c under key k, into out */
static inline void philox(const uint32_t c_in[4], const uint32_t k_in[2], uint32_t out[4]) {
    uint32_t c0 = c_in[0], c1 = c_in[1], c2 = c_in[2], c3 = c_in[3], k0 = k_in[0], k1 = k_in[1];
    for (int round = 0; round < 10; round++) {
        uint64_t p0 = (uint64_t)0xD2511F53u * c0, p1 = (uint64_t)0xCD9E8D57u * c2;
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0, n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        c0 = n0; c1 = (uint32_t)p1; c2 = n2; c3 = (uint32_t)p0;
        k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
    }
    out[0] = c0; out[1] = c1; out[2] = c2; out[3] = c3;
}

static void stream_seed(draw_stream *st, enum hvdc_framework fw, i64 seed) {
    st->tf = fw == HVDC_FW_TF;
    if (!st->tf) {
        st->mt[0] = (uint32_t)seed;
        for (int j = 1; j < MT_N; j++) st->mt[j] = 1812433253u * (st->mt[j - 1] ^ (st->mt[j - 1] >> 30)) + (uint32_t)j;
        return;
    }
    /* tf.random.stateless_uniform: the pair (seed // 2^31, seed % 2^31) scrambled by one Philox call */
    uint64_t s0 = (uint64_t)(seed >> 31), s1 = (uint64_t)(seed & 0x7FFFFFFF);
    uint32_t c[4] = {(uint32_t)s0, (uint32_t)(s0 >> 32), (uint32_t)s1, (uint32_t)(s1 >> 32)}, k[2] = {0x3ec8f720u, 0x02461e29u}, mix[4];
    philox(c, k, mix);
    st->key[0] = mix[0]; st->key[1] = mix[1];
    st->ctr[0] = 0; st->ctr[1] = (uint64_t)mix[2] | ((uint64_t)mix[3] << 32);
}

/* DRAW_BLOCK / 4 Philox calls on consecutive counters, computed as lanes (round by round
 * over arrays, which the compiler vectorises with widening multiplies), then interleaved
 * into w four words per counter */
static void philox_block(draw_stream *st, uint32_t *w) {
    enum { C = DRAW_BLOCK / 4 };
    uint32_t c0[C], c1[C], c2[C], c3[C];
    for (int j = 0; j < C; j++) {
        uint64_t lo = st->ctr[0] + (uint64_t)j, hi = st->ctr[1] + (lo < st->ctr[0]);
        c0[j] = (uint32_t)lo; c1[j] = (uint32_t)(lo >> 32); c2[j] = (uint32_t)hi; c3[j] = (uint32_t)(hi >> 32);
    }
    uint64_t next = st->ctr[0] + C;
    st->ctr[1] += next < st->ctr[0];
    st->ctr[0] = next;
    uint32_t k0 = st->key[0], k1 = st->key[1];
    for (int round = 0; round < 10; round++) {
        for (int j = 0; j < C; j++) {
            uint64_t p0 = (uint64_t)0xD2511F53u * c0[j], p1 = (uint64_t)0xCD9E8D57u * c2[j];
            uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1[j] ^ k0, n2 = (uint32_t)(p0 >> 32) ^ c3[j] ^ k1;
            c0[j] = n0; c1[j] = (uint32_t)p1; c2[j] = n2; c3[j] = (uint32_t)p0;
        }
        k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
    }
    for (int j = 0; j < C; j++) { w[4 * j] = c0[j]; w[4 * j + 1] = c1[j]; w[4 * j + 2] = c2[j]; w[4 * j + 3] = c3[j]; }
}

static void stream_next(draw_stream *st, uint32_t *w) {
    if (st->tf) philox_block(st, w);
    else mt_block(st->mt, w);
}

/* the block's words as draws U[0, 1), the framework's conversion */
static void words_to_uniform(int tf, const uint32_t *w, float *u, int len) {
    if (tf) {
        for (int i = 0; i < len; i++) {
            uint32_t b = 0x3F800000u | (w[i] & 0x7FFFFFu); float f; memcpy(&f, &b, 4); u[i] = f - 1.0f;
        }
    } else {
        for (int i = 0; i < len; i++) u[i] = (float)(w[i] & 0xFFFFFFu) * 0x1p-24f;
    }
}

void hvdc_uniform(enum hvdc_framework fw, i64 seed, i64 n, float *u) {
    draw_stream st; uint32_t w[DRAW_BLOCK];
    stream_seed(&st, fw, seed);
    for (i64 lo = 0; lo < n; lo += DRAW_BLOCK) {
        stream_next(&st, w);
        words_to_uniform(st.tf, w, u + lo, (int)(n - lo < DRAW_BLOCK ? n - lo : DRAW_BLOCK));
    }
}

/* The draws of one block: from the caller's u, or the stream's next block into buf */
static const float *block_draws(draw_stream *st, const float *u, i64 lo, int len, uint32_t *w, float *buf) {
    if (u) return u + lo;
    stream_next(st, w);
    words_to_uniform(st->tf, w, buf, len);
    return buf;
}

/* sign(a) as the framework computes it: torch (a > 0) - (a < 0), so 0 for NaN; TF NaN */
HVDC_INLINE vf vsign(vf a, int tf) {
    const vf one = vset1(1.0f), zero = vzero();
    vf s = vsub(vselect(vcmp_gt(a, zero), one, zero), vselect(vcmp_gt(zero, a), one, zero));
    return tf ? vselect(visnan(a), a, s) : s;
}

/* acc = x + r into r (with r); returns sum acc^2 (float lanes per 4096-element block,
 * each block's sum added in double, as compensate_l1) */
HVDC_INLINE vf l2_step(const float *x, float *r, i64 i, int len, vf part) {
    vf a = vload_n(x + i, len);
    if (r) {
        a = vadd(a, vload_n(r + i, len));
        vstore_n(r + i, a, len);
    }
    return vadd(part, vmul(a, a));
}

static double compensate_l2(const float *x, float *r, i64 n) {
    double sq = 0.0;
    for (i64 lo = 0; lo < n; lo += 4096) {
        i64 hi = lo + 4096 < n ? lo + 4096 : n, i = lo;
        vf part = vzero();
        for (; i + VW <= hi; i += VW) part = l2_step(x, r, i, VW, part);
        if (i < hi) part = l2_step(x, r, i, (int)(hi - i), part);
        sq += (double)vreduce_add(part);
    }
    return sq;
}

/* one step of QSGD's second pass: q = clip(floor(|a| / s * L + u), 0, L) * sign(a) */
HVDC_INLINE void qsgd_step(const float *acc, float *r, i64 i, int len, const float *u, vf vs, vf vl, vf vstep,
                           int tf, int8_t *q) {
    vf a = vload_n(acc + i, len);
    vf level = vmul(vdiv(vabs(a), vs), vl);
    vf v = vmul(vmin(vl, vmax(vzero(), vfloor(vadd(level, vload_n(u, len))))), vsign(a, tf));
    vstore_i8_n(q + i, vselect(visnan(v), vset1(tf ? -128.0f : 0.0f), v), len);
    if (r) vstore_n(r + i, vkeep_finite(vsub(a, vmul(v, vstep))), len);
}

void hvdc_qsgd_encode(const float *x, float *r, i64 n, int levels, const float *u, enum hvdc_framework fw, i64 seed,
                      int8_t *q, float *norm) {
    const int tf = fw == HVDC_FW_TF;
    float nrm = n ? (float)sqrt(compensate_l2(x, r, n)) : 0.0f;
    *norm = nrm;
    const float safe = nrm == 0.0f ? 1.0f : nrm, L = (float)levels;
    const vf vs = vset1(safe), vl = vset1(L), vstep = vset1(safe / L);
    const float *acc = r ? r : x;
    draw_stream st; uint32_t w[DRAW_BLOCK]; float buf[DRAW_BLOCK];
    if (!u) stream_seed(&st, fw, seed);
    for (i64 lo = 0; lo < n; lo += DRAW_BLOCK) {
        int len = (int)(n - lo < DRAW_BLOCK ? n - lo : DRAW_BLOCK), j = 0;
        const float *d = block_draws(&st, u, lo, len, w, buf);
        for (; j + VW <= len; j += VW) qsgd_step(acc, r, lo + j, VW, d + j, vs, vl, vstep, tf, q);
        if (j < len) qsgd_step(acc, r, lo + j, len - j, d + j, vs, vl, vstep, tf, q);
    }
}

/* bits 0..15 of b spread to the even bits 0..30 */
static inline uint32_t spread_bits(uint32_t b) {
    b &= 0xFFFFu;
    b = (b | (b << 8)) & 0x00FF00FFu;
    b = (b | (b << 4)) & 0x0F0F0F0Fu;
    b = (b | (b << 2)) & 0x33333333u;
    return (b | (b << 1)) & 0x55555555u;
}

/* one step of TernGrad's second pass: t = (u < |a| / s) * sign(a) in {-1, 0, 1}; its code
 * t + 1 from two lane masks (code 2: kept and positive; code 1: t is 0; code 0: t is -1, or
 * NaN in TF, whose int32 cast INT_MIN leaves pack_bits its low bits 0); the residual
 * a - t * scale.  i is a multiple of 4, so the lanes' codes fill whole bytes. */
HVDC_INLINE void terngrad_step(const float *acc, float *r, i64 i, int len, const float *u, vf vsafe, vf vscale,
                               int tf, uint8_t *codes) {
    const vf zero = vzero(), one = vset1(1.0f);
    vf a = vload_n(acc + i, len);
    vmask keep = vcmp_gt(vdiv(vabs(a), vsafe), vload_n(u, len)), pos = vcmp_gt(a, zero), neg = vcmp_gt(zero, a);
    unsigned kb = vbits(keep), pb = vbits(pos), nb = vbits(neg), lanes = lane_bits(len);
    unsigned two = kb & pb, one_ = ~(kb & (pb | nb)) & lanes;
    if (tf) one_ &= ~vbits(visnan(a));
    uint32_t packed = spread_bits(one_) | (spread_bits(two) << 1);
    for (int b = 0; b < (len + 3) / 4; b++) codes[i / 4 + b] = (uint8_t)(packed >> (8 * b));
    if (r) {
        vf t = vselect(keep, vsub(vselect(pos, one, zero), vselect(neg, one, zero)), zero);
        vstore_n(r + i, vkeep_finite(vsub(a, vmul(t, vscale))), len);
    }
}

void hvdc_terngrad_encode(const float *x, float *r, i64 n, const float *u, enum hvdc_framework fw, i64 seed,
                          uint8_t *codes, float *scale) {
    const int tf = fw == HVDC_FW_TF;
    float s = n ? int8_block_amax(x, r, 0, n) : 0.0f;  /* acc into r; NaN if any acc is */
    *scale = s;
    const vf vsafe = vset1(s > 0.0f ? s : 1.0f), vscale = vset1(s);
    const float *acc = r ? r : x;
    draw_stream st; uint32_t w[DRAW_BLOCK]; float buf[DRAW_BLOCK];
    if (!u) stream_seed(&st, fw, seed);
    for (i64 lo = 0; lo < n; lo += DRAW_BLOCK) {
        int len = (int)(n - lo < DRAW_BLOCK ? n - lo : DRAW_BLOCK), j = 0;
        const float *d = block_draws(&st, u, lo, len, w, buf);
        for (; j + VW <= len; j += VW) terngrad_step(acc, r, lo + j, VW, d + j, vsafe, vscale, tf, codes);
        if (j < len) terngrad_step(acc, r, lo + j, len - j, d + j, vsafe, vscale, tf, codes);
    }
}

/* the even bits 0..30 of b gathered to bits 0..15 (the inverse of spread_bits) */
static inline uint32_t gather_even_bits(uint32_t b) {
    b &= 0x55555555u;
    b = (b | (b >> 1)) & 0x33333333u;
    b = (b | (b >> 2)) & 0x0F0F0F0Fu;
    b = (b | (b >> 4)) & 0x00FF00FFu;
    return (b | (b >> 8)) & 0xFFFFu;
}

/* one step of rank j's decoded (code - 1) * scale added onto out (first: written); i is a
 * multiple of 4 */
HVDC_INLINE void terngrad_accumulate_step(const uint8_t *codes, i64 i, int len, vf vs, int first, float *out) {
    const vf zero = vzero(), one = vset1(1.0f), two = vset1(2.0f);
    uint32_t packed = 0;
    for (int b = 0; b < (len + 3) / 4; b++) packed |= (uint32_t)codes[i / 4 + b] << (8 * b);
    vf c = vadd(vselect(vmask_from_bits(gather_even_bits(packed)), one, zero),
                vselect(vmask_from_bits(gather_even_bits(packed >> 1)), two, zero));
    vf d = vmul(vsub(c, one), vs);
    vstore_n(out + i, first ? d : vadd(vload_n(out + i, len), d), len);
}

/* out = sum_j (code_j - 1) * scales[j] [* s], ranks in order, chunk by chunk */
void hvdc_terngrad_decode_sum(int nr, const uint8_t *const *codes, const float *scales, i64 n, float s, int scaled,
                              float *out) {
    const i64 chunk = 4096;
    for (i64 lo = 0; lo < n; lo += chunk) {
        i64 len = lo + chunk < n ? chunk : n - lo;
        for (int j = 0; j < nr; j++) {
            const vf vs = vset1(scales[j]);
            i64 i = 0;
            for (; i + VW <= len; i += VW) terngrad_accumulate_step(codes[j] + lo / 4, i, VW, vs, j == 0, out + lo);
            if (i < len) terngrad_accumulate_step(codes[j] + lo / 4, i, (int)(len - i), vs, j == 0, out + lo);
        }
        if (scaled) for (i64 i = 0; i < len; i++) out[lo + i] *= s;
    }
}

/* torch's randperm_prefix on a CPU generator (hvd_compress/backend/torch_backend.py), word
 * for word: m = 2k + 64 words w % n (randint), their distinct values in ascending order
 * (unique: a bitmap of n bits), then randperm(u) -- Fisher-Yates, position i swapped with
 * i + w % (u - i) -- of which only the first k positions are kept, so the shuffle stops
 * there; the kept values come out ascending by a flag on each, in the sorted order of the
 * distinct values.  scratch holds the distinct values and the permutation (32 bits each)
 * and the flags (a byte each): 9 m bytes of its 16 m. */
i64 hvdc_randomk_indices_torch(i64 seed, i64 n, i64 k, i64 *idx, uint64_t *seen, i64 *scratch) {
    if (k * 8 >= n || n >= ((i64)1 << 31)) return -1;
    const i64 m = 2 * k + 64, words = (n + 63) / 64;
    uint32_t *uniq = (uint32_t *)scratch, *perm = uniq + m;  /* 32-bit: half the cache misses of the shuffle */
    uint8_t *kept = (uint8_t *)(perm + m);
    draw_stream st; uint32_t w[DRAW_BLOCK];
    stream_seed(&st, HVDC_FW_TORCH, seed);
    memset(seen, 0, (size_t)words * sizeof(uint64_t));
    int used = DRAW_BLOCK;
#define NEXT_WORD() (used == DRAW_BLOCK ? (stream_next(&st, w), used = 0, w[used++]) : w[used++])
    /* w % n without a division per draw: Lemire's exact 32-bit remainder by a 64-bit
     * reciprocal (fastmod), the same value for every w and n < 2^32 */
    const uint64_t recip = UINT64_C(0xFFFFFFFFFFFFFFFF) / (uint64_t)n + 1;
    for (i64 j = 0; j < m; j++) {
        uint32_t w32 = NEXT_WORD();
        uint32_t v = (uint32_t)(((unsigned __int128)(recip * w32) * (uint64_t)n) >> 64);
        seen[v >> 6] |= (uint64_t)1 << (v & 63);
    }
    i64 u = 0;
    for (i64 b = 0; b < words; b++)
        for (uint64_t bits = seen[b]; bits; bits &= bits - 1) uniq[u++] = (uint32_t)(b * 64 + __builtin_ctzll(bits));
    if (u < k) return -1;
    for (i64 i = 0; i < u; i++) { perm[i] = (uint32_t)i; kept[i] = 0; }
    for (i64 i = 0; i < k && i < u - 1; i++) {
        i64 z = (i64)(NEXT_WORD() % (uint32_t)(u - i));
        uint32_t t = perm[i]; perm[i] = perm[z + i]; perm[z + i] = t;
    }
#undef NEXT_WORD
    for (i64 i = 0; i < k; i++) kept[perm[i]] = 1;
    i64 o = 0;
    for (i64 i = 0; i < u; i++) if (kept[i]) idx[o++] = uniq[i];
    return o;
}

/* The TF draws whose 23-bit key (the mantissa: a draw's order) is at least floor_m, in
 * index order: their indices into cand and keys into keys, up to room of them (beyond:
 * only counted).  One pass of the generator; nothing is written for the other draws. */
static i64 tf_draws_at_least(i64 seed, i64 n, uint32_t floor_m, i64 *cand, uint32_t *keys, i64 room) {
    draw_stream st;
    uint32_t w[DRAW_BLOCK];
    float f[DRAW_BLOCK];  /* the keys as the floats 1 + key 2^-23, which order as the keys */
    const uint32_t floor_bits = 0x3F800000u | floor_m;
    float floor_f;
    memcpy(&floor_f, &floor_bits, 4);
    const vf vfloor_f = vset1(floor_f);
    stream_seed(&st, HVDC_FW_TF, seed);
    i64 c = 0;
    for (i64 lo = 0; lo < n; lo += DRAW_BLOCK) {
        const int len = (int)(n - lo < DRAW_BLOCK ? n - lo : DRAW_BLOCK);
        stream_next(&st, w);
        for (int j = 0; j < len; j++) { uint32_t b = 0x3F800000u | (w[j] & 0x7FFFFFu); memcpy(f + j, &b, 4); }
        for (int j = 0; j < len; j += VW) {  /* the lanes at or above the floor, by a vector compare */
            const int l = len - j < VW ? len - j : VW;
            for (unsigned take = vbits(vcmp_ge(vload_n(f + j, l), vfloor_f)) & lane_bits(l); take; take &= take - 1) {
                const int t = j + __builtin_ctz(take);
                if (c < room) { cand[c] = lo + t; keys[c] = w[t] & 0x7FFFFFu; }
                c++;
            }
        }
    }
    return c;
}

/* TF's randperm_prefix: the k largest of n stateless-uniform draws, ties to the lower index
 * (tf.math.top_k's order), ascending.  A draw's order is its 23 mantissa bits, uniform, so
 * a floor with k + 8 sqrt(k) + 64 draws expected at or above it holds the k largest: one
 * pass of the generator collects those draws (index and key, in index order), and only
 * they are ranked -- by a histogram of their top 12 key bits, then of the low 11 bits
 * within the bin of the k-th largest -- and compacted to the k kept: those above the
 * k-th largest, and the lowest indices among the draws equal to it.  Where the floor
 * holds fewer than k draws or more than the room (never seen), a histogram pass over all
 * n draws places it exactly and the collection runs again. */
#ifndef HVDC_RANDOMK_TF_FLOOR_SCALE
#define HVDC_RANDOMK_TF_FLOOR_SCALE 1.0  /* the draws expected above the floor, in units of k + 8 sqrt(k) + 64
                                          * (a test builds other values to take the histogram's path) */
#endif
void hvdc_randomk_indices_tf(i64 seed, i64 n, i64 k, i64 *idx, uint32_t *keys) {
    if (k <= 0) return;
    enum { HI = 12, LO = 23 - HI };
    const i64 room = k + n / 64 + 4096;
    const double want = HVDC_RANDOMK_TF_FLOOR_SCALE * ((double)k + 8.0 * sqrt((double)k) + 64.0);
    const double below = want >= (double)n ? 0.0 : 8388608.0 - ceil(want * 8388608.0 / (double)n);
    uint32_t floor_m = below > 0.0 ? (uint32_t)below : 0u;
    i64 *cand = idx;
    uint32_t *ckeys = keys;
    i64 c = tf_draws_at_least(seed, n, floor_m, cand, ckeys, room);
    uint32_t hist[1 << HI], lo_hist[1 << LO];
    if (c < k || c > room) {  /* the floor missed: placed by a histogram of every draw's top bits */
        draw_stream st;
        uint32_t w[DRAW_BLOCK];
        stream_seed(&st, HVDC_FW_TF, seed);
        memset(hist, 0, sizeof hist);
        for (i64 lo = 0; lo < n; lo += DRAW_BLOCK) {
            const int len = (int)(n - lo < DRAW_BLOCK ? n - lo : DRAW_BLOCK);
            stream_next(&st, w);
            for (int j = 0; j < len; j++) hist[(w[j] & 0x7FFFFFu) >> LO]++;
        }
        i64 above = 0;
        int bin = (1 << HI) - 1;
        while (above + hist[bin] < k) above += hist[bin--];
        floor_m = (uint32_t)bin << LO;
        const i64 got = above + hist[bin];
        if (got > room) {  /* a bin beyond the room: buffers of its own */
            cand = malloc((size_t)got * sizeof(i64));
            ckeys = malloc((size_t)got * sizeof(uint32_t));
            if (!cand || !ckeys) { free(cand); free(ckeys); return; }
        }
        c = tf_draws_at_least(seed, n, floor_m, cand, ckeys, got > room ? got : room);
    }
    memset(hist, 0, sizeof hist);
    memset(lo_hist, 0, sizeof lo_hist);
    for (i64 j = 0; j < c; j++) hist[ckeys[j] >> LO]++;
    i64 above = 0;  /* candidates in the bins above bin */
    int bin = (1 << HI) - 1;
    while (above + hist[bin] < k) above += hist[bin--];
    for (i64 j = 0; j < c; j++) if ((ckeys[j] >> LO) == (uint32_t)bin) lo_hist[ckeys[j] & ((1u << LO) - 1)]++;
    int low = (1 << LO) - 1;
    while (above + lo_hist[low] < k) above += lo_hist[low--];
    const uint32_t thr = ((uint32_t)bin << LO) | (uint32_t)low;
    i64 ties = k - above, o = 0;  /* of the draws equal to thr, the first ties are kept */
    for (i64 j = 0; j < c; j++) {  /* o <= j: in place where cand is idx */
        const uint32_t m = ckeys[j];
        if (m > thr || (m == thr && ties-- > 0)) idx[o++] = cand[j];
    }
    if (cand != idx) { free(cand); free(ckeys); }
}

void hvdc_randomk_encode(const float *x, float *r, i64 n, const i64 *idx, i64 k, float *vals) {
    if (!r) { for (i64 j = 0; j < k; j++) vals[j] = x[idx[j]]; return; }
    for (i64 j = 0; j < k; j++) vals[j] = x[idx[j]] + r[idx[j]];
    for (i64 i = 0; i < n; i++) r[i] = keep_finite(x[i] + r[i]);
    for (i64 j = 0; j < k; j++) r[idx[j]] = 0.0f;
}

void hvdc_scatter(const i64 *idx, i64 k, const float *vals, i64 n, float *out) {
    memset(out, 0, (size_t)n * sizeof(float));
    for (i64 j = 0; j < k; j++) out[idx[j]] = 0.0f + vals[j];
}

/* ---- Lossless: the byte shuffle around zstd ------------------------------------------- */

/* bytes a Lossless pass asks for ahead of its reads from memory (__builtin_prefetch into L1):
 * the shuffle's reads of the tensor and a later rank's un-shuffle's reads of the sum come in
 * one burst between two zstd calls, where the hardware's stream prefetcher alone keeps too
 * few lines in flight (the shuffle block by block from memory: 1.15-1.23 copies without,
 * 0.84-0.91 with: shuffle_alone of scripts/lossless_cost.py) */
#ifndef LOSSLESS_AHEAD
#define LOSSLESS_AHEAD 4096
#endif
enum { LOSSLESS_STEP = 4 * VW, LOSSLESS_AHEAD_FLOATS = LOSSLESS_AHEAD / sizeof(float) };

/* asks for the lines of the step of floats LOSSLESS_AHEAD bytes after x */
HVDC_INLINE void prefetch_step_ahead(const float *x) {
    const char *next = (const char *)(x + LOSSLESS_AHEAD_FLOATS);
    for (int k = 0; k < LOSSLESS_STEP * (int)sizeof(float); k += 64) __builtin_prefetch(next + k, 0, 3);
}

/* where the steps of m floats (i + LOSSLESS_STEP <= the result) may ask for the step ahead:
 * its floats lie below readable */
static inline i64 ahead_end(i64 m, i64 readable) {
    const i64 end = readable - LOSSLESS_AHEAD_FLOATS;
    return end < m ? end : m;
}

/* x[0..m) as four planes of m bytes at p, byte k of x[i] at p[k m + i]; x[0..readable)
 * may be read (readable >= m: the lines ahead are asked for up to there) */
static void shuffle_block(const float *x, i64 m, i64 readable, uint8_t *p) {
    const i64 ahead = ahead_end(m, readable);
    i64 i = 0;
    for (; i + LOSSLESS_STEP <= ahead; i += LOSSLESS_STEP) {
        prefetch_step_ahead(x + i);
        vsplit_bytes4(x + i, p + i, m);
    }
    for (; i + LOSSLESS_STEP <= m; i += LOSSLESS_STEP) vsplit_bytes4(x + i, p + i, m);
    const uint8_t *b = (const uint8_t *)x;
    for (; i < m; i++) p[i] = b[4 * i], p[m + i] = b[4 * i + 1], p[2 * m + i] = b[4 * i + 2], p[3 * m + i] = b[4 * i + 3];
}

/* Each block of `block` elements (the last one shorter) as four planes of its length m,
 * byte k of x[lo + i] at planes[4 lo + k m + i] (little-endian: plane 0 the mantissa's low
 * byte), 4 VW elements a step (vsplit_bytes4) */
void hvdc_byte_shuffle(const float *x, i64 n, i64 block, uint8_t *planes) {
    if (block <= 0) block = n > 0 ? n : 1;
    for (i64 lo = 0; lo < n; lo += block) {
        const i64 m = lo + block < n ? block : n - lo;
        shuffle_block(x + lo, m, n - lo, planes + 4 * lo);
    }
}

/* one step of the un-shuffle: v (len floats) added into out */
HVDC_INLINE void unshuffle_store(vf v, float *out, int len, int first, vf vs, int scaled, int stream) {
    if (!first) v = vadd(vload_n(out, len), v);
    if (scaled) v = vmul(v, vs);
    if (stream && len == VW) vstream(out, v);
    else vstore_n(out, v, len);
}

/* LOSSLESS_STEP floats of the un-shuffle from i on */
HVDC_INLINE void unshuffle_step(const uint8_t *planes, i64 n, i64 i, int first, vf vs, int scaled, int stream,
                                float *out) {
    vf v[4];
    vjoin_bytes4(planes + i, n, v);
    for (int j = 0; j < 4; j++) unshuffle_store(v[j], out + i + j * VW, VW, first, vs, scaled, stream);
}

/* hvdc_byte_unshuffle_add, its stores bypassing the caches where `stream` (out aligned to VW
 * floats); out[0..readable) may be read (readable >= n: unless first, the lines of out ahead
 * are asked for up to there) */
static void unshuffle_add(const uint8_t *planes, i64 n, i64 readable, int first, float s, int scaled, int stream,
                          float *out) {
    const vf vs = vset1(s);
    const i64 ahead = first ? 0 : ahead_end(n, readable);
    i64 i = 0;
    for (; i + LOSSLESS_STEP <= ahead; i += LOSSLESS_STEP) {
        prefetch_step_ahead(out + i);
        unshuffle_step(planes, n, i, first, vs, scaled, stream, out);
    }
    for (; i + LOSSLESS_STEP <= n; i += LOSSLESS_STEP) unshuffle_step(planes, n, i, first, vs, scaled, stream, out);
    for (; i < n; i += VW) {
        const int len = n - i < VW ? (int)(n - i) : VW;
        unshuffle_store(vjoin_bytes_n(planes + i, n, len), out + i, len, first, vs, scaled, stream);
    }
}

/* out[i] = v, or out[i] + v unless first, [* s], v the float whose bytes are planes[k n + i] */
void hvdc_byte_unshuffle_add(const uint8_t *planes, i64 n, int first, float s, int scaled, float *out) {
    unshuffle_add(planes, n, n, first, s, scaled, 0, out);
}

/* outputs of at least this many floats are written past the caches by hvdc_lossless_decode_add */
#ifndef LOSSLESS_STREAM_MIN
#define LOSSLESS_STREAM_MIN ((i64)1 << 22)
#endif

/* zstd's functions as hvdc_lossless_encode/decode_add take them (zstd.h's prototypes, with
 * void * for its context types) */
typedef size_t (*zstd_compress_fn)(void *cctx, void *dst, size_t cap, const void *src, size_t n, int level);
typedef size_t (*zstd_decompress_fn)(void *dctx, void *dst, size_t cap, const void *src, size_t n);
typedef size_t (*zstd_frame_size_fn)(const void *src, size_t n);
typedef unsigned (*zstd_is_error_fn)(size_t code);

i64 hvdc_lossless_encode(const float *x, i64 n, i64 block, int level, void *const *zstd, void *cctx, uint8_t *scratch,
                         uint8_t *out, i64 cap) {
    const zstd_compress_fn compress = (zstd_compress_fn)zstd[0];
    const zstd_is_error_fn is_error = (zstd_is_error_fn)zstd[3];
    if (block <= 0) block = n > 0 ? n : 1;
    i64 size = 0;
    for (i64 lo = 0; lo < n; lo += block) {
        const i64 m = lo + block < n ? block : n - lo;
        shuffle_block(x + lo, m, n - lo, scratch);
        const size_t got = compress(cctx, out + size, (size_t)(cap - size), scratch, (size_t)(4 * m), level);
        if (is_error(got)) return -1;
        size += (i64)got;
    }
    return size;
}

i64 hvdc_lossless_decode_add(const uint8_t *blob, i64 size, i64 n, i64 block, void *const *zstd, void *dctx,
                             uint8_t *scratch, int first, float s, int scaled, float *out) {
    const zstd_decompress_fn decompress = (zstd_decompress_fn)zstd[1];
    const zstd_frame_size_fn frame_size = (zstd_frame_size_fn)zstd[2];
    const zstd_is_error_fn is_error = (zstd_is_error_fn)zstd[3];
    if (block <= 0) block = n > 0 ? n : 1;
    const int stream = n >= LOSSLESS_STREAM_MIN && block % VW == 0 && ((uintptr_t)out % (VW * sizeof(float))) == 0;
    i64 off = 0;
    for (i64 lo = 0; lo < n; lo += block) {
        const i64 m = lo + block < n ? block : n - lo;
        const size_t f = frame_size(blob + off, (size_t)(size - off));
        if (is_error(f)) return -1;
        const size_t got = decompress(dctx, scratch, (size_t)(4 * m), blob + off, f);
        if (is_error(got) || got != (size_t)(4 * m)) return -2;
        unshuffle_add(scratch, m, n - lo, first, s, scaled, stream, out + lo);
        off += (i64)f;
    }
    if (stream) vstream_fence();
    return off == size ? 0 : -3;
}
