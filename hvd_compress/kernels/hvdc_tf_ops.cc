// TensorFlow custom ops over hvdc_kernels.c (the same C kernels the torch
// codecs call through ctypes), for hvd_compress.codecs.tf_fused.
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
#include <numeric>
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

// ---- shapes: every output length follows from the attributes ----------------------------
absl::Status VectorFromAttr(InferenceContext *c, int output, const char *attr) {
  int64_t len;
  TF_RETURN_IF_ERROR(c->GetAttr(attr, &len));
  c->set_output(output, c->Vector(len));
  return absl::OkStatus();
}

REGISTER_OP("HvdcInt8Encode")
    .Input("x: float")
    .Input("r: M * resource")
    .Output("q: int8")
    .Output("scale: float")
    .Attr("M: int >= 0")
    .Attr("n: int >= 0")
    .Attr("block: int >= 1")
    .Attr("nb: int >= 1")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext *c) {
      TF_RETURN_IF_ERROR(VectorFromAttr(c, 0, "n"));
      return VectorFromAttr(c, 1, "nb");
    });

REGISTER_OP("HvdcInt8DecodeSum")
    .Input("qs: N * int8")
    .Input("scales: N * float")
    .Input("s: float")
    .Output("out: float")
    .Attr("N: int >= 1")
    .Attr("n: int >= 0")
    .Attr("block: int >= 1")
    .Attr("scaled: bool")
    .SetShapeFn([](InferenceContext *c) { return VectorFromAttr(c, 0, "n"); });

REGISTER_OP("HvdcTopKEncode")
    .Input("x: float")
    .Input("r: M * resource")
    .Output("idx: T")
    .Output("val: V")
    .Attr("T: {int32, uint8}")
    .Attr("V: {float, int16} = DT_FLOAT")  // int16: the kept values as bfloat16 bits (values=BF16())
    .Attr("M: int >= 0")
    .Attr("n: int >= 1")
    .Attr("k: int >= 1")
    .Attr("stride: int >= 1")
    .Attr("want: int >= 1")
    .Attr("sent_rank: int >= 1")  // plan.fused_topk_sent_rank: the sample's estimate of the k-th largest
    .Attr("code: int")  // enum hvdc_index_code
    .Attr("low: int")
    .Attr("nbytes: int")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext *c) {
      int code;
      TF_RETURN_IF_ERROR(c->GetAttr("code", &code));
      TF_RETURN_IF_ERROR(VectorFromAttr(c, 0, code == HVDC_CODE_RAW ? "k" : "nbytes"));  // raw: k int32
      return VectorFromAttr(c, 1, "k");
    });

REGISTER_OP("HvdcSparseSum")
    .Input("idxs: N * T")
    .Input("vals: N * V")
    .Input("s: float")
    .Output("out: float")
    .Attr("T: {int32, uint8}")
    .Attr("V: {float, int16} = DT_FLOAT")
    .Attr("N: int >= 1")
    .Attr("n: int >= 0")
    .Attr("k: int >= 1")
    .Attr("code: int")
    .Attr("low: int")
    .Attr("nbytes: int")
    .Attr("scaled: bool")
    .SetShapeFn([](InferenceContext *c) { return VectorFromAttr(c, 0, "n"); });

// Threshold and DGC (values=None): every element whose |acc| reaches thr is sent; the
// kept count varies, so the outputs' length is known only when the op has run.
REGISTER_OP("HvdcSelectSent")
    .Input("x: float")
    .Input("r: M * resource")
    .Input("thr: float")
    .Output("idx: int32")
    .Output("val: float")
    .Attr("M: int >= 0")
    .Attr("n: int >= 0")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext *c) {
      c->set_output(0, c->Vector(InferenceContext::kUnknownDim));
      c->set_output(1, c->Vector(InferenceContext::kUnknownDim));
      return absl::OkStatus();
    });

// The sum of the ranks' raw-coded sparse payloads of any lengths (Threshold, DGC).
REGISTER_OP("HvdcSparseSumRaw")
    .Input("idxs: N * int32")
    .Input("vals: N * float")
    .Input("s: float")
    .Output("out: float")
    .Attr("N: int >= 1")
    .Attr("n: int >= 0")
    .Attr("scaled: bool")
    .SetShapeFn([](InferenceContext *c) { return VectorFromAttr(c, 0, "n"); });

REGISTER_OP("HvdcSignEncode")
    .Input("x: float")
    .Input("r: M * resource")
    .Output("bits: uint8")
    .Output("scale: float")
    .Attr("M: int >= 0")
    .Attr("n: int >= 0")
    .Attr("mode: int")  // enum hvdc_sign_mode; the scale output: one float, OneBit's two means
    .SetIsStateful()
    .SetShapeFn([](InferenceContext *c) {
      int64_t n;
      int mode;
      TF_RETURN_IF_ERROR(c->GetAttr("n", &n));
      TF_RETURN_IF_ERROR(c->GetAttr("mode", &mode));
      c->set_output(0, c->Vector((n + 7) / 8));
      c->set_output(1, c->Vector(mode == HVDC_SIGN_ONEBIT ? 2 : 1));
      return absl::OkStatus();
    });

REGISTER_OP("HvdcSignDecodeSum")
    .Input("bits: N * uint8")
    .Input("scales: N * float")
    .Input("s: float")
    .Output("out: float")
    .Attr("N: int >= 1")
    .Attr("n: int >= 0")
    .Attr("mode: int")
    .Attr("scaled: bool")
    .SetShapeFn([](InferenceContext *c) { return VectorFromAttr(c, 0, "n"); });

