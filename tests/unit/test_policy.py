"""Unit tests of :mod:`hvd_compress.policy`: Rule matching (glob, ``re:``,
element count, rank), Policy (first match wins, default), Schedule (phase
table, ``dgc_warmup`` ramp), their validation errors (a ValueError naming the
parameter) and ``Policy.describe()``.  Single process, no Horovod; the
horovodrun tests (tests/horovod/test_training_*.py) check the same objects
through the stock optimizers.
"""
import re
import signal

import numpy as np
import pytest

import hvd_compress as hc
from hvd_compress import Policy, Rule, Schedule


def scheme_of(comp, key="x", numel=10, shape=(10,)):
    """Name of the scheme of each phase ``comp`` plans for a tensor."""
    return [(p[0], p[1].name) for p in comp.plan_for(key, numel, shape)]


# --- Rule ----------------------------------------------------------------------------------
@pytest.mark.parametrize("pattern, key, hit", [
    ("*bias", "fc1.bias", True),
    ("*bias", "fc1.bias_scale", False),       # a glob must match the whole name
    ("*bias", "fc1.Bias", False),             # and is case-sensitive
    ("fc?.weight", "fc1.weight", True),
    ("fc?.weight", "fc12.weight", False),
    ("*norm*", "encoder.layernorm.weight", True),
    ("*/bias:0", "dense/bias:0", True),       # TF names carry the ':0' suffix
    ("*/bias", "dense/bias:0", False),
    ("[ab].w", "a.w", True),
    ("re:attn", "layers.0.attn.qkv.weight", True),   # a regex may match anywhere (re.search)
    ("re:^attn", "layers.0.attn.qkv.weight", False),
    ("re:\\.(q|k|v)_proj\\.", "h.3.k_proj.weight", True),
    ("re:bias$", "fc1.bias", True),
    ("re:bias$", "fc1.bias_scale", False),
])
def test_rule_name_patterns(pattern, key, hit):
    assert Rule(hc.none(), name=pattern).matches(key, 4, (4,)) is hit


def test_rule_name_list_matches_any():
    r = Rule(hc.none(), name=["*bias", "re:norm", "embed.weight"])
    assert r.matches("fc.bias", 1, (1,))
    assert r.matches("ln_norm.weight", 1, (1,))
    assert r.matches("embed.weight", 1, (1,))
    assert not r.matches("fc.weight", 1, (1,))
    assert r.name == ["*bias", "re:norm", "embed.weight"]


def test_rule_without_name_ignores_the_name():
    r = Rule(hc.none(), min_numel=10)
    assert r.matches("anything", 10, (10,))
    assert r.matches("anon:10#0", 10, (10,))
    assert not r.matches("anything", 9, (9,))


@pytest.mark.parametrize("kw, numel, shape, hit", [
    (dict(min_numel=100), 100, (10, 10), True),    # bounds are inclusive
    (dict(min_numel=100), 99, (99,), False),
    (dict(max_numel=100), 100, (100,), True),
    (dict(max_numel=100), 101, (101,), False),
    (dict(min_numel=0, max_numel=0), 0, (0,), True),
    (dict(min_ndim=2), 6, (2, 3), True),
    (dict(min_ndim=2), 6, (6,), False),
    (dict(max_ndim=1), 6, (6,), True),
    (dict(max_ndim=1), 1, (), True),               # a scalar has 0 dimensions
    (dict(max_ndim=1), 6, (2, 3), False),
    (dict(min_ndim=4), 81, (3, 3, 3, 3), True),
])
def test_rule_size_and_rank(kw, numel, shape, hit):
    assert Rule(hc.none(), **kw).matches("w", numel, shape) is hit


def test_rule_all_conditions_must_hold():
    r = Rule(hc.TopK(0.1), name="*weight", min_numel=1000, max_ndim=2)
    assert r.matches("fc.weight", 1000, (10, 100))
    assert not r.matches("fc.bias", 1000, (1000,))           # name fails
    assert not r.matches("fc.weight", 999, (9, 111))         # size fails
    assert not r.matches("conv.weight", 1000, (10, 10, 10))  # rank fails


