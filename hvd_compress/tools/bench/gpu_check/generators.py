"""Check family 1b: the stochastic schemes with each side's own random
generators (different seeds): distributions agree within statistical
tolerances, and decode(encode) equals the encoder's ``sent`` on the device."""
from __future__ import annotations

import math
import traceback

import numpy as np

from ....schemes.base import EncodeContext
from .catalogue import f32
from .sides import _wire, tie_free

def _zscore_ok(a_mean, a_var, b_mean, b_var, t, sigmas=5.0, slack=0.0):
    se = math.sqrt(a_var / t + b_var / t)
    return abs(a_mean - b_mean) <= sigmas * se + slack, se

def _quantizer_stats(side, scheme, x_np, trials, seed0):
    """Per-element mean/variance of ``sent`` over ``trials`` draws of the
    backend's own generator, the level histogram, and whether decode(encode)
    equals ``sent`` exactly on the device each time."""
    from ....schemes.bit_coding import unpack_bits
    torch = getattr(side, "torch", None)
    B = side.B
    n = x_np.size
    xt = side.put(x_np)
    s1 = np.zeros(n, np.float64)
    s2 = np.zeros(n, np.float64)
    nbins = 2 * scheme.levels + 1 if scheme.name == "QSGD" else 3
    hist = np.zeros(nbins, np.int64)
    mismatches = 0
    with side.scope():
        for t in range(trials):
            seed = seed0 + t
            ctx = EncodeContext(key="w", step=t, rank=0, size=1, uniform=lambda k: B.uniform(k, seed, like=xt),
                                shared_seed=seed, shape=(n,), state={})
            payload, sent = scheme.encode(B, xt, ctx)
            dec = scheme.decode_one(B, _wire(payload), n)
            if scheme.name == "QSGD":
                lev = payload["q"].to(torch.int64) + scheme.levels
            else:
                lev = unpack_bits(B, payload["t"], 2, n).to(torch.int64)
            hist += torch.bincount(lev, minlength=nbins).cpu().numpy()
            # by value: the encoder's sent may hold -0.0 where the decoder makes +0.0
            mismatches += int(torch.count_nonzero(dec != sent))
            s = sent.double().cpu().numpy()
            s1 += s
            s2 += s * s
    mean = s1 / trials
    var = np.maximum(s2 / trials - mean * mean, 0.0) * trials / (trials - 1)
    return mean, var, hist / hist.sum(), mismatches

def check_quantizer_distribution(ref_side, dut_side, scheme, n, trials):
    """QSGD/TernGrad with each side's own generator: unbiased on both sides,
    per-element means agree (mean squared difference of the means vs its
    expectation), equal total variance, level histograms within a 3-sigma
    per-bin bound."""
    x = tie_free(n, 7)
    mr, vr, hr, bad_r = _quantizer_stats(ref_side, scheme, x, trials, 0)
    md, vd, hd, bad_d = _quantizer_stats(dut_side, scheme, x, trials, 10_000)
    checks = {}
    for name, m, v in (("ref", mr, vr), ("dut", md, vd)):
        z = float(np.sum(m - x) / math.sqrt(max(np.sum(v) / trials, 1e-30)))
        checks[f"unbiased[{name}] |z|<=5"] = (abs(z) <= 5.0, f"z={z:.2f}")
    d = float(np.sum((mr - md) ** 2))
    e = float(np.sum((vr + vd) / trials))
    checks["means agree: msd/expected in [0.7,1.4]"] = (0.7 <= d / max(e, 1e-30) <= 1.4, f"{d / max(e, 1e-30):.3f}")
    vrat = float(np.sum(vd) / max(np.sum(vr), 1e-30))
    checks["total variance ratio in [0.85,1.18]"] = (0.85 <= vrat <= 1.18, f"{vrat:.3f}")
    samples = n * trials
    bound = 0.5 * float(np.sum(3.0 * np.sqrt(2.0 * hr * (1 - hr) / samples))) + 1e-3
    tv = 0.5 * float(np.sum(np.abs(hr - hd)))
    checks["level histogram TV distance"] = (tv <= bound, f"{tv:.4f} (bound {bound:.4f})")
    checks["decode(encode) == sent (by value)"] = (bad_r == 0 and bad_d == 0, f"{bad_r} / {bad_d} mismatches")
    return checks