REGISTER_OP("HvdcHalfEncode")
    .Input("x: float")
    .Input("r: M * resource")
    .Output("h: T")
    .Attr("T: {half, int16}")  // half: IEEE float16; int16: the bits of a bfloat16
    .Attr("M: int >= 0")
    .Attr("n: int >= 0")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext *c) { return VectorFromAttr(c, 0, "n"); });

// Momentum-aware error feedback's first pass: u = m u + x in the velocity
// variable (kept finite), d = u or x + m u (Nesterov) out; a codec then
// compresses d + residual.
REGISTER_OP("HvdcMomentum")
    .Input("x: float")
    .Input("u: resource")
    .Output("d: float")
    .Attr("n: int >= 0")
    .Attr("m: float")
    .Attr("nesterov: bool")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext *c) { return VectorFromAttr(c, 0, "n"); });

REGISTER_OP("HvdcBf16DecodeSum")
    .Input("hs: N * int16")
    .Input("s: float")
    .Output("out: float")
    .Attr("N: int >= 1")
    .Attr("n: int >= 0")
    .Attr("scaled: bool")
    .SetShapeFn([](InferenceContext *c) { return VectorFromAttr(c, 0, "n"); });

// ---- shared pieces ---------------------------------------------------------------------------
absl::Status CheckVector(const Tensor &t, i64 n, const char *what) {
  if (t.dims() != 1 || t.dim_size(0) != n)
    return errors::InvalidArgument(what, " must be a vector of ", n, " elements; got shape ",
                                   t.shape().DebugString());
  return absl::OkStatus();
}

// ---- the randomised schemes: the kernels draw TF's stateless Philox stream for the seed ----
// u: none (the op draws tf.random.stateless_uniform's numbers for `seed` itself) or one
// tensor of n draws (a caller's own uniform), as the kernels take them.
REGISTER_OP("HvdcQsgdEncode")
    .Input("x: float")
    .Input("r: M * resource")
    .Input("u: U * float")
    .Input("seed: int64")
    .Output("q: int8")
    .Output("norm: float")
    .Attr("M: int >= 0")
    .Attr("U: int >= 0")
    .Attr("n: int >= 0")
    .Attr("levels: int >= 1")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext *c) {
      TF_RETURN_IF_ERROR(VectorFromAttr(c, 0, "n"));
      c->set_output(1, c->Vector(1));
      return absl::OkStatus();
    });

REGISTER_OP("HvdcTernGradEncode")
    .Input("x: float")
    .Input("r: M * resource")
    .Input("u: U * float")
    .Input("seed: int64")
    .Output("t: uint8")
    .Output("scale: float")
    .Attr("M: int >= 0")
    .Attr("U: int >= 0")
    .Attr("n: int >= 0")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext *c) {
      int64_t n;
      TF_RETURN_IF_ERROR(c->GetAttr("n", &n));
      c->set_output(0, c->Vector((n + 3) / 4));
      c->set_output(1, c->Vector(1));
      return absl::OkStatus();
    });

REGISTER_OP("HvdcTernGradDecodeSum")
    .Input("ts: N * uint8")
    .Input("scales: N * float")
    .Input("s: float")
    .Output("out: float")
    .Attr("N: int >= 1")
    .Attr("n: int >= 0")
    .Attr("scaled: bool")
    .SetShapeFn([](InferenceContext *c) { return VectorFromAttr(c, 0, "n"); });

REGISTER_OP("HvdcRandomKEncode")
    .Input("x: float")
    .Input("r: M * resource")
    .Input("seed: int64")
    .Output("vals: float")
    .Output("idx: int64")
    .Attr("M: int >= 0")
    .Attr("n: int >= 0")
    .Attr("k: int >= 1")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext *c) {
      TF_RETURN_IF_ERROR(VectorFromAttr(c, 0, "k"));
      return VectorFromAttr(c, 1, "k");
    });

REGISTER_OP("HvdcScatter")
    .Input("idx: int64")
    .Input("vals: float")
    .Output("out: float")
    .Attr("n: int >= 0")
    .SetShapeFn([](InferenceContext *c) { return VectorFromAttr(c, 0, "n"); });

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

float ScaleInput(OpKernelContext *ctx, int index) { return ctx->input(index).scalar<float>()(); }

// The int attribute `name` as one of the enum's values first..last, or an error naming them.
template <typename Enum>
absl::Status GetEnumAttr(OpKernelConstruction *c, const char *name, Enum first, Enum last, Enum *out) {
  int v;
  TF_RETURN_IF_ERROR(c->GetAttr(name, &v));
  if (v < static_cast<int>(first) || v > static_cast<int>(last))
    return errors::InvalidArgument("attribute ", name, " must be in [", static_cast<int>(first), ", ",
                                   static_cast<int>(last), "] (hvdc_kernels.h); got ", v);
  *out = static_cast<Enum>(v);
  return absl::OkStatus();
}

absl::Status GetCodeAttr(OpKernelConstruction *c, hvdc_index_code *out) {
  return GetEnumAttr(c, "code", HVDC_CODE_RAW, HVDC_CODE_ELIAS_FANO, out);
}

absl::Status GetModeAttr(OpKernelConstruction *c, hvdc_sign_mode *out) {
  return GetEnumAttr(c, "mode", HVDC_SIGN_SIGNSGD, HVDC_SIGN_ONEBIT, out);
}