@pytest.mark.parametrize("kw, param", [
    (dict(compression=hc.TopK(0.1).scheme), "compression"),    # a scheme, not a compression object
    (dict(compression="topk"), "compression"),
    (dict(compression=None), "compression"),
    (dict(compression=hc.none(), name=["*bias", None]), "name"),
    (dict(compression=hc.none(), min_numel=-1), "min_numel"),
    (dict(compression=hc.none(), min_numel=1.5), "min_numel"),
    (dict(compression=hc.none(), max_numel=True), "max_numel"),
    (dict(compression=hc.none(), max_numel="10"), "max_numel"),
    (dict(compression=hc.none(), min_ndim=-2), "min_ndim"),
    (dict(compression=hc.none(), max_ndim=2.0), "max_ndim"),
])
def test_rule_validation_names_the_parameter(kw, param):
    with pytest.raises(ValueError, match=param):
        Rule(**kw)


def test_rule_name_of_wrong_type_is_a_value_error():
    with pytest.raises(ValueError, match="name"):
        Rule(hc.none(), name=3)


def test_rule_bad_regex_is_an_error_at_construction():
    with pytest.raises(re.error):
        Rule(hc.none(), name="re:(unclosed")


def test_rule_config_and_repr():
    r = Rule(hc.FP16(), name="*embed*", max_ndim=2)
    cfg = r.config()
    assert cfg["name"] == ["*embed*"] and cfg["max_ndim"] == 2 and cfg["min_numel"] is None
    assert cfg["compression"]["scheme"] == "FP16"
    assert "FP16" in repr(r) and "*embed*" in repr(r) and "min_numel" not in repr(r)


# --- Policy --------------------------------------------------------------------------------
def make_policy():
    return Policy([
        Rule(hc.none(), name=["*bias", "*norm*"]),
        Rule(hc.FP16(), name="re:^embed\\."),
        Rule(hc.TopK(0.01), min_numel=1000, min_ndim=2),
        Rule(hc.none(), max_numel=100),
    ], default=hc.Int8())


@pytest.mark.parametrize("key, shape, rule, scheme", [
    ("fc1.bias", (4096,), 0, "NoCompression"),          # the name rule wins over the size rule
    ("ln.norm.weight", (4096,), 0, "NoCompression"),
    ("embed.weight", (30000, 64), 1, "FP16"),          # first match: before the TopK size rule
    ("fc1.weight", (64, 64), 2, "TopK"),
    ("fc1.weight", (10, 10), 3, "NoCompression"),
    ("fc1.weight", (10, 11), None, "Int8"),             # no rule: the default
    ("vec", (4096,), None, "Int8"),                     # min_ndim=2 keeps 1-D tensors out of rule 2
    ("anon:64x64#0", (64, 64), 2, "TopK"),              # a fallback key: only size/rank rules can match
    ("allreduce.noname.0.1", (4096,), None, "Int8"),    # Horovod's unnamed parameters: no '*bias' match
])
def test_policy_first_matching_rule_decides(key, shape, rule, scheme):
    pol = make_policy()
    numel = int(np.prod(shape))
    got = pol.rule_for(key, numel, shape)
    assert (None if got is None else pol.rules.index(got)) == rule
    assert scheme_of(pol, key, numel, shape) == [(0, scheme)]


def test_policy_default_is_dense():
    pol = Policy([Rule(hc.TopK(0.1), name="big")])
    assert scheme_of(pol, "other") == [(0, "NoCompression")]
    assert pol.default.error_feedback is False


def test_policy_plans_a_schedule_per_rule():
    sched = Schedule([(0, hc.none()), (5, hc.TopK(0.25))])
    pol = Policy([Rule(sched, min_ndim=2)], default=hc.FP16())
    assert scheme_of(pol, "w", 100, (10, 10)) == [(0, "NoCompression"), (5, "TopK")]
    assert scheme_of(pol, "b", 10, (10,)) == [(0, "FP16")]


