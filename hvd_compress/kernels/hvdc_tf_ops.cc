// TensorFlow custom ops over hvdc_kernels.c (the same C kernels the torch
// codecs call through ctypes), for hvd_compress.codecs.tf_fused.
//
// Every op is one row of the table kOps at the end of this file: its inputs,
// outputs and attributes as REGISTER_OP takes them, each output's length as a
// function of the attributes, and the body that calls the C kernels.  One
// generic kernel, TableKernel, does what every op shares: it reads the declared
// attributes once, checks the input x, draws the seed, allocates the outputs the
// lengths give (the same lengths the shape function reports), and runs an encode
// body under the residual variable's lock.  Adding a fused scheme adds a body and
// a row (docs/design/adding_a_scheme.md).
//
// The encode ops take the error-feedback residual as a resource (the
// tf.Variable the TF adapter keeps) and update it in place under the
// variable's lock: acc = x + r is formed in r and r ends as acc - sent, so
// there is no fresh residual tensor per step.  Copy-on-write is respected:
// where another tensor still aliases the variable's buffer (a read not yet
// released, copy-on-read mode), the buffer is copied first, as TF's own
// update ops do.  Without error feedback the resource list is empty.
//
// The ops are stateful (they must not be pruned, folded or deduplicated);
// inside a tf.function, automatic control dependencies order them with the
// other accesses of the same variable.  Built by hvd_compress/kernels/tf_native.py.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"

#include "hvdc_kernels.h"  // the C kernels' prototypes and enums

namespace {

using namespace tensorflow;
using shape_inference::InferenceContext;

// ---- attributes: every name an op of the table may declare, and the type it is read as ----
#define HVDC_ATTRS(X)                                                                                          \
  X(int64_t, M) X(int64_t, N) X(int64_t, U) X(int64_t, n) X(int64_t, k) X(int64_t, block) X(int64_t, nb)       \
  X(int64_t, stride) X(int64_t, want) X(int64_t, sent_rank) X(int64_t, low) X(int64_t, nbytes)                \
  X(int64_t, levels) X(hvdc_index_code, code) X(hvdc_sign_mode, mode) X(bool, scaled) X(bool, nesterov)       \
  X(float, m) X(DataType, T) X(DataType, V)

struct Attrs {
#define HVDC_ATTR_FIELD(type, name) type name{};
  HVDC_ATTRS(HVDC_ATTR_FIELD)
#undef HVDC_ATTR_FIELD
};

// The name a declaration gives ("block: int >= 1": block).
std::string DeclName(const char *decl) { return std::string(decl, std::strcspn(decl, ":")); }

template <class Ctx, class T>
absl::Status GetAttrAs(const Ctx *c, const char *name, T *out) {
  if constexpr (std::is_enum<T>::value && !std::is_same<T, DataType>::value) {  // hvdc_kernels.h's: an int
    int v;
    TF_RETURN_IF_ERROR(c->GetAttr(name, &v));
    *out = static_cast<T>(v);
    return absl::OkStatus();
  } else {
    return c->GetAttr(name, out);
  }
}

// The attributes `decls` declares ("name: type ..."), from a kernel's construction or a shape function.
template <class Ctx>
absl::Status ReadAttrs(const Ctx *c, const std::vector<const char *> &decls, Attrs *a) {
  for (const char *decl : decls) {
    const std::string name = DeclName(decl);
#define HVDC_READ_ATTR(type, field) \
  if (name == #field) TF_RETURN_IF_ERROR(GetAttrAs(c, #field, &a->field));
    HVDC_ATTRS(HVDC_READ_ATTR)
#undef HVDC_READ_ATTR
  }
  return absl::OkStatus();
}

// The enum attribute `name` as one of the values first..last, or an error naming them.
template <typename Enum>
absl::Status CheckEnum(const char *name, Enum v, Enum first, Enum last) {
  if (v < first || v > last)
    return errors::InvalidArgument("attribute ", name, " must be in [", static_cast<int>(first), ", ",
                                   static_cast<int>(last), "] (hvdc_kernels.h); got ", static_cast<int>(v));
  return absl::OkStatus();
}

absl::Status CheckEnums(const Attrs &a) {
  TF_RETURN_IF_ERROR(CheckEnum("code", a.code, HVDC_CODE_RAW, HVDC_CODE_ELIAS_FANO));
  return CheckEnum("mode", a.mode, HVDC_SIGN_SIGNSGD, HVDC_SIGN_ONEBIT);
}

bool Bf16(DataType t) { return t == DT_INT16; }  // a 16-bit type attribute: int16 holds bfloat16 bits

// ---- output lengths: each follows from the attributes (the shape function's and the kernel's) ----
i64 LenN(const Attrs &a) { return a.n; }
i64 LenK(const Attrs &a) { return a.k; }
i64 LenNb(const Attrs &a) { return a.nb; }
i64 LenOne(const Attrs &) { return 1; }
i64 LenSignBits(const Attrs &a) { return (a.n + 7) / 8; }
i64 LenTernBits(const Attrs &a) { return (a.n + 3) / 4; }
i64 LenSignScale(const Attrs &a) { return a.mode == HVDC_SIGN_ONEBIT ? 2 : 1; }  // one float, OneBit's two means
i64 LenTopKIdx(const Attrs &a) { return a.code == HVDC_CODE_RAW ? a.k : a.nbytes; }  // raw: k int32

// ---- shared pieces ---------------------------------------------------------------------------
absl::Status CheckVector(const Tensor &t, i64 n, const char *what) {
  if (t.dims() != 1 || t.dim_size(0) != n)
    return errors::InvalidArgument(what, " must be a vector of ", n, " elements; got shape ",
                                   t.shape().DebugString());
  return absl::OkStatus();
}

// The data of input list `name`'s tensors, each checked to be a vector of `len` elements.
template <typename T>
absl::Status Vectors(OpKernelContext *ctx, const char *name, i64 len, const char *what, std::vector<const T *> *out) {
  OpInputList list;
  TF_RETURN_IF_ERROR(ctx->input_list(name, &list));
  for (int j = 0; j < list.size(); j++) {
    TF_RETURN_IF_ERROR(CheckVector(list[j], len, what));
    out->push_back(reinterpret_cast<const T *>(list[j].tensor_data().data()));
  }
  return absl::OkStatus();
}

// An op's dense float output, kept across calls.  A fresh allocation of a large output
// faults in every page on each call: glibc serves allocations above 32 MB with a new mmap
// (at 16M elements most of a Top-K decode's time: docs/design/kernels.md).  The kept
// buffer is reused only while nothing else holds the last call's output (its reference
// count is one, as TF's own forwarding of inputs checks); otherwise a new one is allocated
// and kept, so a caller that keeps a result never sees it overwritten.  Every kernel that
// writes through it writes all n elements.
class KeptOutput {
 public:
  absl::Status Allocate(OpKernelContext *ctx, int index, i64 n, Tensor **out) {
    mutex_lock l(mu_);
    if (!kept_.IsInitialized() || kept_.NumElements() != n || !kept_.RefCountIsOne())
      TF_RETURN_IF_ERROR(ctx->allocate_temp(DT_FLOAT, TensorShape({n}), &kept_));
    ctx->set_output(index, kept_);
    *out = ctx->mutable_output(index);
    return absl::OkStatus();
  }

 private:
  mutex mu_;
  Tensor kept_;
};

// The residual variable of input `index`, locked by the caller, its buffer
// owned by the variable alone (copied first where something else aliases it).
absl::Status ResidualForUpdate(OpKernelContext *ctx, Var *var, i64 n, float **out,
                               const char *what = "residual") {
  Tensor *t = var->tensor();
  if (!t->IsInitialized() || t->dtype() != DT_FLOAT || t->NumElements() != n)
    return errors::InvalidArgument("the ", what, " variable must be float32 of ", n, " elements");
  if (var->copy_on_read_mode.load() || !t->RefCountIsOne()) {
    Tensor copy;
    TF_RETURN_IF_ERROR(ctx->allocate_temp(DT_FLOAT, t->shape(), &copy));
    std::memcpy(copy.flat<float>().data(), t->flat<float>().data(), n * sizeof(float));
    *t = copy;
  }
  *out = t->flat<float>().data();
  return absl::OkStatus();
}

// Runs fn(r) with r the in-place residual (nullptr without error feedback),
// holding the variable's lock for the whole update.
template <typename Fn>
void WithResidual(OpKernelContext *ctx, int m, i64 n, Fn fn) {
  if (m == 0) {
    fn(static_cast<float *>(nullptr));
    return;
  }
  core::RefCountPtr<Var> var;
  OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 1), &var));
  mutex_lock ml(*var->mu());
  float *r = nullptr;
  OP_REQUIRES_OK(ctx, ResidualForUpdate(ctx, var.get(), n, &r));
  fn(r);
}