// ---- Int8 ------------------------------------------------------------------------------------
class Int8EncodeOp : public OpKernel {
 public:
  explicit Int8EncodeOp(OpKernelConstruction *c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("M", &m_));
    OP_REQUIRES_OK(c, c->GetAttr("n", &n_));
    OP_REQUIRES_OK(c, c->GetAttr("block", &block_));
    OP_REQUIRES_OK(c, c->GetAttr("nb", &nb_));
  }
  void Compute(OpKernelContext *ctx) override {
    const Tensor &x = ctx->input(0);
    OP_REQUIRES_OK(ctx, CheckVector(x, n_, "x"));
    Tensor *q = nullptr, *scale = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n_}), &q));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({nb_}), &scale));
    const float *xp = x.flat<float>().data();
    WithResidual(ctx, m_, n_, [&](float *r) {
      hvdc_int8_encode_rcp(xp, r, n_, block_, q->flat<int8_t>().data(), scale->flat<float>().data());
    });
  }

 private:
  int m_;
  int64_t n_, block_, nb_;
};

class Int8DecodeSumOp : public OpKernel {
 public:
  explicit Int8DecodeSumOp(OpKernelConstruction *c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("n", &n_));
    OP_REQUIRES_OK(c, c->GetAttr("block", &block_));
    OP_REQUIRES_OK(c, c->GetAttr("scaled", &scaled_));
  }
  void Compute(OpKernelContext *ctx) override {
    OpInputList qs, scales;
    OP_REQUIRES_OK(ctx, ctx->input_list("qs", &qs));
    OP_REQUIRES_OK(ctx, ctx->input_list("scales", &scales));
    const i64 nb = n_ ? (n_ + block_ - 1) / block_ : 1;
    std::vector<const int8_t *> qp;
    std::vector<const float *> sp;
    for (int j = 0; j < qs.size(); j++) {
      OP_REQUIRES_OK(ctx, CheckVector(qs[j], n_, "q"));
      OP_REQUIRES_OK(ctx, CheckVector(scales[j], nb, "scale"));
      qp.push_back(qs[j].flat<int8_t>().data());
      sp.push_back(scales[j].flat<float>().data());
    }
    Tensor *out = nullptr;
    OP_REQUIRES_OK(ctx, kept_out_.Allocate(ctx, 0, n_, &out));
    hvdc_int8_decode_sum(qs.size(), qp.data(), sp.data(), n_, block_, ScaleInput(ctx, 2 * qs.size()), scaled_,
                         out->flat<float>().data());
  }

 private:
  KeptOutput kept_out_;
  int64_t n_, block_;
  bool scaled_;
};

// ---- Top-K -----------------------------------------------------------------------------------
class TopKEncodeOp : public OpKernel {
 public:
  explicit TopKEncodeOp(OpKernelConstruction *c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("n", &n_));
    OP_REQUIRES_OK(c, c->GetAttr("k", &k_));
    OP_REQUIRES_OK(c, c->GetAttr("stride", &stride_));
    OP_REQUIRES_OK(c, c->GetAttr("want", &want_));
    OP_REQUIRES_OK(c, c->GetAttr("sent_rank", &sent_rank_));
    OP_REQUIRES_OK(c, c->GetAttr("nbytes", &nbytes_));
    OP_REQUIRES_OK(c, c->GetAttr("M", &m_));
    OP_REQUIRES_OK(c, GetCodeAttr(c, &code_));
    OP_REQUIRES_OK(c, c->GetAttr("low", &low_));
    DataType v;
    OP_REQUIRES_OK(c, c->GetAttr("V", &v));
    bf16_values_ = v == DT_INT16;
  }
  void Compute(OpKernelContext *ctx) override {
    const Tensor &x = ctx->input(0);
    OP_REQUIRES_OK(ctx, CheckVector(x, n_, "x"));
    WithResidual(ctx, m_, n_, [&](float *r) { Encode(ctx, x.flat<float>().data(), r); });
  }

 private:
  // Sampled threshold; one pass forming acc = x + r and collecting the candidates, with error
  // feedback writing each candidate's residual as if sent (0, or its bfloat16 rounding error) from the
  // sample's estimate of the k-th largest on; the exact k among them packed as the payload as they are
  // kept, and the residuals on the wrong side of the estimate settled (hvdc_topk_select_pack): torch's
  // TopKCodec in one op
  void Encode(OpKernelContext *ctx, const float *x, float *r) {
    Tensor sample_t, cand_t, cval_t, tmp_t;
    const i64 m = (n_ + stride_ - 1) / stride_;
    float *sample = Alloc<float>(ctx, &sample_t, DT_FLOAT, m);
    if (!sample) return;
    hvdc_sample_magnitudes(x, r, n_, stride_, HVDC_NAN_LARGEST, sample);
    const i64 want = std::min(want_, m);
    float thr = hvdc_kth_largest(sample, m, want);
    const hvdc_sent_rule sent = !r ? HVDC_SENT_KEPT : bf16_values_ ? HVDC_SENT_BF16 : HVDC_SENT_ZERO;
    // among the `want` largest the partial sort left in front
    const float thr_sent = sent != HVDC_SENT_KEPT ? hvdc_kth_largest(sample, want, std::min(sent_rank_, want)) : thr;
    i64 cap = HVDC_TOPK_ROOM_PER_K * k_ + HVDC_TOPK_ROOM_SLACK;
    i64 *cand = Alloc<i64>(ctx, &cand_t, DT_INT64, cap);
    float *cval = Alloc<float>(ctx, &cval_t, DT_FLOAT, cap);
    if (!cand || !cval) return;
    i64 c = hvdc_compensate_select_sent(x, r, n_, thr, HVDC_AT_LEAST, HVDC_NAN_LARGEST, sent, thr_sent, cand, cval, cap);
    // collected again from acc, as it is in r (or x without error feedback)
    auto collect_again = [&]() {
      return r ? hvdc_compensate_select_sent(nullptr, r, n_, thr, HVDC_AT_LEAST, HVDC_NAN_LARGEST, sent, thr_sent,
                                             cand, cval, cap)
               : hvdc_compensate_select_sent(x, nullptr, n_, thr, HVDC_AT_LEAST, HVDC_NAN_LARGEST, sent, thr_sent,
                                             cand, cval, cap);
    };
    for (int lowered = 0;; lowered++) {
      if (c > cap) {  // more candidates than room: residuals put back, collected again with room
        if (r) hvdc_restore_candidates(r, cand, cval, cap, 0);
        cap = c;
        cand = Alloc<i64>(ctx, &cand_t, DT_INT64, cap);
        cval = Alloc<float>(ctx, &cval_t, DT_FLOAT, cap);
        if (!cand || !cval) return;
        c = collect_again();
      }
      if (c >= k_) break;
      // the sample overshot (fewer than k candidates): a lower threshold, one more
      // read of acc (as the torch codec); after that many tries every element is a candidate
      if (r) hvdc_restore_candidates(r, cand, cval, c, 0);
      thr = lowered < HVDC_TOPK_LOWERINGS ? thr / 4.0f : -INFINITY;
      c = collect_again();
    }
    Tensor *idx_out = nullptr, *val_out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({code_ == HVDC_CODE_RAW ? k_ : nbytes_}), &idx_out));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({k_}), &val_out));
    float *tmp = Alloc<float>(ctx, &tmp_t, DT_FLOAT, c);
    if (!tmp) return;
    auto *coded = reinterpret_cast<uint8_t *>(const_cast<char *>(idx_out->tensor_data().data()));
    void *vals = const_cast<char *>(val_out->tensor_data().data());
    hvdc_topk_select_pack(cand, cval, c, k_, HVDC_NAN_LARGEST, tmp, r, sent, thr_sent, code_, low_, coded, nbytes_,
                          bf16_values_ ? 1 : 0, vals);
  }

  int m_, low_;
  bool bf16_values_;
  hvdc_index_code code_;
  int64_t n_, k_, stride_, want_, sent_rank_, nbytes_;
};

