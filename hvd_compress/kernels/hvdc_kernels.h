/* hvd_compress's fused CPU kernels: the one declaration of every exported function and
 * of the named values they take.
 *
 * Included by hvdc_kernels.c (the definitions) and hvdc_tf_ops.cc (the TensorFlow ops
 * that call them), so a compiler holds both to these prototypes.  The Python side
 * mirrors it: the ctypes signatures in hvd_compress/kernels/native.py (SIGNATURES) and
 * the enums in hvd_compress/kernels/constants.py; tests/unit/test_kernels_header.py
 * parses this file and fails where either drifts from it.
 *
 * Conventions: n is the element count; a residual pointer r may be NULL (no error
 * feedback: the input x is compressed as it is).  With r, the compensated gradient
 * acc = x + r is written into r first (in place), and r ends as the new residual
 * acc - sent.  Bit streams are little-endian: bit j of byte i is element 8 i + j, as
 * hvd_compress.schemes.bit_coding.pack_bits writes them.  A decode over nr ranks sums them in rank
 * order and, where `scaled` is nonzero, multiplies the sum by s.
 *
 * Keep to one declaration per line group ending in ");" and to the types below
 * (i64, int, float, the enums, and pointers): the test's parser reads only those.
 */
#ifndef HVDC_KERNELS_H
#define HVDC_KERNELS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef int64_t i64;

/* hvdc_sign_encode's mode, and the TF sign ops' (which also run OneBit) */
enum hvdc_sign_mode {
    HVDC_SIGN_SIGNSGD = 0,   /* sent = +-1; the decode is a majority vote */
    HVDC_SIGN_EFSIGNSGD = 1, /* sent = +-scale, scale = sum|acc| / n */
    HVDC_SIGN_ONEBIT = 2     /* sent = the mean of acc on its side of zero (hvdc_onebit_encode) */
};

/* hvdc_half_encode's 16-bit float */
enum hvdc_half_dtype {
    HVDC_HALF_FP16 = 0, /* IEEE half */
    HVDC_HALF_BF16 = 1  /* bfloat16, round half to even, every NaN 0x7FC0 */
};

/* the index codes of hvd_compress.schemes.bit_coding (INDEX_CODES, in this order) */
enum hvdc_index_code {
    HVDC_CODE_RAW = 0,       /* int32 indices */
    HVDC_CODE_BITMAP = 1,    /* one bit per element */
    HVDC_CODE_ELIAS_FANO = 2 /* low bits packed, then the unary high parts */
};

/* where a NaN magnitude stands in a selection */
enum hvdc_nan_rule {
    HVDC_NAN_DROPPED = 0, /* never selected, and its residual becomes 0 (Threshold, DGC) */
    HVDC_NAN_LARGEST = 1  /* the largest magnitude, so always selected (torch.topk's order: Top-K) */
};

/* how a magnitude is compared with the threshold of a selection */
enum hvdc_threshold_rule {
    HVDC_AT_LEAST = 0, /* |acc| >= thr */
    HVDC_ABOVE = 1     /* |acc| > thr */
};

/* what a candidate pass writes as a recorded candidate's residual (hvdc_compensate_select_sent) */
enum hvdc_sent_rule {
    HVDC_SENT_KEPT = 0, /* acc, as every other element's (the caller sets the sent ones' later) */
    HVDC_SENT_ZERO = 1, /* 0: acc is sent as it is (float32 values) */
    HVDC_SENT_BF16 = 2  /* acc - float(bfloat16(acc)), non-finite -> 0: acc is sent as bfloat16 */
};

/* Top-K's candidate room: the threshold aims at about 2k candidates, room is kept for
 * HVDC_TOPK_ROOM_PER_K * k + HVDC_TOPK_ROOM_SLACK; a threshold that left fewer than k
 * is lowered (divided by 4) up to HVDC_TOPK_LOWERINGS times. */
enum hvdc_topk_plan { HVDC_TOPK_ROOM_PER_K = 3, HVDC_TOPK_ROOM_SLACK = 1024, HVDC_TOPK_LOWERINGS = 3 };