template <typename T>
T *Alloc(OpKernelContext *ctx, Tensor *holder, DataType dt, i64 len) {
  auto st = ctx->allocate_temp(dt, TensorShape({std::max<i64>(len, 1)}), holder);
  if (!st.ok()) {
    ctx->CtxFailure(st);
    return nullptr;
  }
  return reinterpret_cast<T *>(const_cast<char *>(holder->tensor_data().data()));
}

// The randomised schemes' draws: the seed input (a scalar int64) and, where the op has U = 1,
// a caller's own n uniform draws; without them the kernels draw TF's stateless Philox stream.
struct Draws {
  const float *u = nullptr;
  i64 seed = 0;
};

absl::Status GetDraws(OpKernelContext *ctx, int with_u, i64 n, Draws *d) {
  const Tensor *seed;
  TF_RETURN_IF_ERROR(ctx->input("seed", &seed));
  if (seed->NumElements() != 1) return errors::InvalidArgument("seed must be one int64");
  d->seed = seed->flat<int64_t>()(0);
  if (d->seed < 0) return errors::InvalidArgument("seed must be >= 0; got ", d->seed);
  if (with_u) {
    OpInputList u;
    TF_RETURN_IF_ERROR(ctx->input_list("u", &u));
    TF_RETURN_IF_ERROR(CheckVector(u[0], n, "u"));
    d->u = u[0].flat<float>().data();
  }
  return absl::OkStatus();
}

// ---- what a body works on ------------------------------------------------------------------
constexpr int kMaxOutputs = 2;