class SparseSumOp : public OpKernel {
 public:
  explicit SparseSumOp(OpKernelConstruction *c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("n", &n_));
    OP_REQUIRES_OK(c, c->GetAttr("k", &k_));
    OP_REQUIRES_OK(c, GetCodeAttr(c, &code_));
    OP_REQUIRES_OK(c, c->GetAttr("low", &low_));
    OP_REQUIRES_OK(c, c->GetAttr("nbytes", &nbytes_));
    OP_REQUIRES_OK(c, c->GetAttr("scaled", &scaled_));
    DataType v;
    OP_REQUIRES_OK(c, c->GetAttr("V", &v));
    bf16_values_ = v == DT_INT16;
  }
  void Compute(OpKernelContext *ctx) override {
    OpInputList idxs, vals;
    OP_REQUIRES_OK(ctx, ctx->input_list("idxs", &idxs));
    OP_REQUIRES_OK(ctx, ctx->input_list("vals", &vals));
    const int nr = idxs.size();
    std::vector<const uint8_t *> cp;
    std::vector<const void *> vraw;
    for (int j = 0; j < nr; j++) {
      OP_REQUIRES_OK(ctx, CheckVector(vals[j], k_, "val"));
      OP_REQUIRES(ctx, (i64)idxs[j].tensor_data().size() == nbytes_,
                  errors::InvalidArgument("idx of rank ", j, " must hold ", nbytes_, " bytes; got ",
                                          idxs[j].tensor_data().size()));
      cp.push_back(reinterpret_cast<const uint8_t *>(idxs[j].tensor_data().data()));
      vraw.push_back(vals[j].tensor_data().data());
    }
    std::vector<i64> ks(nr, k_);
    Tensor *out = nullptr;
    OP_REQUIRES_OK(ctx, kept_out_.Allocate(ctx, 0, n_, &out));
    // one pass: each rank's code and values decoded and added block by block into out
    const i64 status = hvdc_sparse_decode_sum(nr, cp.data(), code_, low_, ks.data(), vraw.data(), bf16_values_ ? 1 : 0,
                                              n_, ScaleInput(ctx, 2 * nr), scaled_, out->flat<float>().data());
    OP_REQUIRES(ctx, status == 0 || status == -1,
                errors::InvalidArgument("a Top-K payload holds an index outside [0, ", n_,
                                        ") or fewer indices than its code declares"));
    if (status == 0) return;
    // raw indices from an eager (top_k order) encoder: decoded, sorted, then summed
    Tensor idx_t, val_t;
    i64 *idx = Alloc<i64>(ctx, &idx_t, DT_INT64, nr * k_);
    float *val = Alloc<float>(ctx, &val_t, DT_FLOAT, nr * k_);
    if (!idx || !val) return;
    std::vector<const i64 *> ip;
    std::vector<const float *> vp;
    for (int j = 0; j < nr; j++) {
      OP_REQUIRES_OK(ctx, CheckVector(vals[j], k_, "val"));
      const uint8_t *coded = reinterpret_cast<const uint8_t *>(idxs[j].tensor_data().data());
      OP_REQUIRES(ctx, (i64)idxs[j].tensor_data().size() == nbytes_,
                  errors::InvalidArgument("idx of rank ", j, " must hold ", nbytes_, " bytes; got ",
                                          idxs[j].tensor_data().size()));
      i64 *ij = idx + j * k_;
      float *vj = val + j * k_;
      hvdc_index_decode(coded, k_, n_, code_, low_, ij);
      if (bf16_values_) {  // bfloat16 bits to float: the one-rank bf16 decode
        const uint16_t *bits = reinterpret_cast<const uint16_t *>(vals[j].tensor_data().data());
        hvdc_bf16_decode_sum(1, &bits, k_, 0.0f, 0, vj);
      } else {
        std::memcpy(vj, vals[j].flat<float>().data(), k_ * sizeof(float));
      }
      if (!hvdc_is_ascending(ij, k_)) SortPairs(ij, vj);  // raw indices from an eager (top_k order) encoder
      for (i64 t = 0; t < k_; t++)
        OP_REQUIRES(ctx, ij[t] >= 0 && ij[t] < n_, errors::InvalidArgument("index ", ij[t], " out of [0, ", n_, ")"));
      ip.push_back(ij);
      vp.push_back(vj);
    }
    hvdc_sparse_sum(nr, ip.data(), vp.data(), ks.data(), n_, ScaleInput(ctx, 2 * nr), scaled_,
                    out->flat<float>().data());
  }

 private:
  KeptOutput kept_out_;
  void SortPairs(i64 *idx, float *val) {
    std::vector<i64> order(k_);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](i64 a, i64 b) { return idx[a] < idx[b]; });
    std::vector<i64> i2(k_);
    std::vector<float> v2(k_);
    for (i64 t = 0; t < k_; t++) i2[t] = idx[order[t]], v2[t] = val[order[t]];
    std::copy(i2.begin(), i2.end(), idx);
    std::copy(v2.begin(), v2.end(), val);
  }

  int low_;
  hvdc_index_code code_;
  int64_t n_, k_, nbytes_;
  bool scaled_, bf16_values_;
};