def test_policy_keeps_each_rules_error_feedback_and_memory():
    dgc = hc.DGC(0.01, momentum=0.9)
    pol = Policy([Rule(dgc, min_ndim=2), Rule(hc.TopK(0.1, error_feedback=False), max_ndim=1)])
    (phase,) = pol.plan_for("w", 100, (10, 10))
    assert isinstance(phase[2], hc.DGCMemory) and phase[2].momentum == 0.9  # (start, scheme, memory, ...)
    (phase,) = pol.plan_for("b", 10, (10,))
    assert phase[2] is None


@pytest.mark.parametrize("kw, param", [
    (dict(rules=[hc.none()]), "rules"),
    (dict(rules=[("*bias", hc.none())]), "rules"),
    (dict(rules=[], default=hc.TopK(0.1).scheme), "default"),
    (dict(rules=[], default="none"), "default"),
])
def test_policy_validation_names_the_parameter(kw, param):
    with pytest.raises(ValueError, match=param):
        Policy(**kw)


def test_policy_config_changes_with_rules():
    a, b = make_policy(), make_policy()
    assert a.config() == b.config() and a.fingerprint() == b.fingerprint()
    c = Policy(make_policy().rules[:-1], default=hc.Int8())
    assert c.fingerprint() != a.fingerprint()
    d = Policy(make_policy().rules, default=hc.Int8(block_size=64))
    assert d.fingerprint() != a.fingerprint()


# --- Schedule -----------------------------------------------------------------------------------
def test_schedule_phases_and_final_scheme():
    s = Schedule([(0, hc.none()), (3, hc.TopK(0.25)), (6, hc.TopK(0.01))])
    assert scheme_of(s) == [(0, "NoCompression"), (3, "TopK"), (6, "TopK")]
    ratios = [c.scheme.ratio for _, c in s.phases[1:]]
    assert ratios == [0.25, 0.01]
    assert s.scheme is s.phases[-1][1].scheme and s.error_feedback is True


@pytest.mark.parametrize("phases", [
    [],
    [(1, hc.none())],                                    # must start at step 0
    [(0, hc.none()), (5, hc.TopK(0.1)), (5, hc.TopK(0.01))],   # distinct
    [(0, hc.none()), (5, hc.TopK(0.1)), (3, hc.TopK(0.01))],   # increasing
    [(0, hc.none()), (-1, hc.TopK(0.1))],
    [(0, hc.none()), (2.5, hc.TopK(0.1))],
])
def test_schedule_start_step_validation(phases):
    with pytest.raises(ValueError, match="phase"):
        Schedule(phases)


def test_schedule_phase_compression_validation():
    with pytest.raises(ValueError, match="phase's compression"):
        Schedule([(0, hc.none()), (3, hc.TopK(0.1).scheme)])


def test_dgc_warmup_is_the_papers_exponential_ramp():
    """Lin et al. 2018: 25%, 6.25%, 1.5625%, 0.4%, 0.1%, each held for a stage, after a dense warmup."""
    s = Schedule.dgc_warmup(warmup_steps=200, steps_per_stage=500, final_ratio=0.001)
    starts = [st for st, _ in s.phases]
    assert starts == [0, 200, 700, 1200, 1700, 2200]
    assert s.phases[0][1].scheme.name == "NoCompression"
    ratios = [c.scheme.ratio for _, c in s.phases[1:]]
    np.testing.assert_allclose(ratios, [0.25, 0.0625, 0.015625, 0.00390625, 0.001])
    assert all(c.scheme.name == "TopK" and c.error_feedback for _, c in s.phases[1:])


def test_dgc_warmup_without_warmup_and_custom_factor():
    s = Schedule.dgc_warmup(warmup_steps=0, steps_per_stage=10, final_ratio=0.01, start_ratio=0.25, factor=5.0)
    assert [st for st, _ in s.phases] == [0, 10, 20]
    np.testing.assert_allclose([c.scheme.ratio for _, c in s.phases], [0.25, 0.05, 0.01])