// Buffers a kernel keeps across calls, for the bodies that need room of their own (under mu).
struct Scratch {
  mutex mu;
  Tensor idx, val;  // Threshold and DGC: the kept indices and values, before their outputs
  i64 room = 0;     // how many of them idx and val hold
  std::vector<i64> cand;  // Random-K: the candidate indices
  std::vector<uint32_t> keys;
};

// One call of an op: its context and attributes, and what the table's declarations prepared.
struct Call {
  OpKernelContext *ctx;
  const Attrs &a;
  Scratch &scratch;
  const float *x = nullptr;  // input x, checked to be a vector of n floats
  float *r = nullptr;        // the residual, in place under its variable's lock (nullptr without error feedback)
  Draws draws;               // input seed (and u)
  float s = 0;               // input s: the factor a decode scales the sum by (with scaled = true)
  Tensor *out[kMaxOutputs] = {};  // the outputs whose length the table gives, allocated

  template <typename T>
  T *Out(int i) const { return reinterpret_cast<T *>(const_cast<char *>(out[i]->tensor_data().data())); }
};

// ---- the bodies: each calls the C kernels on what its row declares ---------------------------
// ---- Int8 ------------------------------------------------------------------------------------
void Int8Encode(const Call &c) {
  hvdc_int8_encode_rcp(c.x, c.r, c.a.n, c.a.block, c.Out<int8_t>(0), c.Out<float>(1));
}

void Int8DecodeSum(const Call &c) {
  const i64 n = c.a.n, nb = n ? (n + c.a.block - 1) / c.a.block : 1;
  std::vector<const int8_t *> qs;
  std::vector<const float *> scales;
  OP_REQUIRES_OK(c.ctx, Vectors(c.ctx, "qs", n, "q", &qs));
  OP_REQUIRES_OK(c.ctx, Vectors(c.ctx, "scales", nb, "scale", &scales));
  hvdc_int8_decode_sum(qs.size(), qs.data(), scales.data(), n, c.a.block, c.s, c.a.scaled, c.Out<float>(0));
}

// ---- Top-K -----------------------------------------------------------------------------------
// Sampled threshold; one pass forming acc = x + r and collecting the candidates, with error
// feedback writing each candidate's residual as if sent (0, or its bfloat16 rounding error) from the
// sample's estimate of the k-th largest on; the exact k among them packed as the payload as they are
// kept, and the residuals on the wrong side of the estimate settled (hvdc_topk_select_pack): torch's
// TopKCodec in one op
void TopKEncode(const Call &c) {
  const Attrs &a = c.a;
  const float *x = c.x;
  float *r = c.r;
  Tensor sample_t, cand_t, cval_t, tmp_t;
  const i64 m = (a.n + a.stride - 1) / a.stride;
  float *sample = Alloc<float>(c.ctx, &sample_t, DT_FLOAT, m);
  if (!sample) return;
  hvdc_sample_magnitudes(x, r, a.n, a.stride, HVDC_NAN_LARGEST, sample);
  const i64 want = std::min(a.want, m);
  float thr = hvdc_kth_largest(sample, m, want);
  const hvdc_sent_rule sent = !r ? HVDC_SENT_KEPT : Bf16(a.V) ? HVDC_SENT_BF16 : HVDC_SENT_ZERO;
  // among the `want` largest the partial sort left in front
  const float thr_sent = sent != HVDC_SENT_KEPT ? hvdc_kth_largest(sample, want, std::min(a.sent_rank, want)) : thr;
  i64 cap = HVDC_TOPK_ROOM_PER_K * a.k + HVDC_TOPK_ROOM_SLACK;
  i64 *cand = Alloc<i64>(c.ctx, &cand_t, DT_INT64, cap);
  float *cval = Alloc<float>(c.ctx, &cval_t, DT_FLOAT, cap);
  if (!cand || !cval) return;
  i64 got = hvdc_compensate_select_sent(x, r, a.n, thr, HVDC_AT_LEAST, HVDC_NAN_LARGEST, sent, thr_sent, cand, cval,
                                        cap);
  // collected again from acc, as it is in r (or x without error feedback)
  auto collect_again = [&]() {
    return hvdc_compensate_select_sent(r ? nullptr : x, r, a.n, thr, HVDC_AT_LEAST, HVDC_NAN_LARGEST, sent, thr_sent,
                                       cand, cval, cap);
  };
  for (int lowered = 0;; lowered++) {
    if (got > cap) {  // more candidates than room: residuals put back, collected again with room
      if (r) hvdc_restore_candidates(r, cand, cval, cap, 0);
      cap = got;
      cand = Alloc<i64>(c.ctx, &cand_t, DT_INT64, cap);
      cval = Alloc<float>(c.ctx, &cval_t, DT_FLOAT, cap);
      if (!cand || !cval) return;
      got = collect_again();
    }
    if (got >= a.k) break;
    // the sample overshot (fewer than k candidates): a lower threshold, one more
    // read of acc (as the torch codec); after that many tries every element is a candidate
    if (r) hvdc_restore_candidates(r, cand, cval, got, 0);
    thr = lowered < HVDC_TOPK_LOWERINGS ? thr / 4.0f : -INFINITY;
    got = collect_again();
  }
  float *tmp = Alloc<float>(c.ctx, &tmp_t, DT_FLOAT, got);
  if (!tmp) return;
  hvdc_topk_select_pack(cand, cval, got, a.k, HVDC_NAN_LARGEST, tmp, r, sent, thr_sent, a.code, a.low,
                        c.Out<uint8_t>(0), a.nbytes, Bf16(a.V) ? 1 : 0, c.Out<void>(1));
}