// ---- Threshold and DGC ---------------------------------------------------------------------
// One pass: acc formed, the kept indices (int32, the raw code) and values packed into buffers
// kept across calls (the room a past call needed), the residual 0 where sent; then copied into
// outputs of the kept length.
class SelectSentOp : public OpKernel {
 public:
  explicit SelectSentOp(OpKernelConstruction *c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("M", &m_));
    OP_REQUIRES_OK(c, c->GetAttr("n", &n_));
  }
  void Compute(OpKernelContext *ctx) override {
    const Tensor &x = ctx->input(0);
    OP_REQUIRES_OK(ctx, CheckVector(x, n_, "x"));
    const float thr = ctx->input(1 + m_).scalar<float>()();
    mutex_lock l(mu_);
    WithResidual(ctx, m_, n_, [&](float *r) { Select(ctx, x.flat<float>().data(), r, thr); });
  }

 private:
  static constexpr i64 kSlack = 16;  // hvdc_select_sent writes up to a vector past its count

  bool Room(OpKernelContext *ctx, i64 room) {
    if (room_ >= room) return true;
    room_ = room;
    auto st = ctx->allocate_temp(DT_INT32, TensorShape({room + kSlack}), &idx_);
    if (st.ok()) st = ctx->allocate_temp(DT_FLOAT, TensorShape({room + kSlack}), &val_);
    if (!st.ok()) { ctx->CtxFailure(st); room_ = 0; return false; }
    return true;
  }

  void Select(OpKernelContext *ctx, const float *x, float *r, float thr) {
    if (!Room(ctx, std::max<i64>(1024, n_ / 64))) return;
    i64 room = room_;
    i64 c = hvdc_select_sent(x, r, n_, thr, HVDC_AT_LEAST, idx_.flat<int32_t>().data(), val_.flat<float>().data(),
                             room);
    if (c > room) {  // out of room: undo the stored part, select again from acc with room
      if (r) hvdc_unsend(r, idx_.flat<int32_t>().data(), val_.flat<float>().data(), room);
      if (!Room(ctx, std::min<i64>(n_, c + c / 2 + 1024))) return;  // headroom, as the torch codec
      c = hvdc_select_sent(r ? nullptr : x, r, n_, thr, HVDC_AT_LEAST, idx_.flat<int32_t>().data(),
                           val_.flat<float>().data(), room_);
    }
    Tensor *idx_out = nullptr, *val_out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({c}), &idx_out));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({c}), &val_out));
    std::memcpy(idx_out->flat<int32_t>().data(), idx_.flat<int32_t>().data(), c * sizeof(int32_t));
    std::memcpy(val_out->flat<float>().data(), val_.flat<float>().data(), c * sizeof(float));
  }

  mutex mu_;
  Tensor idx_, val_;
  i64 room_ = 0;
  int m_;
  int64_t n_;
};

class SparseSumRawOp : public OpKernel {
 public:
  explicit SparseSumRawOp(OpKernelConstruction *c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("n", &n_));
    OP_REQUIRES_OK(c, c->GetAttr("scaled", &scaled_));
  }
  void Compute(OpKernelContext *ctx) override {
    OpInputList idxs, vals;
    OP_REQUIRES_OK(ctx, ctx->input_list("idxs", &idxs));
    OP_REQUIRES_OK(ctx, ctx->input_list("vals", &vals));
    const int nr = idxs.size();
    std::vector<i64> ks(nr);
    std::vector<const int32_t *> ip(nr);
    std::vector<const float *> vp(nr);
    for (int j = 0; j < nr; j++) {
      ks[j] = idxs[j].NumElements();
      OP_REQUIRES(ctx, idxs[j].dims() == 1 && vals[j].dims() == 1 && vals[j].NumElements() == ks[j],
                  errors::InvalidArgument("idx and val of rank ", j, " must be vectors of one length; got ",
                                          idxs[j].shape().DebugString(), " and ", vals[j].shape().DebugString()));
      ip[j] = idxs[j].flat<int32_t>().data();
      vp[j] = vals[j].flat<float>().data();
    }
    Tensor *out = nullptr;
    OP_REQUIRES_OK(ctx, kept_out_.Allocate(ctx, 0, n_, &out));
    const float s = ScaleInput(ctx, 2 * nr);
    i64 status = hvdc_sparse_sum_i32(nr, ip.data(), vp.data(), ks.data(), n_, s, scaled_, out->flat<float>().data());
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
      status = hvdc_sparse_sum_i32(nr, ip.data(), vp.data(), ks.data(), n_, s, scaled_, out->flat<float>().data());
    }
    OP_REQUIRES(ctx, status == 0, errors::InvalidArgument("a sparse payload holds an index outside [0, ", n_,
                                                          ") or a repeated index"));
  }

 private:
  KeptOutput kept_out_;
  int64_t n_;
  bool scaled_;
};