/* the largest rank the PowerSGD passes run (a larger one: the caller's matmuls) */
enum hvdc_lowrank_limit { HVDC_LOWRANK_MAX_RANK = 16 };

/* ---- momentum-aware error feedback ---- */
/* u = m u + x (kept only where finite); d = u, or x + m u with nesterov, into d (may be x) */
void hvdc_momentum(const float *x, float *u, i64 n, float m, int nesterov, float *d);

/* ---- PowerSGD: M is n x m row-major, each Q r x m row-major (Q^T contiguous), P's element
 * (i, k) at p[i * p_row + k * p_col]; each returns 0, or -1 for a rank outside 1..HVDC_LOWRANK_MAX_RANK ---- */
/* acc = x + r into r (r may be NULL: acc = x); p = acc Q, n x r row-major, one pass over acc */
int hvdc_lowrank_first(const float *x, float *r, i64 n, i64 m, int rank, const float *qt, float *p);
/* qt = P^T mat (r x m), one pass over mat */
int hvdc_lowrank_project(const float *mat, i64 n, i64 m, int rank, const float *p, i64 p_row, i64 p_col,
                         float *qt);
/* out = P q_agg; with mat (may be NULL): mat = mat - P q_local, non-finite entries 0; one pass */
int hvdc_lowrank_finish(const float *p, i64 p_row, i64 p_col, i64 n, i64 m, int rank, const float *q_agg,
                        const float *q_local, float *mat, float *out);

/* ---- Int8: q = clip(rint(acc / scale), -127, 127), scale = max|acc| / 127 per block ---- */
void hvdc_int8_encode(const float *x, float *r, i64 n, i64 block, int8_t *q, float *scales);
/* the same with scale = max|acc| * (1 / 127), the bits of TF's traced graph */
void hvdc_int8_encode_rcp(const float *x, float *r, i64 n, i64 block, int8_t *q, float *scales);
/* out = sum_j q_j * scale_j [* s] */
void hvdc_int8_decode_sum(int nr, const int8_t *const *qs, const float *const *scales, i64 n, i64 block,
                          float s, int scaled, float *out);

/* ---- the sign family ---- */
/* bits = (acc >= 0); EFSignSGD's scale into *scale_out (1 for SignSGD; scale_out may be NULL) */
void hvdc_sign_encode(const float *x, float *r, i64 n, enum hvdc_sign_mode mode, uint8_t *bits,
                      float *scale_out);
/* SignSGD: out = sign(sum_j +-1); EFSignSGD: out = sum_j +-scales[j] [* s] */
void hvdc_sign_decode_sum(int nr, const uint8_t *const *bits, const float *scales, i64 n,
                          enum hvdc_sign_mode mode, float s, int scaled, float *out);
/* bits = (acc >= 0); means[0], means[1]: the mean of acc over the set and the clear bits */
void hvdc_onebit_encode(const float *x, float *r, i64 n, uint8_t *bits, float *means);
/* out = sum_j (p * means[2j] + (1 - p) * means[2j + 1]) [* s] */
void hvdc_onebit_decode_sum(int nr, const uint8_t *const *bits, const float *means, i64 n, float s, int scaled,
                            float *out);

/* ---- 16-bit floats ---- */
/* out = acc as dtype (its 16 bits); sent = that value cast back to float */
void hvdc_half_encode(const float *x, float *r, i64 n, enum hvdc_half_dtype dtype, uint16_t *out);
/* out = sum_j float(hs_j) [* s], the payloads bfloat16 */
void hvdc_bf16_decode_sum(int nr, const uint16_t *const *hs, i64 n, float s, int scaled, float *out);

/* ---- sparsification ---- */
/* acc into r, and the indices where |acc| passes thr (and their acc values) into cand and
 * cand_val, up to cap of them; returns how many pass (more than cap: only counted) */
i64 hvdc_compensate_select(const float *x, float *r, i64 n, float thr, enum hvdc_threshold_rule rule,
                           enum hvdc_nan_rule nan_rule, i64 *cand, float *cand_val, i64 cap);