// idx[0..k) ascending, val[] moved with it
void SortPairs(i64 *idx, float *val, i64 k) {
  std::vector<i64> order(k);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](i64 a, i64 b) { return idx[a] < idx[b]; });
  std::vector<i64> i2(k);
  std::vector<float> v2(k);
  for (i64 t = 0; t < k; t++) i2[t] = idx[order[t]], v2[t] = val[order[t]];
  std::copy(i2.begin(), i2.end(), idx);
  std::copy(v2.begin(), v2.end(), val);
}

// The ranks' payloads with their indices decoded and sorted first: raw indices from an eager
// (top_k order) encoder, which the one-pass decode does not take.
void SparseSumSorted(const Call &c, const std::vector<const uint8_t *> &codes, const std::vector<const void *> &vals) {
  const Attrs &a = c.a;
  const int nr = codes.size();
  Tensor idx_t, val_t;
  i64 *idx = Alloc<i64>(c.ctx, &idx_t, DT_INT64, nr * a.k);
  float *val = Alloc<float>(c.ctx, &val_t, DT_FLOAT, nr * a.k);
  if (!idx || !val) return;
  std::vector<const i64 *> ip;
  std::vector<const float *> vp;
  for (int j = 0; j < nr; j++) {
    i64 *ij = idx + j * a.k;
    float *vj = val + j * a.k;
    hvdc_index_decode(codes[j], a.k, a.n, a.code, a.low, ij);
    if (Bf16(a.V)) {  // bfloat16 bits to float: the one-rank bf16 decode
      const uint16_t *bits = static_cast<const uint16_t *>(vals[j]);
      hvdc_bf16_decode_sum(1, &bits, a.k, 0.0f, 0, vj);
    } else {
      std::memcpy(vj, vals[j], a.k * sizeof(float));
    }
    if (!hvdc_is_ascending(ij, a.k)) SortPairs(ij, vj, a.k);
    for (i64 t = 0; t < a.k; t++)
      OP_REQUIRES(c.ctx, ij[t] >= 0 && ij[t] < a.n,
                  errors::InvalidArgument("index ", ij[t], " out of [0, ", a.n, ")"));
    ip.push_back(ij);
    vp.push_back(vj);
  }
  std::vector<i64> ks(nr, a.k);
  hvdc_sparse_sum(nr, ip.data(), vp.data(), ks.data(), a.n, c.s, c.a.scaled, c.Out<float>(0));
}

void SparseSum(const Call &c) {
  const Attrs &a = c.a;
  OpInputList idxs;
  OP_REQUIRES_OK(c.ctx, c.ctx->input_list("idxs", &idxs));
  std::vector<const void *> vals;
  OP_REQUIRES_OK(c.ctx, Vectors(c.ctx, "vals", a.k, "val", &vals));
  std::vector<const uint8_t *> codes;
  for (int j = 0; j < idxs.size(); j++) {
    OP_REQUIRES(c.ctx, (i64)idxs[j].tensor_data().size() == a.nbytes,
                errors::InvalidArgument("idx of rank ", j, " must hold ", a.nbytes, " bytes; got ",
                                        idxs[j].tensor_data().size()));
    codes.push_back(reinterpret_cast<const uint8_t *>(idxs[j].tensor_data().data()));
  }
  std::vector<i64> ks(codes.size(), a.k);
  // one pass: each rank's code and values decoded and added block by block into out
  const i64 status = hvdc_sparse_decode_sum(codes.size(), codes.data(), a.code, a.low, ks.data(), vals.data(),
                                            Bf16(a.V) ? 1 : 0, a.n, c.s, a.scaled, c.Out<float>(0));
  OP_REQUIRES(c.ctx, status == 0 || status == -1,
              errors::InvalidArgument("a Top-K payload holds an index outside [0, ", a.n,
                                      ") or fewer indices than its code declares"));
  if (status == -1) SparseSumSorted(c, codes, vals);
}

// ---- Threshold and DGC ---------------------------------------------------------------------
// One pass: acc formed, the kept indices (int32, the raw code) and values packed into buffers
// kept across calls (the room a past call needed), the residual 0 where sent; then copied into
// outputs of the kept length.
constexpr i64 kSelectSlack = 16;  // hvdc_select_sent writes up to a vector past its count

bool SelectRoom(const Call &c, i64 room) {
  Scratch &buf = c.scratch;
  if (buf.room >= room) return true;
  buf.room = room;
  auto st = c.ctx->allocate_temp(DT_INT32, TensorShape({room + kSelectSlack}), &buf.idx);
  if (st.ok()) st = c.ctx->allocate_temp(DT_FLOAT, TensorShape({room + kSelectSlack}), &buf.val);
  if (!st.ok()) {
    c.ctx->CtxFailure(st);
    buf.room = 0;
    return false;
  }
  return true;
}