// ---- the sign family and 16-bit floats -------------------------------------------------------
class SignEncodeOp : public OpKernel {
 public:
  explicit SignEncodeOp(OpKernelConstruction *c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("M", &m_));
    OP_REQUIRES_OK(c, c->GetAttr("n", &n_));
    OP_REQUIRES_OK(c, GetModeAttr(c, &mode_));
  }
  void Compute(OpKernelContext *ctx) override {
    const Tensor &x = ctx->input(0);
    OP_REQUIRES_OK(ctx, CheckVector(x, n_, "x"));
    Tensor *bits = nullptr, *scale = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({(n_ + 7) / 8}), &bits));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({mode_ == HVDC_SIGN_ONEBIT ? 2 : 1}), &scale));
    const float *xp = x.flat<float>().data();
    WithResidual(ctx, m_, n_, [&](float *r) {
      if (mode_ == HVDC_SIGN_ONEBIT)
        hvdc_onebit_encode(xp, r, n_, bits->flat<uint8_t>().data(), scale->flat<float>().data());
      else
        hvdc_sign_encode(xp, r, n_, mode_, bits->flat<uint8_t>().data(), scale->flat<float>().data());
    });
  }

 private:
  int m_;
  hvdc_sign_mode mode_;
  int64_t n_;
};

class SignDecodeSumOp : public OpKernel {
 public:
  explicit SignDecodeSumOp(OpKernelConstruction *c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("n", &n_));
    OP_REQUIRES_OK(c, GetModeAttr(c, &mode_));
    OP_REQUIRES_OK(c, c->GetAttr("scaled", &scaled_));
  }
  void Compute(OpKernelContext *ctx) override {
    OpInputList bits, scales;
    OP_REQUIRES_OK(ctx, ctx->input_list("bits", &bits));
    OP_REQUIRES_OK(ctx, ctx->input_list("scales", &scales));
    std::vector<const uint8_t *> bp;
    std::vector<float> sv;
    for (int j = 0; j < bits.size(); j++) {
      OP_REQUIRES_OK(ctx, CheckVector(bits[j], (n_ + 7) / 8, "bits"));
      const int want = mode_ == HVDC_SIGN_ONEBIT ? 2 : 1;
      OP_REQUIRES(ctx, scales[j].NumElements() >= want,
                  errors::InvalidArgument("scale of rank ", j, " has ", scales[j].NumElements(), " values, not ", want));
      bp.push_back(bits[j].flat<uint8_t>().data());
      for (int v = 0; v < want; v++) sv.push_back(scales[j].flat<float>()(v));
    }
    Tensor *out = nullptr;
    OP_REQUIRES_OK(ctx, kept_out_.Allocate(ctx, 0, n_, &out));
    if (mode_ == HVDC_SIGN_ONEBIT)
      hvdc_onebit_decode_sum(bits.size(), bp.data(), sv.data(), n_, ScaleInput(ctx, 2 * bits.size()), scaled_,
                             out->flat<float>().data());
    else
      hvdc_sign_decode_sum(bits.size(), bp.data(), sv.data(), n_, mode_, ScaleInput(ctx, 2 * bits.size()), scaled_,
                           out->flat<float>().data());
  }

 private:
  KeptOutput kept_out_;
  hvdc_sign_mode mode_;
  int64_t n_;
  bool scaled_;
};

class HalfEncodeOp : public OpKernel {
 public:
  explicit HalfEncodeOp(OpKernelConstruction *c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("M", &m_));
    OP_REQUIRES_OK(c, c->GetAttr("n", &n_));
    DataType t;
    OP_REQUIRES_OK(c, c->GetAttr("T", &t));
    bf16_ = t == DT_INT16;
  }
  void Compute(OpKernelContext *ctx) override {
    const Tensor &x = ctx->input(0);
    OP_REQUIRES_OK(ctx, CheckVector(x, n_, "x"));
    Tensor *h = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n_}), &h));
    const float *xp = x.flat<float>().data();
    auto *hp = reinterpret_cast<uint16_t *>(const_cast<char *>(h->tensor_data().data()));
    WithResidual(ctx, m_, n_, [&](float *r) { hvdc_half_encode(xp, r, n_, bf16_ ? HVDC_HALF_BF16 : HVDC_HALF_FP16, hp); });
  }

 private:
  int m_;
  int64_t n_;
  bool bf16_;
};

class MomentumOp : public OpKernel {
 public:
  explicit MomentumOp(OpKernelConstruction *c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("n", &n_));
    OP_REQUIRES_OK(c, c->GetAttr("m", &m_));
    OP_REQUIRES_OK(c, c->GetAttr("nesterov", &nesterov_));
  }
  void Compute(OpKernelContext *ctx) override {
    const Tensor &x = ctx->input(0);
    OP_REQUIRES_OK(ctx, CheckVector(x, n_, "x"));
    Tensor *d = nullptr;
    OP_REQUIRES_OK(ctx, kept_out_.Allocate(ctx, 0, n_, &d));
    core::RefCountPtr<Var> var;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 1), &var));
    mutex_lock ml(*var->mu());
    float *u = nullptr;
    OP_REQUIRES_OK(ctx, ResidualForUpdate(ctx, var.get(), n_, &u, "velocity"));
    hvdc_momentum(x.flat<float>().data(), u, n_, m_, nesterov_ ? 1 : 0, d->flat<float>().data());
  }

 private:
  KeptOutput kept_out_;
  int64_t n_;
  float m_;
  bool nesterov_;
};