def test_dgc_warmup_values_quantizer_reaches_every_stage():
    s = Schedule.dgc_warmup(warmup_steps=1, steps_per_stage=1, final_ratio=0.0625, values=hc.Int8())
    assert all(c.scheme.values is not None for _, c in s.phases[1:])


def _with_alarm(seconds, fn):
    def boom(*_):
        raise TimeoutError(f"did not return within {seconds} s")
    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(seconds)
    try:
        return fn()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("factor", [1.0, 0.5])
def test_dgc_warmup_factor_validated(factor):
    with pytest.raises(ValueError, match="factor"):
        _with_alarm(3, lambda: Schedule.dgc_warmup(warmup_steps=10, steps_per_stage=10, factor=factor))


@pytest.mark.parametrize("kw, param", [
    (dict(warmup_steps=-1, steps_per_stage=10), "warmup_steps"),
    (dict(warmup_steps=10, steps_per_stage=0), "steps_per_stage"),
])
def test_dgc_warmup_validation_names_the_parameter(kw, param):
    with pytest.raises(ValueError, match=param):
        Schedule.dgc_warmup(**kw)


def test_schedule_config_and_fingerprint():
    a = Schedule([(0, hc.none()), (3, hc.TopK(0.25))])
    b = Schedule([(0, hc.none()), (4, hc.TopK(0.25))])
    assert a.config()["schedule"][1][0] == 3
    assert a.fingerprint() != b.fingerprint()
    assert "3:" in repr(a) and "TopK" in repr(a)


# --- describe() -------------------------------------------------------------------------------------
def _rows(text):
    """(header cells, [row cells], total line); cells are separated by 2+ spaces."""
    lines = text.splitlines()
    split = lambda line: re.split(r"\s{2,}", line.strip())  # noqa: E731
    return split(lines[0]), [split(x) for x in lines[1:-1]], lines[-1]


def test_describe_a_row_per_parameter_with_rule_and_bytes():
    pol = make_policy()
    named = [("embed.weight", (1000, 16)), ("fc1.weight", (64, 64)), ("fc1.bias", (64,)),
             ("small.weight", (10, 10)), ("odd.weight", (10, 11))]
    header, rows, total = _rows(pol.describe(named))
    assert header == ["parameter", "shape", "elements", "rule", "bytes/step", "compression"]
    assert len(rows) == len(named)
    want = {  # rule label, bytes: FP16 2/element and dense 4/element by allreduce; allgather schemes (TopK,
        # Int8) their scheme's payload formula + the 4-byte placeholder handed to Horovod's allreduce
        "embed.weight": ("rule 1", 2 * 16000),
        "fc1.weight": ("rule 2", hc.TopK(0.01).scheme.payload_nbytes(4096) + 4),
        "fc1.bias": ("rule 0", 4 * 64),
        "small.weight": ("rule 3", 4 * 100),
        "odd.weight": ("default", hc.Int8().scheme.payload_nbytes(110) + 4),
    }
    for (name, shape), cells in zip(named, rows):
        label, nbytes = want[name]
        assert cells[0] == name and cells[1] == "x".join(map(str, shape)) and int(cells[2]) == int(np.prod(shape))
        assert cells[3] == label, cells
        assert int(cells[4]) == nbytes, cells
        assert cells[5] == repr(pol.rules[int(label[5:])].compression if label != "default" else pol.default)
    dense = 4 * sum(int(np.prod(s)) for _, s in named)
    payload = sum(b for _, b in want.values())
    assert f"total dense fp32 {dense} bytes, compressed {payload} bytes" in total
    assert f"ratio {dense / payload:.1f}x" in total