void SelectSent(const Call &c) {
  const Tensor *thr_t;
  OP_REQUIRES_OK(c.ctx, c.ctx->input("thr", &thr_t));
  const float thr = thr_t->scalar<float>()();
  const i64 n = c.a.n;
  Scratch &buf = c.scratch;
  mutex_lock l(buf.mu);
  if (!SelectRoom(c, std::max<i64>(1024, n / 64))) return;
  i64 room = buf.room;
  i64 got = hvdc_select_sent(c.x, c.r, n, thr, HVDC_AT_LEAST, buf.idx.flat<int32_t>().data(),
                             buf.val.flat<float>().data(), room);
  if (got > room) {  // out of room: undo the stored part, select again from acc with room
    if (c.r) hvdc_unsend(c.r, buf.idx.flat<int32_t>().data(), buf.val.flat<float>().data(), room);
    if (!SelectRoom(c, std::min<i64>(n, got + got / 2 + 1024))) return;  // headroom, as the torch codec
    got = hvdc_select_sent(c.r ? nullptr : c.x, c.r, n, thr, HVDC_AT_LEAST, buf.idx.flat<int32_t>().data(),
                           buf.val.flat<float>().data(), buf.room);
  }
  Tensor *idx_out = nullptr, *val_out = nullptr;
  OP_REQUIRES_OK(c.ctx, c.ctx->allocate_output(0, TensorShape({got}), &idx_out));
  OP_REQUIRES_OK(c.ctx, c.ctx->allocate_output(1, TensorShape({got}), &val_out));
  std::memcpy(idx_out->flat<int32_t>().data(), buf.idx.flat<int32_t>().data(), got * sizeof(int32_t));
  std::memcpy(val_out->flat<float>().data(), buf.val.flat<float>().data(), got * sizeof(float));
}

// The sum of the ranks' raw-coded sparse payloads of any lengths (Threshold, DGC).
void SparseSumRaw(const Call &c) {
  const i64 n = c.a.n;
  OpInputList idxs, vals;
  OP_REQUIRES_OK(c.ctx, c.ctx->input_list("idxs", &idxs));
  OP_REQUIRES_OK(c.ctx, c.ctx->input_list("vals", &vals));
  const int nr = idxs.size();
  std::vector<i64> ks(nr);
  std::vector<const int32_t *> ip(nr);
  std::vector<const float *> vp(nr);
  for (int j = 0; j < nr; j++) {
    ks[j] = idxs[j].NumElements();
    OP_REQUIRES(c.ctx, idxs[j].dims() == 1 && vals[j].dims() == 1 && vals[j].NumElements() == ks[j],
                errors::InvalidArgument("idx and val of rank ", j, " must be vectors of one length; got ",
                                        idxs[j].shape().DebugString(), " and ", vals[j].shape().DebugString()));
    ip[j] = idxs[j].flat<int32_t>().data();
    vp[j] = vals[j].flat<float>().data();
  }
  float *out = c.Out<float>(0);
  i64 status = hvdc_sparse_sum_i32(nr, ip.data(), vp.data(), ks.data(), n, c.s, c.a.scaled, out);
  if (status == -1) {  // indices not ascending (not a selection's order): sorted copies, then summed
    std::vector<std::vector<int32_t>> si(nr);
    std::vector<std::vector<float>> sv(nr);
    for (int j = 0; j < nr; j++) {
      std::vector<i64> order(ks[j]);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](i64 a, i64 b) { return ip[j][a] < ip[j][b]; });
      si[j].resize(ks[j]);
      sv[j].resize(ks[j]);
      for (i64 t = 0; t < ks[j]; t++) si[j][t] = ip[j][order[t]], sv[j][t] = vp[j][order[t]];
      ip[j] = si[j].data();
      vp[j] = sv[j].data();
    }
    status = hvdc_sparse_sum_i32(nr, ip.data(), vp.data(), ks.data(), n, c.s, c.a.scaled, out);
  }
  OP_REQUIRES(c.ctx, status == 0,
              errors::InvalidArgument("a sparse payload holds an index outside [0, ", n, ") or a repeated index"));
}

// ---- the sign family and 16-bit floats -------------------------------------------------------
void SignEncode(const Call &c) {
  if (c.a.mode == HVDC_SIGN_ONEBIT)
    hvdc_onebit_encode(c.x, c.r, c.a.n, c.Out<uint8_t>(0), c.Out<float>(1));
  else
    hvdc_sign_encode(c.x, c.r, c.a.n, c.a.mode, c.Out<uint8_t>(0), c.Out<float>(1));
}

void SignDecodeSum(const Call &c) {
  const Attrs &a = c.a;
  std::vector<const uint8_t *> bits;
  OP_REQUIRES_OK(c.ctx, Vectors(c.ctx, "bits", LenSignBits(a), "bits", &bits));
  OpInputList scales;
  OP_REQUIRES_OK(c.ctx, c.ctx->input_list("scales", &scales));
  const int want = LenSignScale(a);
  std::vector<float> sv;
  for (int j = 0; j < scales.size(); j++) {
    OP_REQUIRES(c.ctx, scales[j].NumElements() >= want,
                errors::InvalidArgument("scale of rank ", j, " has ", scales[j].NumElements(), " values, not ", want));
    for (int v = 0; v < want; v++) sv.push_back(scales[j].flat<float>()(v));
  }
  if (a.mode == HVDC_SIGN_ONEBIT)
    hvdc_onebit_decode_sum(bits.size(), bits.data(), sv.data(), a.n, c.s, a.scaled, c.Out<float>(0));
  else
    hvdc_sign_decode_sum(bits.size(), bits.data(), sv.data(), a.n, a.mode, c.s, a.scaled, c.Out<float>(0));
}