class Bf16DecodeSumOp : public OpKernel {
 public:
  explicit Bf16DecodeSumOp(OpKernelConstruction *c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("n", &n_));
    OP_REQUIRES_OK(c, c->GetAttr("scaled", &scaled_));
  }
  void Compute(OpKernelContext *ctx) override {
    OpInputList hs;
    OP_REQUIRES_OK(ctx, ctx->input_list("hs", &hs));
    std::vector<const uint16_t *> hp;
    for (int j = 0; j < hs.size(); j++) {
      OP_REQUIRES_OK(ctx, CheckVector(hs[j], n_, "bits"));
      hp.push_back(reinterpret_cast<const uint16_t *>(hs[j].tensor_data().data()));
    }
    Tensor *out = nullptr;
    OP_REQUIRES_OK(ctx, kept_out_.Allocate(ctx, 0, n_, &out));
    hvdc_bf16_decode_sum(hs.size(), hp.data(), n_, ScaleInput(ctx, hs.size()), scaled_, out->flat<float>().data());
  }

 private:
  KeptOutput kept_out_;
  int64_t n_;
  bool scaled_;
};

// ---- the randomised schemes ------------------------------------------------------------------
// The seed input (a scalar int64, the last input) and the optional draws u (input 1 + M).
struct Draws {
  const float *u = nullptr;
  i64 seed = 0;
};

absl::Status GetDraws(OpKernelContext *ctx, int m, int with_u, i64 n, Draws *d) {
  const Tensor &seed = ctx->input(ctx->num_inputs() - 1);
  if (seed.NumElements() != 1) return errors::InvalidArgument("seed must be one int64");
  d->seed = seed.flat<int64_t>()(0);
  if (d->seed < 0) return errors::InvalidArgument("seed must be >= 0; got ", d->seed);
  if (with_u) {
    const Tensor &u = ctx->input(1 + m);
    TF_RETURN_IF_ERROR(CheckVector(u, n, "u"));
    d->u = u.flat<float>().data();
  }
  return absl::OkStatus();
}

class QsgdEncodeOp : public OpKernel {
 public:
  explicit QsgdEncodeOp(OpKernelConstruction *c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("M", &m_));
    OP_REQUIRES_OK(c, c->GetAttr("U", &u_));
    OP_REQUIRES_OK(c, c->GetAttr("n", &n_));
    OP_REQUIRES_OK(c, c->GetAttr("levels", &levels_));
  }
  void Compute(OpKernelContext *ctx) override {
    const Tensor &x = ctx->input(0);
    OP_REQUIRES_OK(ctx, CheckVector(x, n_, "x"));
    Draws d;
    OP_REQUIRES_OK(ctx, GetDraws(ctx, m_, u_, n_, &d));
    Tensor *q = nullptr, *norm = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n_}), &q));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({1}), &norm));
    const float *xp = x.flat<float>().data();
    WithResidual(ctx, m_, n_, [&](float *r) {
      hvdc_qsgd_encode(xp, r, n_, levels_, d.u, HVDC_FW_TF, d.seed, q->flat<int8_t>().data(), norm->flat<float>().data());
    });
  }

 private:
  int m_, u_, levels_;
  int64_t n_;
};

class TernGradEncodeOp : public OpKernel {
 public:
  explicit TernGradEncodeOp(OpKernelConstruction *c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("M", &m_));
    OP_REQUIRES_OK(c, c->GetAttr("U", &u_));
    OP_REQUIRES_OK(c, c->GetAttr("n", &n_));
  }
  void Compute(OpKernelContext *ctx) override {
    const Tensor &x = ctx->input(0);
    OP_REQUIRES_OK(ctx, CheckVector(x, n_, "x"));
    Draws d;
    OP_REQUIRES_OK(ctx, GetDraws(ctx, m_, u_, n_, &d));
    Tensor *t = nullptr, *scale = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({(n_ + 3) / 4}), &t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({1}), &scale));
    const float *xp = x.flat<float>().data();
    WithResidual(ctx, m_, n_, [&](float *r) {
      hvdc_terngrad_encode(xp, r, n_, d.u, HVDC_FW_TF, d.seed, t->flat<uint8_t>().data(), scale->flat<float>().data());
    });
  }

 private:
  int m_, u_;
  int64_t n_;
};

class TernGradDecodeSumOp : public OpKernel {
 public:
  explicit TernGradDecodeSumOp(OpKernelConstruction *c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("n", &n_));
    OP_REQUIRES_OK(c, c->GetAttr("scaled", &scaled_));
  }
  void Compute(OpKernelContext *ctx) override {
    OpInputList ts, scales;
    OP_REQUIRES_OK(ctx, ctx->input_list("ts", &ts));
    OP_REQUIRES_OK(ctx, ctx->input_list("scales", &scales));
    std::vector<const uint8_t *> tp;
    std::vector<float> sv;
    for (int j = 0; j < ts.size(); j++) {
      OP_REQUIRES_OK(ctx, CheckVector(ts[j], (n_ + 3) / 4, "t"));
      OP_REQUIRES(ctx, scales[j].NumElements() >= 1, errors::InvalidArgument("scale of rank ", j, " is empty"));
      tp.push_back(ts[j].flat<uint8_t>().data());
      sv.push_back(scales[j].flat<float>()(0));
    }
    Tensor *out = nullptr;
    OP_REQUIRES_OK(ctx, kept_out_.Allocate(ctx, 0, n_, &out));
    hvdc_terngrad_decode_sum(ts.size(), tp.data(), sv.data(), n_, ScaleInput(ctx, 2 * ts.size()), scaled_,
                             out->flat<float>().data());
  }

 private:
  KeptOutput kept_out_;
  int64_t n_;
  bool scaled_;
};