/* as hvdc_compensate_select (x NULL: acc is r's content), and the residual of each recorded candidate whose
 * magnitude is at least thr_sent (>= thr) written as if it were sent by `sent`: the selection then settles only the
 * candidates on the wrong side of thr_sent (hvdc_topk_select_settle), a retry puts all back
 * (hvdc_restore_candidates) */
i64 hvdc_compensate_select_sent(const float *x, float *r, i64 n, float thr, enum hvdc_threshold_rule rule,
                                enum hvdc_nan_rule nan_rule, enum hvdc_sent_rule sent, float thr_sent, i64 *cand,
                                float *cand_val, i64 cap);
/* r[cand[j]] = cand_val[j] (non-finite -> 0 where finite) for j < c */
void hvdc_restore_candidates(float *r, const i64 *cand, const float *cand_val, i64 c, int finite);
/* |acc| at every stride-th element (ceil(n / stride) of them) into out */
void hvdc_sample_magnitudes(const float *x, const float *r, i64 n, i64 stride, enum hvdc_nan_rule nan_rule,
                            float *out);
/* the k-th largest of v[0..m) (1 <= k <= m); v is permuted */
float hvdc_kth_largest(float *v, i64 m, i64 k);
/* the k (<= c) candidates of largest magnitude, ties in index order, into out / out_val;
 * tmp holds c floats */
void hvdc_topk_fixup(const i64 *cand, const float *cand_val, i64 c, i64 k, enum hvdc_nan_rule nan_rule,
                     i64 *out, float *out_val, float *tmp);
/* as hvdc_topk_fixup, and the residuals hvdc_compensate_select_sent wrote settled in acc: a kept candidate below
 * thr_sent gets its residual as sent by `sent`, a dropped one at or above it its value (non-finite -> 0) */
void hvdc_topk_select_settle(const i64 *cand, const float *cand_val, i64 c, i64 k, enum hvdc_nan_rule nan_rule,
                             i64 *out, float *out_val, float *tmp, float *acc, enum hvdc_sent_rule sent,
                             float thr_sent);
/* as hvdc_topk_select_settle (acc NULL: as hvdc_topk_fixup), the k (1 <= k <= c) kept candidates packed as
 * they are kept: their indices as the index code `code` (hvdc_index_encode's, Elias-Fano with `low` low bits,
 * nbytes of it) into idx_out, their values as float32, or bfloat16 bits where bf16 (hvdc_sparse_bf16_encode's,
 * without a residual), into val_out */
void hvdc_topk_select_pack(const i64 *cand, const float *cand_val, i64 c, i64 k, enum hvdc_nan_rule nan_rule,
                           float *tmp, float *acc, enum hvdc_sent_rule sent, float thr_sent,
                           enum hvdc_index_code code, int low, uint8_t *idx_out, i64 nbytes, int bf16,
                           void *val_out);
/* the residual at the k sent indices becomes 0, and at the non-finite candidates */
void hvdc_clear_sent(float *acc, const i64 *idx, i64 k, const i64 *cand, const float *cand_val, i64 c);

/* ---- Threshold and DGC (values=None): every element past a threshold is sent ---- */
/* acc = x + r (x NULL: acc is r's content), the indices where |acc| passes thr (a NaN never:
 * its residual becomes 0) into idx (int32: the raw index code) and their acc into val, up to
 * cap of them, the residual 0 where stored; returns how many pass (more than cap: the ones past
 * cap are only counted and keep acc in r).  idx and val need room for cap + the vector width
 * (16) to be written at full speed; near cap they are written one by one. */
i64 hvdc_select_sent(const float *x, float *r, i64 n, float thr, enum hvdc_threshold_rule rule, int32_t *idx,
                     float *val, i64 cap);
/* out = 0, then each rank's values added at its int32 indices (ascending within a rank) in rank
 * order, [* s] where touched (hvdc_sparse_sum for raw payloads of any lengths, written block by
 * block in cache); returns 0, -1 where a rank's indices are not strictly ascending, -2 where one is
 * outside [0, n) */