void HalfEncode(const Call &c) {
  hvdc_half_encode(c.x, c.r, c.a.n, Bf16(c.a.T) ? HVDC_HALF_BF16 : HVDC_HALF_FP16, c.Out<uint16_t>(0));
}

void Bf16DecodeSum(const Call &c) {
  std::vector<const uint16_t *> hs;
  OP_REQUIRES_OK(c.ctx, Vectors(c.ctx, "hs", c.a.n, "bits", &hs));
  hvdc_bf16_decode_sum(hs.size(), hs.data(), c.a.n, c.s, c.a.scaled, c.Out<float>(0));
}

// Momentum-aware error feedback's first pass: u = m u + x in the velocity
// variable (kept finite), d = u or x + m u (Nesterov) out; a codec then
// compresses d + residual.
void Momentum(const Call &c) {
  core::RefCountPtr<Var> var;
  OP_REQUIRES_OK(c.ctx, LookupResource(c.ctx, HandleFromInput(c.ctx, 1), &var));
  mutex_lock ml(*var->mu());
  float *u = nullptr;
  OP_REQUIRES_OK(c.ctx, ResidualForUpdate(c.ctx, var.get(), c.a.n, &u, "velocity"));
  hvdc_momentum(c.x, u, c.a.n, c.a.m, c.a.nesterov ? 1 : 0, c.Out<float>(0));
}

// ---- the randomised schemes: the kernels draw TF's stateless Philox stream for the seed ----
void QsgdEncode(const Call &c) {
  hvdc_qsgd_encode(c.x, c.r, c.a.n, c.a.levels, c.draws.u, HVDC_FW_TF, c.draws.seed, c.Out<int8_t>(0),
                   c.Out<float>(1));
}

void TernGradEncode(const Call &c) {
  hvdc_terngrad_encode(c.x, c.r, c.a.n, c.draws.u, HVDC_FW_TF, c.draws.seed, c.Out<uint8_t>(0), c.Out<float>(1));
}

void TernGradDecodeSum(const Call &c) {
  std::vector<const uint8_t *> ts;
  OP_REQUIRES_OK(c.ctx, Vectors(c.ctx, "ts", LenTernBits(c.a), "t", &ts));
  OpInputList scales;
  OP_REQUIRES_OK(c.ctx, c.ctx->input_list("scales", &scales));
  std::vector<float> sv;
  for (int j = 0; j < scales.size(); j++) {
    OP_REQUIRES(c.ctx, scales[j].NumElements() >= 1, errors::InvalidArgument("scale of rank ", j, " is empty"));
    sv.push_back(scales[j].flat<float>()(0));
  }
  hvdc_terngrad_decode_sum(ts.size(), ts.data(), sv.data(), c.a.n, c.s, c.a.scaled, c.Out<float>(0));
}

// Random-K: TF's shared indices (the k largest stateless draws) drawn in C into kept
// candidate buffers, then acc formed in place, the values gathered and their
// residual cleared.
void RandomKEncode(const Call &c) {
  const Attrs &a = c.a;
  Scratch &buf = c.scratch;
  mutex_lock l(buf.mu);
  buf.cand.resize(a.k + a.n / 64 + 4096);  // the room hvdc_randomk_indices_tf collects in
  buf.keys.resize(buf.cand.size());
  hvdc_randomk_indices_tf(c.draws.seed, a.n, a.k, buf.cand.data(), buf.keys.data());
  std::memcpy(c.Out<int64_t>(1), buf.cand.data(), a.k * sizeof(i64));
  hvdc_randomk_encode(c.x, c.r, a.n, buf.cand.data(), a.k, c.Out<float>(0));
}

absl::Status KAtMostN(const Attrs &a) {
  if (a.k > std::max<int64_t>(a.n, 1)) return errors::InvalidArgument("k must be at most n");
  return absl::OkStatus();
}

void Scatter(const Call &c) {
  const Tensor &idx = c.ctx->input(0), &vals = c.ctx->input(1);
  OP_REQUIRES(c.ctx, idx.NumElements() == vals.NumElements(),
              errors::InvalidArgument("idx and vals differ in length: ", idx.NumElements(), " and ",
                                      vals.NumElements()));
  const int64_t *ip = idx.flat<int64_t>().data();
  for (int64_t j = 0; j < idx.NumElements(); j++)
    OP_REQUIRES(c.ctx, ip[j] >= 0 && ip[j] < c.a.n,
                errors::InvalidArgument("index ", ip[j], " outside [0, ", c.a.n, ")"));
  hvdc_scatter(ip, idx.NumElements(), vals.flat<float>().data(), c.a.n, c.Out<float>(0));
}