// Random-K: TF's shared indices (the k largest stateless draws) drawn in C into kept
// candidate buffers, then acc formed in place, the values gathered and their
// residual cleared.
class RandomKEncodeOp : public OpKernel {
 public:
  explicit RandomKEncodeOp(OpKernelConstruction *c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("M", &m_));
    OP_REQUIRES_OK(c, c->GetAttr("n", &n_));
    OP_REQUIRES_OK(c, c->GetAttr("k", &k_));
    OP_REQUIRES(c, k_ <= std::max<int64_t>(n_, 1), errors::InvalidArgument("k must be at most n"));
  }
  void Compute(OpKernelContext *ctx) override {
    const Tensor &x = ctx->input(0);
    OP_REQUIRES_OK(ctx, CheckVector(x, n_, "x"));
    Draws d;
    OP_REQUIRES_OK(ctx, GetDraws(ctx, m_, 0, n_, &d));
    Tensor *vals = nullptr, *idx = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({k_}), &vals));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({k_}), &idx));
    mutex_lock l(mu_);
    cand_.resize(k_ + n_ / 64 + 4096);  // the room hvdc_randomk_indices_tf collects in
    keys_.resize(cand_.size());
    hvdc_randomk_indices_tf(d.seed, n_, k_, cand_.data(), keys_.data());
    std::memcpy(idx->flat<int64_t>().data(), cand_.data(), k_ * sizeof(i64));
    const float *xp = x.flat<float>().data();
    WithResidual(ctx, m_, n_, [&](float *r) {
      hvdc_randomk_encode(xp, r, n_, cand_.data(), k_, vals->flat<float>().data());
    });
  }

 private:
  mutex mu_;
  std::vector<uint32_t> keys_;
  std::vector<i64> cand_;
  int m_;
  int64_t n_, k_;
};

class ScatterOp : public OpKernel {
 public:
  explicit ScatterOp(OpKernelConstruction *c) : OpKernel(c) { OP_REQUIRES_OK(c, c->GetAttr("n", &n_)); }
  void Compute(OpKernelContext *ctx) override {
    const Tensor &idx = ctx->input(0), &vals = ctx->input(1);
    OP_REQUIRES(ctx, idx.NumElements() == vals.NumElements(),
                errors::InvalidArgument("idx and vals differ in length: ", idx.NumElements(), " and ", vals.NumElements()));
    const int64_t *ip = idx.flat<int64_t>().data();
    for (int64_t j = 0; j < idx.NumElements(); j++)
      OP_REQUIRES(ctx, ip[j] >= 0 && ip[j] < n_, errors::InvalidArgument("index ", ip[j], " outside [0, ", n_, ")"));
    Tensor *out = nullptr;
    OP_REQUIRES_OK(ctx, kept_out_.Allocate(ctx, 0, n_, &out));
    hvdc_scatter(ip, idx.NumElements(), vals.flat<float>().data(), n_, out->flat<float>().data());
  }

 private:
  KeptOutput kept_out_;
  int64_t n_;
};

REGISTER_KERNEL_BUILDER(Name("HvdcQsgdEncode").Device(DEVICE_CPU), QsgdEncodeOp);
REGISTER_KERNEL_BUILDER(Name("HvdcTernGradEncode").Device(DEVICE_CPU), TernGradEncodeOp);
REGISTER_KERNEL_BUILDER(Name("HvdcTernGradDecodeSum").Device(DEVICE_CPU), TernGradDecodeSumOp);
REGISTER_KERNEL_BUILDER(Name("HvdcRandomKEncode").Device(DEVICE_CPU), RandomKEncodeOp);
REGISTER_KERNEL_BUILDER(Name("HvdcScatter").Device(DEVICE_CPU), ScatterOp);

REGISTER_KERNEL_BUILDER(Name("HvdcSignEncode").Device(DEVICE_CPU), SignEncodeOp);
REGISTER_KERNEL_BUILDER(Name("HvdcSignDecodeSum").Device(DEVICE_CPU), SignDecodeSumOp);
REGISTER_KERNEL_BUILDER(Name("HvdcHalfEncode").Device(DEVICE_CPU), HalfEncodeOp);
REGISTER_KERNEL_BUILDER(Name("HvdcBf16DecodeSum").Device(DEVICE_CPU), Bf16DecodeSumOp);
REGISTER_KERNEL_BUILDER(Name("HvdcMomentum").Device(DEVICE_CPU), MomentumOp);
REGISTER_KERNEL_BUILDER(Name("HvdcInt8Encode").Device(DEVICE_CPU), Int8EncodeOp);
REGISTER_KERNEL_BUILDER(Name("HvdcInt8DecodeSum").Device(DEVICE_CPU), Int8DecodeSumOp);
REGISTER_KERNEL_BUILDER(Name("HvdcTopKEncode").Device(DEVICE_CPU), TopKEncodeOp);
REGISTER_KERNEL_BUILDER(Name("HvdcSparseSum").Device(DEVICE_CPU), SparseSumOp);
REGISTER_KERNEL_BUILDER(Name("HvdcSelectSent").Device(DEVICE_CPU), SelectSentOp);
REGISTER_KERNEL_BUILDER(Name("HvdcSparseSumRaw").Device(DEVICE_CPU), SparseSumRawOp);

}  // namespace