def check_randomk_distribution(ref_side, dut_side, scheme, n, trials):
    """Random-K with each side's own generator: k distinct sorted indices in
    range, the values are x at them, the same seed gives the same indices (so
    ranks agree), selection counts per element are Binomial(trials, k/n) on
    both sides."""
    torch = ref_side.torch
    x = tie_free(n, 11)
    k = max(1, min(n, int(math.ceil(scheme.ratio * n))))
    p = k / n
    checks = {}
    for name, side, seed0 in (("ref", ref_side, 0), ("dut", dut_side, 10_000)):
        B = side.B
        xt = side.put(x)
        counts = torch.zeros(n, dtype=torch.int64, device=xt.device)
        problems = []
        with side.scope():
            for t in range(trials):
                ctx = EncodeContext(key="w", step=t, rank=0, size=1, uniform=None, shared_seed=seed0 + t,
                                    shape=(n,), state={})
                payload, sent = scheme.encode(B, xt, ctx)
                idx = payload["_idx"]
                if idx.numel() != k:
                    problems.append(f"trial {t}: {idx.numel()} indices, expected {k}")
                    continue
                if k > 1 and not bool((idx[1:] > idx[:-1]).all()):
                    problems.append(f"trial {t}: indices not strictly increasing (duplicates?)")
                if int(idx.min()) < 0 or int(idx.max()) >= n:
                    problems.append(f"trial {t}: index out of range")
                if not torch.equal(payload["reduce"], xt[idx]):
                    problems.append(f"trial {t}: values are not x[idx]")
                dec = scheme.decode_reduced(B, payload["reduce"], n, {"_idx": idx})
                if not torch.equal(dec, sent):
                    problems.append(f"trial {t}: decode != sent")
                if t == 0:
                    again, _ = scheme.encode(B, xt, ctx)
                    if not torch.equal(again["_idx"], idx):
                        problems.append("the same seed drew different indices: ranks would disagree")
                counts[idx] += 1
        checks[f"indices/values/decode[{name}]"] = (not problems, "; ".join(problems[:3]) or "all trials")
        c = counts.double().cpu().numpy()
        checks[f"mean count[{name}] == trials*k/n"] = (abs(c.mean() - trials * p) <= 1e-9 * trials + 1e-9,
                                                         f"{c.mean():.4f} vs {trials * p:.4f}")
        vr = float(c.var(ddof=1) / (trials * p * (1 - p))) if p < 1 else 1.0
        checks[f"count variance / binomial[{name}] in [0.8,1.25]"] = (0.8 <= vr <= 1.25 or p == 1, f"{vr:.3f}")
    return checks

def check_dgc_distribution(ref_side, dut_side, scheme, n, trials):
    """DGC with each side's own generator (the sampling offset): the kept set
    is exactly {|x| >= its smallest kept magnitude}, values are x there, and
    the kept count has the same mean on both sides (5-sigma two-sample test)."""
    torch = ref_side.torch
    x = tie_free(n, 13)
    stats, checks = {}, {}
    for name, side, seed0 in (("ref", ref_side, 0), ("dut", dut_side, 10_000)):
        B = side.B
        xt = side.put(x)
        kept, problems = [], []
        with side.scope():
            for t in range(trials):
                seed = seed0 + t
                ctx = EncodeContext(key="w", step=t, rank=0, size=1,
                                    uniform=lambda m: B.uniform(m, seed, like=xt), shared_seed=seed,
                                    shape=(n,), state={})
                payload, sent = scheme.encode(B, xt, ctx)
                idx = payload["idx"].to(torch.int64)
                a = xt.abs()
                thr = a[idx].min()
                if int(torch.count_nonzero(a >= thr)) != idx.numel():
                    problems.append(f"trial {t}: kept set is not a magnitude threshold set")
                if not torch.equal(payload["val"], xt[idx]):
                    problems.append(f"trial {t}: values are not x[idx]")
                if not torch.equal(scheme.decode_one(B, _wire(payload), n), sent):
                    problems.append(f"trial {t}: decode != sent")
                kept.append(idx.numel())
        k = np.asarray(kept, np.float64)
        stats[name] = (k.mean(), k.var(ddof=1))
        checks[f"threshold set/values/decode[{name}]"] = (not problems, "; ".join(problems[:3]) or "all trials")
        nominal = scheme.ratio * n
        checks[f"mean kept / (ratio*n)[{name}] in [0.25,4]"] = (0.25 <= k.mean() / nominal <= 4,
                                                                 f"{k.mean() / nominal:.3f}")
    (ma, va), (mb, vb) = stats["ref"], stats["dut"]
    ok, se = _zscore_ok(ma, va, mb, vb, trials, slack=1.0)
    checks["mean kept count agrees (5 sigma)"] = (ok, f"{ma:.1f} vs {mb:.1f} (se {se:.2f})")
    return checks