def test_describe_torch_named_parameters():
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential()
    model.add_module("embed", torch.nn.Embedding(100, 16))
    model.add_module("fc1", torch.nn.Linear(16, 128))
    header, rows, _ = _rows(make_policy().describe(model.named_parameters()))
    assert [r[0] for r in rows] == ["embed.weight", "fc1.weight", "fc1.bias"]
    assert [r[3] for r in rows] == ["rule 1", "rule 2", "rule 0"]


def test_describe_schedule_shows_final_phase_and_variable_size():
    pol = Policy([Rule(Schedule.dgc_warmup(10, 10, final_ratio=0.01), min_ndim=2),
                  Rule(hc.DGC(0.01), name="var")], default=hc.none())
    _, rows, total = _rows(pol.describe([("w", (64, 64)), ("var", (4096,))]))
    assert int(rows[0][4]) == hc.TopK(0.01).scheme.payload_nbytes(4096) + 4  # the final ratio
    assert rows[1][4] == "variable"  # DGC's kept count depends on the data
    assert "variable-size tensors not counted" in total


def test_describe_unmatched_schemes_from_a_plain_compressor_rule():
    pol = Policy([Rule(hc.PowerSGD(rank=2), min_ndim=2)])
    _, rows, _ = _rows(pol.describe([("w", (64, 32)), ("b", (64,))]))
    assert int(rows[0][4]) == 4 * (64 + 32) * 2 + 4
    assert int(rows[1][4]) == 4 * 64
    assert rows[1][3] == "default"


def _plan(comp, numel):
    return [(start, type(scheme).__name__, memory) for start, scheme, memory, _ in comp.plan_for("t", numel, (numel,))]


@pytest.mark.parametrize("make", [lambda: hc.TopK(0.01, momentum=0.9), lambda: hc.OneBit(momentum=0.9, nesterov=True),
                                  lambda: hc.DGC(0.001, momentum=0.9)])
def test_recipe_dense_parts_carry_the_schemes_momentum(make):
    comp = make()
    pol = hc.recipe(comp, dense_below=100, warmup_steps=7)
    small, big = _plan(pol, 100), _plan(pol, 101)
    assert [(s, n) for s, n, _ in small] == [(0, "NoCompression")]
    assert [(s, n) for s, n, _ in big] == [(0, "NoCompression"), (7, type(comp.scheme).__name__)]
    for _, _, memory in small + big[:1]:
        assert isinstance(memory, hc.MomentumMemory) and not memory.error_feedback
        assert memory.momentum == 0.9 and memory.nesterov == getattr(comp.memory, "nesterov", False)
    assert big[1][2] is comp.memory


def test_recipe_without_momentum_and_its_parts_alone():
    assert _plan(hc.recipe(hc.Int8(), dense_below=10), 10) == [(0, "NoCompression", None)]
    assert [(s, n) for s, n, _ in _plan(hc.recipe(hc.Int8(), dense_below=10), 11)] == [(0, "Int8")]
    assert [(s, n) for s, n, _ in _plan(hc.recipe(hc.Int8(), dense_below=0, warmup_steps=3), 5)] == [
        (0, "NoCompression"), (3, "Int8")]


def test_recipe_sends_named_tensors_dense_with_the_schemes_momentum():
    pol = hc.recipe(hc.TopK(0.01, momentum=0.9), dense_below=100, warmup_steps=5, dense_names=["*embed*", "re:^pos$"])
    for name in ("embed.weight", "pos"):
        (start, scheme, memory, _), = pol.plan_for(name, 1792, (28, 64))
        assert (start, type(scheme).__name__) == (0, "NoCompression") and memory.momentum == 0.9
    assert [type(s).__name__ for _, s, _, _ in pol.plan_for("position", 1792, (28, 64))] == ["NoCompression", "TopK"]
    lines = pol.describe([("embed.weight", (28, 64)), ("head.weight", (10, 64))]).splitlines()
    assert "rule 1" in lines[1] and "default" in lines[2]  # what a user checks their names with
    assert hc.recipe(hc.TopK(0.01), dense_names="*embed*").rules[-1].name == ["*embed*"]