// ---- the table: one row per op ---------------------------------------------------------------
struct Output {
  const char *decl;            // as REGISTER_OP's Output takes it
  i64 (*len)(const Attrs &);   // its length; nullptr: known once the op has run (its body allocates it)
  bool kept = false;           // a dense float output whose buffer is kept across calls (KeptOutput)
};

const Output kSum = {"out: float", LenN, true};  // a decode's sum of the ranks' payloads
constexpr bool kStateful = true, kStateless = false;

// Inputs the kernel prepares by name before the body runs: x (checked to be n floats), r (the
// residual variables: the body runs under their lock, with r in place), seed and u (Draws), s.
struct OpSpec {
  const char *name;
  void (*body)(const Call &);
  bool stateful;
  std::vector<const char *> inputs;  // as REGISTER_OP's Input takes them, in order
  std::vector<Output> outputs;
  std::vector<const char *> attrs;   // as REGISTER_OP's Attr takes them, in order
  absl::Status (*check)(const Attrs &) = nullptr;  // beyond each attribute's own constraint
};

const OpSpec kOps[] = {
    {"HvdcInt8Encode", Int8Encode, kStateful,
     {"x: float", "r: M * resource"},
     {{"q: int8", LenN}, {"scale: float", LenNb}},
     {"M: int >= 0", "n: int >= 0", "block: int >= 1", "nb: int >= 1"}},
    {"HvdcInt8DecodeSum", Int8DecodeSum, kStateless,
     {"qs: N * int8", "scales: N * float", "s: float"},
     {kSum},
     {"N: int >= 1", "n: int >= 0", "block: int >= 1", "scaled: bool"}},
    {"HvdcTopKEncode", TopKEncode, kStateful,
     {"x: float", "r: M * resource"},
     {{"idx: T", LenTopKIdx}, {"val: V", LenK}},
     {"T: {int32, uint8}",
      "V: {float, int16} = DT_FLOAT",  // int16: the kept values as bfloat16 bits (values=BF16())
      "M: int >= 0", "n: int >= 1", "k: int >= 1", "stride: int >= 1", "want: int >= 1",
      "sent_rank: int >= 1",  // plan.fused_topk_sent_rank: the sample's estimate of the k-th largest
      "code: int",            // enum hvdc_index_code
      "low: int", "nbytes: int"}},
    {"HvdcSparseSum", SparseSum, kStateless,
     {"idxs: N * T", "vals: N * V", "s: float"},
     {kSum},
     {"T: {int32, uint8}", "V: {float, int16} = DT_FLOAT", "N: int >= 1", "n: int >= 0", "k: int >= 1",
      "code: int", "low: int", "nbytes: int", "scaled: bool"}},
    // Threshold and DGC (values=None): every element whose |acc| reaches thr is sent; the
    // kept count varies, so the outputs' length is known only when the op has run.
    {"HvdcSelectSent", SelectSent, kStateful,
     {"x: float", "r: M * resource", "thr: float"},
     {{"idx: int32", nullptr}, {"val: float", nullptr}},
     {"M: int >= 0", "n: int >= 0"}},
    {"HvdcSparseSumRaw", SparseSumRaw, kStateless,
     {"idxs: N * int32", "vals: N * float", "s: float"},
     {kSum},
     {"N: int >= 1", "n: int >= 0", "scaled: bool"}},
    {"HvdcSignEncode", SignEncode, kStateful,
     {"x: float", "r: M * resource"},
     {{"bits: uint8", LenSignBits}, {"scale: float", LenSignScale}},
     {"M: int >= 0", "n: int >= 0", "mode: int"}},  // enum hvdc_sign_mode
    {"HvdcSignDecodeSum", SignDecodeSum, kStateless,
     {"bits: N * uint8", "scales: N * float", "s: float"},
     {kSum},
     {"N: int >= 1", "n: int >= 0", "mode: int", "scaled: bool"}},  // mode: the encode's
    {"HvdcHalfEncode", HalfEncode, kStateful,
     {"x: float", "r: M * resource"},
     {{"h: T", LenN}},
     {"T: {half, int16}",  // half: IEEE float16; int16: the bits of a bfloat16
      "M: int >= 0", "n: int >= 0"}},
    {"HvdcMomentum", Momentum, kStateful,
     {"x: float", "u: resource"},
     {{"d: float", LenN, true}},
     {"n: int >= 0", "m: float", "nesterov: bool"}},
    {"HvdcBf16DecodeSum", Bf16DecodeSum, kStateless,
     {"hs: N * int16", "s: float"},
     {kSum},
     {"N: int >= 1", "n: int >= 0", "scaled: bool"}},
    // u: none (the op draws tf.random.stateless_uniform's numbers for `seed` itself) or one
    // tensor of n draws (a caller's own uniform), as the kernels take them.
    {"HvdcQsgdEncode", QsgdEncode, kStateful,
     {"x: float", "r: M * resource", "u: U * float", "seed: int64"},
     {{"q: int8", LenN}, {"norm: float", LenOne}},
     {"M: int >= 0", "U: int >= 0", "n: int >= 0", "levels: int >= 1"}},
    {"HvdcTernGradEncode", TernGradEncode, kStateful,
     {"x: float", "r: M * resource", "u: U * float", "seed: int64"},
     {{"t: uint8", LenTernBits}, {"scale: float", LenOne}},
     {"M: int >= 0", "U: int >= 0", "n: int >= 0"}},
    {"HvdcTernGradDecodeSum", TernGradDecodeSum, kStateless,
     {"ts: N * uint8", "scales: N * float", "s: float"},
     {kSum},
     {"N: int >= 1", "n: int >= 0", "scaled: bool"}},
    {"HvdcRandomKEncode", RandomKEncode, kStateful,
     {"x: float", "r: M * resource", "seed: int64"},
     {{"vals: float", LenK}, {"idx: int64", LenK}},
     {"M: int >= 0", "n: int >= 0", "k: int >= 1"},
     KAtMostN},
    {"HvdcScatter", Scatter, kStateless,
     {"idx: int64", "vals: float"},
     {kSum},
     {"n: int >= 0"}},
};