i64 hvdc_sparse_sum_i32(int nr, const int32_t *const *idx, const float *const *vals, const i64 *ks, i64 n, float s,
                        int scaled, float *out);
/* r[idx[j]] = val[j] for j < c: undoes hvdc_select_sent's residual where it stored */
void hvdc_unsend(float *r, const int32_t *idx, const float *val, i64 c);

/* ---- sparsifiers' kept values as bfloat16 (TopK(values=BF16())) ---- */
/* bits = vals as bfloat16 (round half to even, every NaN 0x7FC0); with acc, acc[idx[j]] = vals[j] -
 * float(bits[j]) (non-finite -> 0), the residual where sent */
void hvdc_sparse_bf16_encode(const float *vals, i64 k, const i64 *idx, float *acc, uint16_t *bits);

/* ---- index codes ---- */
/* idx ascending and distinct into out (nbytes of it); low: Elias-Fano's low bit count */
void hvdc_index_encode(const i64 *idx, i64 k, i64 n, enum hvdc_index_code code, int low, uint8_t *out,
                       i64 nbytes);
/* the inverse: k ascending indices into out */
void hvdc_index_decode(const uint8_t *in, i64 k, i64 n, enum hvdc_index_code code, int low, i64 *out);
/* whether idx[0..k) is strictly ascending */
int hvdc_is_ascending(const i64 *idx, i64 k);
/* out = 0, then each rank's values added at its indices (ascending within a rank), in rank order, [* s]
 * where touched (more than one rank: block by block in cache, as hvdc_sparse_sum_i32) */
void hvdc_sparse_sum(int nr, const i64 *const *idx, const float *const *vals, const i64 *ks, i64 n, float s,
                     int scaled, float *out);

/* the index code and the values of nr sparse payloads decoded and summed into out in one pass, as
 * hvdc_index_decode then hvdc_sparse_sum give it (out = 0, each index's values added onto 0 in rank order,
 * [* s] where touched): every rank's code is `code` (Elias-Fano with `low` low bits) of ks[j] ascending indices
 * of [0, n), its values ks[j] float32, or bfloat16 bits where bf16; out is written once, block by block.
 * Returns 0; -1 where raw indices are not strictly ascending (out unspecified: the caller sorts them);
 * -2 where an index is outside [0, n) or a code holds fewer than ks[j]; -3 out of memory */
i64 hvdc_sparse_decode_sum(int nr, const uint8_t *const *codes, enum hvdc_index_code code, int low, const i64 *ks,
                           const void *const *vals, int bf16, i64 n, float s, int scaled, float *out);

/* ---- the randomised schemes: QSGD, TernGrad, Random-K, with the framework's own draws ---- */
/* whose seeded draws and NaN conventions a randomised kernel reproduces */
enum hvdc_framework {
    HVDC_FW_TORCH = 0, /* torch.rand on CPU: mt19937 seeded by the seed's low 32 bits, u = (w & 0xFFFFFF) * 2^-24;
                        * sign(NaN) = 0 */
    HVDC_FW_TF = 1     /* tf.random.stateless_uniform of the seed pair (seed / 2^31, seed % 2^31): Philox4x32-10,
                        * u = float(0x3F800000 | (w & 0x7FFFFF)) - 1; sign(NaN) = NaN, NaN cast to int8 = -128 */
};
/* the first n draws U[0, 1) of the framework's generator seeded by seed (>= 0) into u */
void hvdc_uniform(enum hvdc_framework fw, i64 seed, i64 n, float *u);
/* QSGD: *norm = ||acc||_2; with s = norm (1 where it is 0), q = clip(floor(|acc| / s * levels + u), 0, levels)
 * * sign(acc) as int8, residual acc - q * (s / levels).  u: n draws, or NULL: the framework's draws of seed */
void hvdc_qsgd_encode(const float *x, float *r, i64 n, int levels, const float *u, enum hvdc_framework fw,
                      i64 seed, int8_t *q, float *norm);