def test_ramp_ratios_are_dgcs_exponential_ramp_down_to_the_schemes_ratio():
    from hvd_compress.policy import ramp_ratios
    assert ramp_ratios(0.01) == [0.25, 0.0625, 0.015625, 0.01]
    assert ramp_ratios(0.001) == [0.25, 0.0625, 0.015625, 0.00390625, 0.001]
    assert ramp_ratios(0.0625) == [0.25, 0.0625]  # a power of the factor is not repeated
    assert ramp_ratios(0.5) == [0.5]  # above the start: no ramp


@pytest.mark.parametrize("make", [lambda: hc.TopK(0.01, momentum=0.9), lambda: hc.DGC(0.001, momentum=0.9),
                                  lambda: hc.RandomK(0.01), lambda: hc.TopK(0.01, values=hc.Int8())])
def test_recipe_ramps_the_ratio_after_the_dense_warmup(make):
    comp = make()
    pol = hc.recipe(comp, dense_below=100, warmup_steps=7, ramp_steps=3)
    phases = pol.plan_for("w", 1000, (1000,))
    ratio = comp.scheme.ratio
    want = [0.25, 0.0625, 0.015625] + ([0.00390625] if ratio < 0.0039 else []) + [ratio]
    assert [p.start for p in phases] == [0] + [7 + 3 * i for i in range(len(want))]
    assert type(phases[0].scheme).__name__ == "NoCompression"
    assert [p.scheme.ratio for p in phases[1:]] == want
    assert all(type(p.scheme) is type(comp.scheme) for p in phases[1:])
    # one residual and one velocity per tensor through the whole ramp: the very memory object
    assert all(p.memory is comp.memory for p in phases[1:]) and phases[-1].scheme is comp.scheme
    # the copies keep the scheme's other settings, and the given compressor is left as it was
    assert [p.scheme.config() | {"ratio": 0} for p in phases[1:]] == [comp.scheme.config() | {"ratio": 0}] * len(want)
    assert comp.scheme.ratio == ratio
    # small tensors stay dense throughout
    assert [type(p.scheme).__name__ for p in pol.plan_for("b", 100, (100,))] == ["NoCompression"]


def test_recipe_ramp_without_a_dense_warmup_starts_at_a_quarter():
    phases = hc.recipe(hc.TopK(0.01), dense_below=0, ramp_steps=5).plan_for("w", 1000, (1000,))
    assert [(p.start, p.scheme.ratio) for p in phases] == [(0, 0.25), (5, 0.0625), (10, 0.015625), (15, 0.01)]


@pytest.mark.parametrize("make", [hc.Int8, hc.EFSignSGD, lambda: hc.PowerSGD(rank=2), hc.FP16])
def test_recipe_ramp_needs_a_scheme_with_a_ratio(make):
    with pytest.raises(ValueError, match="ramp_steps .*TopK, DGC or RandomK"):
        hc.recipe(make(), ramp_steps=10)
    hc.recipe(make(), ramp_steps=0)  # no ramp asked: any scheme


@pytest.mark.parametrize("kw, param", [({"dense_below": -1}, "dense_below"), ({"warmup_steps": 1.5}, "warmup_steps"),
                                       ({"ramp_steps": -1}, "ramp_steps"), ({"ramp_steps": 2.5}, "ramp_steps"),
                                       ({"dense_names": 3}, "dense_names"), ({"dense_names": []}, "dense_names"),
                                       ({"dense_names": ["*embed*", ""]}, "dense_names")])
def test_recipe_validation_names_the_parameter(kw, param):
    with pytest.raises(ValueError, match=param):
        hc.recipe(hc.TopK(0.01), **kw)


@pytest.mark.parametrize("make", [lambda: hc.Policy([], default=hc.TopK(0.1)), lambda: hc.Schedule([(0, hc.none())]),
                                  lambda: hc.Auto(), lambda: "topk"])
def test_recipe_takes_one_schemes_compression_object(make):
    with pytest.raises(ValueError, match="one scheme's compression object"):
        hc.recipe(make())