def check_uniform(side, n=1 << 20):
    """``B.uniform``: U[0,1) by mean, variance and a 16-bin histogram (5 sigma),
    reproducible by seed, different across seeds."""
    torch = side.torch
    B = side.B
    like = side.put(np.zeros(1, f32))
    with side.scope():
        u = B.uniform(n, 12345, like=like)
        u2 = B.uniform(n, 12345, like=like)
        u3 = B.uniform(n, 12346, like=like)
        a = u.double().cpu().numpy()
        same, differ = bool(torch.equal(u, u2)), not bool(torch.equal(u, u3))
    hist = np.bincount(np.minimum((a * 16).astype(np.int64), 15), minlength=16)
    exp = n / 16
    hist_ok = bool(np.all(np.abs(hist - exp) <= 5 * math.sqrt(exp * 15 / 16)))
    return {
        "in [0,1)": (bool(a.min() >= 0 and a.max() < 1), f"min {a.min():.3g} max {a.max():.6f}"),
        "mean 1/2 (5 sigma)": (abs(a.mean() - 0.5) <= 5 * math.sqrt(1 / 12 / n), f"{a.mean():.5f}"),
        "variance 1/12 (5 sigma)": (abs(a.var() - 1 / 12) <= 5 * math.sqrt(1 / 180 / n), f"{a.var():.5f}"),
        "16-bin histogram (5 sigma a bin)": (hist_ok, f"min {hist.min()} max {hist.max()} expected {exp:.0f}"),
        "same seed -> same draws": (same, ""),
        "other seed -> other draws": (differ, ""),
    }

def check_own_generators(ref_side, dut_side, n, trials, log=print):
    """Part 1b."""
    from .... import schemes as S
    out = []

    def record(name, checks, extra=None):
        ok = all(v[0] for v in checks.values())
        out.append({"case": name, "status": "ok" if ok else "FAILED", **(extra or {}),
                    "checks": {k: {"ok": bool(v[0]), "value": v[1]} for k, v in checks.items()}})
        bad = [f"{k}: {v[1]}" for k, v in checks.items() if not v[0]]
        log(f"  {name:<16} {'ok' if ok else 'FAILED':<6} {len(checks)} checks"
            + ("" if ok else "".join("\n      " + b for b in bad)))

    jobs = [("uniform", lambda: check_uniform(dut_side), {}),
            ("qsgd127", lambda: check_quantizer_distribution(ref_side, dut_side, S.QSGD(), n, trials), {}),
            ("qsgd4", lambda: check_quantizer_distribution(ref_side, dut_side, S.QSGD(4), n, trials), {}),
            ("terngrad", lambda: check_quantizer_distribution(ref_side, dut_side, S.TernGrad(), n, trials), {}),
            ("randomk", lambda: check_randomk_distribution(ref_side, dut_side, S.RandomK(0.01), n, trials), {}),
            ("randomk-20%", lambda: check_randomk_distribution(ref_side, dut_side, S.RandomK(0.2), n, trials), {}),
            ("dgc", lambda: check_dgc_distribution(ref_side, dut_side, S.DGC(0.01), 16 * n, trials), {})]
    for name, job, extra in jobs:
        try:
            record(name, job(), {"trials": trials, **extra})
        except Exception as e:
            out.append({"case": name, "status": "FAILED", "detail": f"{type(e).__name__}: {e}",
                        "traceback": traceback.format_exc()[-2000:]})
            log(f"  {name:<16} FAILED: {type(e).__name__}: {e}")
    return out