// ---- one kernel for every row ----------------------------------------------------------------
bool Declares(const std::vector<const char *> &decls, const char *name) {
  return std::any_of(decls.begin(), decls.end(), [&](const char *d) { return DeclName(d) == name; });
}

class TableKernel : public OpKernel {
 public:
  TableKernel(OpKernelConstruction *c, const OpSpec &spec) : OpKernel(c), spec_(spec) {
    OP_REQUIRES_OK(c, ReadAttrs(c, spec.attrs, &a_));
    OP_REQUIRES_OK(c, CheckEnums(a_));
    if (spec.check) OP_REQUIRES_OK(c, spec.check(a_));
  }

  void Compute(OpKernelContext *ctx) override {
    Call call{ctx, a_, scratch_};
    OP_REQUIRES_OK(ctx, Prepare(&call));
    if (!with_residual_) return spec_.body(call);
    WithResidual(ctx, a_.M, a_.n, [&](float *r) {
      call.r = r;
      spec_.body(call);
    });
  }

 private:
  absl::Status Prepare(Call *call) {
    OpKernelContext *ctx = call->ctx;
    const Tensor *t;
    if (has_x_) {
      TF_RETURN_IF_ERROR(ctx->input("x", &t));
      TF_RETURN_IF_ERROR(CheckVector(*t, a_.n, "x"));
      call->x = t->flat<float>().data();
    }
    if (has_seed_) TF_RETURN_IF_ERROR(GetDraws(ctx, a_.U, a_.n, &call->draws));
    if (has_s_) {
      TF_RETURN_IF_ERROR(ctx->input("s", &t));
      call->s = t->scalar<float>()();
    }
    for (int i = 0; i < static_cast<int>(spec_.outputs.size()); i++) {
      const Output &o = spec_.outputs[i];
      if (!o.len) continue;  // its body allocates it, once the length is known
      TF_RETURN_IF_ERROR(o.kept ? kept_[i].Allocate(ctx, i, o.len(a_), &call->out[i])
                                : ctx->allocate_output(i, TensorShape({o.len(a_)}), &call->out[i]));
    }
    return absl::OkStatus();
  }

  const OpSpec &spec_;
  const bool has_x_ = Declares(spec_.inputs, "x"), with_residual_ = Declares(spec_.inputs, "r"),
             has_seed_ = Declares(spec_.inputs, "seed"), has_s_ = Declares(spec_.inputs, "s");
  Attrs a_;
  Scratch scratch_;
  KeptOutput kept_[kMaxOutputs];
};

// The output shapes, from the same lengths the kernel allocates.
absl::Status InferShapes(const OpSpec &spec, InferenceContext *c) {
  Attrs a;
  TF_RETURN_IF_ERROR(ReadAttrs(c, spec.attrs, &a));
  for (int i = 0; i < static_cast<int>(spec.outputs.size()); i++) {
    auto len = spec.outputs[i].len;
    c->set_output(i, c->Vector(len ? len(a) : InferenceContext::kUnknownDim));
  }
  return absl::OkStatus();
}

class RowFactory : public kernel_factory::OpKernelFactory {
 public:
  explicit RowFactory(const OpSpec &spec) : spec_(spec) {}
  OpKernel *Create(OpKernelConstruction *c) override { return new TableKernel(c, spec_); }

 private:
  const OpSpec &spec_;
};

// What REGISTER_OP and REGISTER_KERNEL_BUILDER would write for the row.
void Register(const OpSpec &spec) {
  register_op::OpDefBuilderWrapper op(spec.name);
  for (const char *decl : spec.inputs) op.Input(decl);
  for (const Output &out : spec.outputs) op.Output(out.decl);
  for (const char *decl : spec.attrs) op.Attr(decl);
  if (spec.stateful) op.SetIsStateful();
  op.SetShapeFn([&spec](InferenceContext *c) { return InferShapes(spec, c); });
  op();
  kernel_factory::OpKernelRegistrar(register_kernel::Name(spec.name).Device(DEVICE_CPU).Build(), "TableKernel",
                                    std::make_unique<RowFactory>(spec));
}

// Every row's op, shape function and CPU kernel, registered when TF loads this library.
[[maybe_unused]] const bool kRegistered = [] {
  for (const OpSpec &spec : kOps) Register(spec);
  return true;
}();

}  // namespace