/* TernGrad: *scale = max|acc|; with s = scale (1 unless it is > 0), t = (u < |acc| / s) * sign(acc), the codes
 * t + 1 two bits each (four to a byte), residual acc - t * scale.  u as for QSGD */
void hvdc_terngrad_encode(const float *x, float *r, i64 n, const float *u, enum hvdc_framework fw, i64 seed,
                          uint8_t *codes, float *scale);
/* out = sum_j (code_j - 1) * scales[j] [* s] */
void hvdc_terngrad_decode_sum(int nr, const uint8_t *const *codes, const float *scales, i64 n, float s, int scaled,
                              float *out);
/* Random-K's shared indices as torch's backend draws them (randperm_prefix: 2k + 64 draws of randint(0, n), their
 * distinct values, a random k of those by randperm, ascending) into idx; seen holds ceil(n / 64) words, scratch
 * 2 (2k + 64) i64.  Returns k, or -1 where torch draws a whole permutation instead (8 k >= n, or fewer than k
 * distinct draws): the caller's path */
i64 hvdc_randomk_indices_torch(i64 seed, i64 n, i64 k, i64 *idx, uint64_t *seen, i64 *scratch);
/* Random-K's shared indices as TF's backend draws them (sort(top_k(stateless_uniform(n), k).indices): the k
 * largest draws, ties to the lower index), ascending, into the first k of idx; idx and keys hold room = k + n / 64
 * + 4096 entries each (the draws at or above a floor, with their 23-bit keys, before they are ranked) */
void hvdc_randomk_indices_tf(i64 seed, i64 n, i64 k, i64 *idx, uint32_t *keys);
/* acc into r (with r); vals = acc at the k ascending idx; the residual 0 there and wherever acc is not finite */
void hvdc_randomk_encode(const float *x, float *r, i64 n, const i64 *idx, i64 k, float *vals);
/* out = 0, then out[idx[j]] = 0 + vals[j] (as index_add_ into zeros) */
void hvdc_scatter(const i64 *idx, i64 k, const float *vals, i64 n, float *out);

/* ---- Lossless: the byte shuffle around zstd ---- */
/* each block of `block` elements (the last one m < block) as four planes: byte k of x[lo + i] at
 * planes[4 lo + k m + i] (block <= 0: one block of n) */
void hvdc_byte_shuffle(const float *x, i64 n, i64 block, uint8_t *planes);
/* out[i] = v, or out[i] + v unless first, [* s]; v the float of bytes planes[k n + i] */
void hvdc_byte_unshuffle_add(const uint8_t *planes, i64 n, int first, float s, int scaled, float *out);
/* Lossless's payload: one zstd frame per block of `block` elements (its four planes, as
 * hvdc_byte_shuffle lays them out), each shuffled into `scratch` (4 block bytes: it stays in
 * the L2 cache) and compressed from there at `level` straight into out[0, cap).  `zstd` is
 * zstd's functions ZSTD_compressCCtx, ZSTD_decompressDCtx, ZSTD_findFrameCompressedSize and
 * ZSTD_isError in this order (zstd's stable API; the caller loads the library); cctx is a
 * ZSTD_CCtx of it.  Returns the payload's length, or -1 where zstd fails (cap too small) */
i64 hvdc_lossless_encode(const float *x, i64 n, i64 block, int level, void *const *zstd, void *cctx, uint8_t *scratch,
                         uint8_t *out, i64 cap);
/* the decode of such a payload: each frame decompressed into `scratch` and un-shuffled from
 * there into out as hvdc_byte_unshuffle_add does (first, s, scaled as there); dctx a ZSTD_DCtx.
 * Returns 0, or where the payload is malformed: -1 a frame is cut short or corrupt, -2 a
 * frame does not hold its block's 4 m bytes, -3 bytes follow the last block's frame */
i64 hvdc_lossless_decode_add(const uint8_t *blob, i64 size, i64 n, i64 block, void *const *zstd, void *dctx,
                             uint8_t *scratch, int first, float s, int scaled, float *out);

#ifdef __cplusplus
}
#endif

#endif /* HVDC_KERNELS_H */
