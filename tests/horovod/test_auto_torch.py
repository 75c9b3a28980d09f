"""hvd_compress.Auto under real horovodrun (PyTorch; scripts/run_tests.sh
runs it with Gloo).

Training goes through the stock ``hvd.DistributedOptimizer``.  Every rank
runs every test in the same order and issues the same collectives before it
asserts anything.  Where a test needs a given link, the link probe
(``hvd_compress.auto.calibration.probe_link``) is replaced by timings computed from the
cost model, identically on every rank, and the codec costs are fixed
(``Auto(codec_costs=auto_links.CODEC_COSTS)``), so no decision a test checks
depends on how fast this machine runs; the first test alone measures
everything for real and checks only that the ranks agree.  The agreement
collectives and the training collectives are the real ones.
"""
import json

import pytest
import torch

import horovod.torch as hvd
import hvd_compress
from hvd_compress.auto import calibration as auto_calibration
from hvd_compress.auto import Link, PlanMismatchError
from hvd_compress.cross_rank import stable_hash

import auto_links
from auto_links import CODEC_COSTS
from torch_params import Params

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
SPECS = {"net.weight": (64, 512), "net.bias": (8,)}  # the bias: latency-bound at any rate here
FAST = Link(latency_s=1e-6, bytes_per_s=1e12)
SLOW = Link(latency_s=1e-4, bytes_per_s=1e6)  # 8 Mbit/s: compressing the 128 KB weight pays


def grads_at(step):
    """This rank's gradient of each parameter at a step (different per rank and step)."""
    gen = torch.Generator().manual_seed(1000 * step + RANK)
    return {name: torch.randn(shape, generator=gen) for name, shape in SPECS.items()}


def build(auto):
    model = Params(SPECS)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters(), compression=auto, op=hvd.Sum)
    return model, opt


def train_step(model, opt, step):
    """One step whose gradient is exactly grads_at(step): loss = sum(p * g)."""
    opt.zero_grad()
    g = grads_at(step)
    loss = sum((p * g[name]).sum() for name, p in model.named_parameters())
    loss.backward()
    opt.step()


def links(sequence, monkeypatch):
    """Make the i-th link probe report the i-th link of ``sequence`` (the last one after)."""
    return auto_links.links(sequence, monkeypatch, auto_calibration, SIZE)


def same_on_all_ranks(obj, name):
    h = stable_hash(json.dumps(obj, sort_keys=True, default=str))
    hashes = hvd.allgather(torch.tensor([h], dtype=torch.int64), name=name).tolist()
    return all(x == hashes[0] for x in hashes)


def test_plans_are_identical_on_all_ranks_and_applied():
    """Real measurements (link probes included): ranks measure different
    numbers, yet apply one plan, the one rank 0 chose from the averages."""
    auto = hvd_compress.Auto(calibration_steps=2, recheck_every=0, probe_numels=(256, 1 << 16))
    model, opt = build(auto)
    for step in range(1, 5):
        train_step(model, opt, step)
    plan = auto.current_plan()
    assert same_on_all_ranks(plan, "test.auto.plan_same")
    assert same_on_all_ranks([p.detach().sum().item() for p in model.parameters()], "test.auto.params_same")
    assert sorted(plan) == sorted(SPECS) and len(auto.plan_state.history) == 1
    applied = {k: v["scheme"] for k, v in auto.stats.per_tensor().items()}
    by_label = {c.label: c.scheme.name for c in auto.candidates}
    assert applied == {k: by_label[label] for k, label in plan.items()}
    table = auto.describe()
    assert "net.weight" in table and "64x512" in table and plan["net.weight"] in table


def test_trial_plans_run_alike_and_end_in_one_plan_on_every_rank(monkeypatch):
    """On the slow link Top-K 1% and PowerSGD are predicted within 8 ms of each
    other for the weight, and the calibration steps last at least 100 ms (so
    a tenth of a step holds both): two or three plans run two steps each on
    every rank (and the dense plan, where the calibration ran dense, is timed
    on the steps before), timed for real, and every rank adopts the one rank 0
    picked from the medians averaged over ranks.  The backward span is fixed at 0
    as the link is (under load it stretched past the link's time and hid it)."""
    import time
    links([SLOW], monkeypatch)
    auto = hvd_compress.Auto(codec_costs=CODEC_COSTS, calibration_steps=1, recheck_every=0, trial_steps=2)
    monkeypatch.setattr(auto, "_stretch_span", lambda first_key: None)
    model, opt = build(auto)
    for step in range(1, 10):
        time.sleep(0.1)
        train_step(model, opt, step)
    state = auto.plan_state
    trials = [t["labels"] for t in state.trials]
    ran = [t["labels"] for t in state.trials if not t.get("before")]  # the dense one: timed before the plan
    assert 2 <= len(trials) <= 4 and 1 <= len(ran) <= 3 and state.trial_pick is not None, auto.describe()
    picked = trials[state.trial_pick]
    final = [] if picked == ran[-1] else [(1 + 2 * len(ran), picked)]  # the last trial's plan stays
    assert [(start, {k: c.label for k, c in choices.items()}) for start, choices, _ in state.history] == (
        [(1 + 2 * i, labels) for i, labels in enumerate(ran)] + final)
    assert all(t["step_s"] is not None for t in state.trials), auto.describe()
    assert same_on_all_ranks([trials, state.trial_pick, [t["step_s"] for t in state.trials]], "test.auto.trials_same")
    by_label = {c.label: c.scheme.name for c in auto.candidates}
    applied = {k: v["scheme"] for k, v in auto.stats.per_tensor().items()}
    assert applied == {k: by_label[label] for k, label in auto.current_plan().items()}


def test_slow_link_compresses_the_weight_and_fast_link_does_not(monkeypatch):
    for link, compressed in ((SLOW, True), (FAST, False)):
        links([link], monkeypatch)
        auto = hvd_compress.Auto(codec_costs=CODEC_COSTS, calibration_steps=1, recheck_every=0)
        model, opt = build(auto)
        for step in range(1, 3):
            train_step(model, opt, step)
        plan = auto.current_plan()
        assert (plan["net.weight"] != "none") == compressed, auto.describe()
        # the fixed costs, not timings: 1 ns an element (averaged over ranks: rounding only)
        codec_s = auto.plan_state.codec_s
        assert codec_s["net.weight"]["Int8"] == pytest.approx(64 * 512 * 1e-9, rel=1e-9), codec_s
        # the 8-element bias stays dense or joins the collectives the weight pays for, never a
        # transport of its own: at 1 MB/s its 32 bytes cost about what a collective entry does
        # (cost_model.ENTRY_S), so the margin decides (2 ranks: it joins; 3: dense)
        assert plan["net.bias"] in ("none", plan["net.weight"]), auto.describe()


def held_residual(auto, name, shape):
    """This rank's residual of a tensor, a two-phase owner's stage-2 residual
    folded in at its chunk (zeros where none is kept)."""
    from hvd_compress.adapters.torch_adapter import folded_residual
    state = auto.adapter_for("torch").roles.store.params.of(name)
    if state.residual is None:  # none keeps no residual until a lossy scheme has run
        return torch.zeros(shape)
    return folded_residual(state.residual, state.owned_chunk_residual, RANK, SIZE, name).view(shape)


def test_auto_picks_the_transport_the_model_predicts_faster(monkeypatch):
    """On the slow link the model predicts TopK(0.01) faster by two-phase than
    by allgather for the 64x512 weight from 3 ranks up (every rank receives
    about 2 payloads instead of N-1, in one more round) and by allgather at 2;
    Auto applies what the model says -- two-phase runs (its owners keep a
    stage-2 residual) -- and conserves the gradient across it."""
    from hvd_compress.auto.planner import choose
    links([SLOW], monkeypatch)
    only_topk = ("FP16", "Int8", "TopK(0.1)", "PowerSGD(4)")
    auto = hvd_compress.Auto(codec_costs=CODEC_COSTS, calibration_steps=1, recheck_every=0, exclude=only_topk)
    assert [c.label for c in auto.candidates] == ["none", "TopK(0.01)", "TopK(0.01)/two_phase"]
    model, opt = build(auto)
    total = torch.zeros(SPECS["net.weight"])
    for step in range(1, 5):
        train_step(model, opt, step)
        total += grads_at(step)["net.weight"]
    numel, shape = 64 * 512, SPECS["net.weight"]
    costs = {label: CODEC_COSTS[label] * numel for label in ("TopK(0.01)", "TopK(0.01)/two_phase")}
    said = choose(numel, shape, SIZE, SLOW, auto.candidates, costs).label
    assert said == ("TopK(0.01)/two_phase" if SIZE >= 3 else "TopK(0.01)")
    assert auto.current_plan()["net.weight"] == said, auto.describe()
    owned = auto.adapter_for("torch").roles.store.params.of("net.weight").owned_chunk_residual
    assert (owned is not None) == (SIZE >= 3)
    applied = -model.net.weight.detach()  # lr 1, op Sum, start at 0
    held = hvd.allreduce(held_residual(auto, "net.weight", shape), op=hvd.Sum, name="test.auto.two_phase.res")
    want = hvd.allreduce(total, op=hvd.Sum, name="test.auto.two_phase.grad")
    assert (applied + held - want).abs().max().item() < 1e-3


def test_a_forced_disagreement_raises_on_every_rank(monkeypatch):
    """Rank 1 reads the broadcast plan wrongly: every rank raises PlanMismatchError, none hangs."""
    links([FAST], monkeypatch)
    auto = hvd_compress.Auto(codec_costs=CODEC_COSTS, calibration_steps=1, recheck_every=0)
    auto_links.misread_plan_on(1, RANK, auto, monkeypatch)
    model = Params({"only.weight": (8, 4)})  # one tensor: nothing else in flight when the error comes
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=auto)
    model.only.weight.sum().backward()
    opt.step()
    opt.zero_grad()
    with pytest.raises(Exception, match="different plans") as err:
        model.only.weight.sum().backward()
    assert isinstance(err.value, PlanMismatchError) or "PlanMismatchError" in repr(err.value)
    # the ranks are still in step afterwards
    assert same_on_all_ranks("after", "test.auto.after_mismatch")


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_error_feedback_survives_replans(monkeypatch, momentum):
    """fast -> slow -> fast: the weight's scheme changes at least once to a
    lossy one and back, and at every step, summed over ranks,
    sum(what was applied) + residuals == sum(gradients).  With ``momentum=``
    (and SGD without momentum) the law holds for the velocities
    ``u <- m u + g``, one per tensor and rank, carried across the plans."""
    probes = links([FAST, SLOW, FAST], monkeypatch)
    # FP16 left out: Horovod sums its payloads in half precision, a rounding after
    # what was sent that no error feedback can see (a property of FP16 itself);
    # trial_plans=1: the re-checks adopt on the prediction (the links are faked,
    # so a trial's measured steps could not see them)
    auto = hvd_compress.Auto(calibration_steps=2, recheck_every=3, replan_threshold=0.05, exclude=("FP16",),
                             codec_costs=CODEC_COSTS, trial_plans=1,
                             momentum=momentum)
    model, opt = build(auto)
    residuals = auto.adapter_for("torch").residuals
    worst = worst_conservation_error(auto, model, opt, range(1, 12), momentum, "replans")
    assert len(probes) == 3  # decided at step 3, re-checked at 6 and 9
    weight_labels = [choices["net.weight"].label for _, choices, _ in auto.plan_state.history]
    # dense on the fast link, lossy on the slow one, dense again (none costs nothing to encode)
    assert len(weight_labels) == 3 and weight_labels[0] == weight_labels[2] == "none", weight_labels
    assert weight_labels[1] != "none", weight_labels
    # back on none, the residual was sent out in full in one step and none keeps none
    assert residuals["net.weight"].abs().max().item() == 0.0
    assert worst < 1e-3, f"conservation broken by {worst} under {weight_labels}"
    assert same_on_all_ranks(auto.current_plan(), "test.auto.replan_same")


def worst_conservation_error(auto, model, opt, steps, momentum, tag, after_step=lambda step: None):
    """Train ``steps`` from a fresh model and return the largest deviation,
    over the steps and elements, of sum over ranks of (what was applied +
    residual held) from the sum of the velocities ``u <- m u + g`` (the
    gradients where m = 0), relative to that sum's largest element where it
    exceeds 1; ``after_step(step)`` runs after each step."""
    total_grad = {name: torch.zeros(shape) for name, shape in SPECS.items()}
    velocity = {name: torch.zeros(shape) for name, shape in SPECS.items()}
    worst = 0.0
    for step in steps:
        train_step(model, opt, step)
        for name, g in grads_at(step).items():
            velocity[name] = momentum * velocity[name] + g
            total_grad[name] += velocity[name]
        for name, p in model.named_parameters():
            applied = -p.detach()  # lr 1, op Sum, start at 0: minus the sum of what was applied
            mine = held_residual(auto, name, p.shape)
            held = hvd.allreduce(mine, op=hvd.Sum, name=f"test.auto.{tag}.res.{name}.{step}")
            want = hvd.allreduce(total_grad[name], op=hvd.Sum, name=f"test.auto.{tag}.grad.{name}.{step}")
            worst = max(worst, (applied + held - want).abs().max().item() / max(1.0, want.abs().max().item()))
        after_step(step)
    return worst


@pytest.mark.parametrize("warmup_with, exclude", [("Int8", ("FP16",)), ("FP16", ())])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_a_quantized_warmup_rounds_where_dense_clearly_loses_and_keeps_every_gradient(monkeypatch, momentum,
                                                                                      warmup_with, exclude):
    """A warmup on a link where dense clearly loses (the early probe): the
    weight travels as ``warmup_with``'s quantizer with error feedback for the
    warmup's 4 steps, the bias dense, and the plan after it is lossy; at every
    step, summed over ranks, sum(what was applied) + residuals == sum(velocities)."""
    auto_links.early_link(SLOW, monkeypatch, auto_calibration, SIZE)
    links([SLOW], monkeypatch)
    auto = hvd_compress.Auto(calibration_steps=2, warmup_steps=4, warmup_with=warmup_with, exclude=exclude,
                             codec_costs=CODEC_COSTS, momentum=momentum)
    model, opt = build(auto)
    in_warmup = {}

    def record(step):
        if step == 4:  # the warmup's last step: its first plan starts at the next communication
            in_warmup.update(auto.plan_state.provisional, planned=bool(auto.plan_state.history))
    worst = worst_conservation_error(auto, model, opt, range(1, 9), momentum, "warmup", record)
    provisional = auto.plan_state.provisional
    assert in_warmup == {**provisional, "planned": False}, in_warmup
    assert provisional["net.weight"].split("/")[0] == warmup_with and provisional["net.bias"] == "none", provisional
    assert auto.plan_state.history[0][0] == 4 and auto.current_plan()["net.weight"] != "none", auto.describe()
    # FP16 travels by Horovod's half-precision allreduce, which rounds the sum
    # itself (2^-11 of it, a step), beyond any residual's reach
    tol = 2e-3 if warmup_with == "FP16" else 1e-3
    assert worst < tol, f"conservation broken by {worst} ({provisional}, then {auto.current_plan()})"
    assert same_on_all_ranks(provisional, "test.auto.warmup_same")


@pytest.mark.parametrize("probe_name", ["probe_early", "probe_link"])
def test_a_probe_repeats_a_size_alike_on_every_rank_whatever_each_read(monkeypatch, probe_name):
    """Rank 1's clock reads every allreduce of a probe (the early one or a
    decision's) as 1 s, rank 0's as what it took: the first allreduce of each
    size is agreed to be slow, and both ranks time each size once (no rank
    waits for a repeat the other skipped)."""
    names, prefix, seconds = auto_links.probe_with_clocks_apart(hvd, auto_calibration, probe_name, monkeypatch)
    assert names == [f"{prefix}.{n}.{i}" for n in (1024, 4096) for i in ("0", "first")], names
    assert len(seconds) == 2 and (hvd.rank() != 1 or seconds == [1.0, 1.0]), seconds
    assert same_on_all_ranks(names, f"test.auto.probe_names.{probe_name}")


def test_resume_keeps_the_plan(monkeypatch):
    links([SLOW], monkeypatch)
    kwargs = dict(codec_costs=CODEC_COSTS, calibration_steps=1, recheck_every=50)
    auto = hvd_compress.Auto(**kwargs)
    model, opt = build(auto)
    for step in range(1, 4):
        train_step(model, opt, step)
    saved = auto.state_dict()
    plan, history = auto.current_plan(), auto.plan_state.history

    probes = links([FAST], monkeypatch)  # a resumed job must not re-calibrate to this
    resumed = hvd_compress.Auto(**kwargs)
    resumed.load_state_dict(saved)
    assert resumed.current_plan() == plan
    assert [(start, version) for start, _, version in resumed.plan_state.history] == [(s, v) for s, _, v in history]
    model2, opt2 = build(resumed)
    model2.load_state_dict(model.state_dict())
    train_step(model2, opt2, 4)
    assert probes == [] and resumed.current_plan() == plan
    by_label = {c.label: c.scheme.name for c in resumed.candidates}
    applied = {k: v["scheme"] for k, v in resumed.stats.per_tensor().items()}
    assert applied == {k: by_label[label] for k, label in plan.items()}
    assert same_on_all_ranks(resumed.current_plan(), "test.auto.resumed_same")


class HandedOver:
    """Horovod's compression object around ``comp``: records, per call,
    whether ``compress`` returned the gradient itself with no context."""

    def __init__(self, comp):
        self.comp, self.as_is = comp, []

    def compress(self, tensor):
        out, ctx = self.comp.compress(tensor)
        self.as_is.append(out is tensor and ctx is None)
        return out, ctx

    def decompress(self, tensor, ctx):
        return self.comp.decompress(tensor, ctx)


def test_a_dense_plan_hands_horovod_the_gradient_itself(monkeypatch):
    """On the fast link every tensor is planned dense: from the step after the
    plan (the one after it flushes what the calibration's lossy phase kept),
    Horovod is handed each gradient as ``none`` hands it (no copy, no
    transport), the sums are exact and the bytes still counted."""
    links([FAST], monkeypatch)
    auto = hvd_compress.Auto(codec_costs=CODEC_COSTS, calibration_steps=1, recheck_every=0)
    spy = HandedOver(auto)
    model = Params(SPECS)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters(), compression=spy, op=hvd.Sum)
    for step in range(1, 7):
        train_step(model, opt, step)
    assert set(auto.current_plan().values()) == {"none"}, auto.describe()
    assert spy.as_is[-2 * len(SPECS):] == [True] * (2 * len(SPECS)), spy.as_is  # steps 5 and 6
    want = {name: torch.zeros(shape) for name, shape in SPECS.items()}
    for step in range(1, 7):
        for name, g in grads_at(step).items():
            want[name] += g
    for name, p in model.named_parameters():
        total = hvd.allreduce(want[name], op=hvd.Sum, name=f"test.auto.as_is.{name}")
        residual = hvd.allreduce(held_residual(auto, name, p.shape), op=hvd.Sum, name=f"test.auto.as_is.res.{name}")
        torch.testing.assert_close(-p.detach() + residual, total, rtol=1e-5, atol=1e-4)
        stats = auto.stats.per_tensor()[name]
        assert stats["calls"] == 6 and stats["payload_bytes"] == stats["dense_fp32_bytes"] == 4 * p.numel()


def _train_slower_when_compressed(auto, steps, monkeypatch):
    """``steps`` steps on the slow link, made slower where the weight's plan in force
    compresses (0.3 s of sleep against 0.05 s); the model and the sum of every gradient."""
    import time
    links([SLOW], monkeypatch)
    model, opt = build(auto)
    want = {name: torch.zeros(shape) for name, shape in SPECS.items()}
    for step in range(1, steps + 1):
        compressed = auto.current_plan().get("net.weight", "none") != "none"
        time.sleep(0.3 if compressed else 0.05)
        train_step(model, opt, step)
        for name, g in grads_at(step).items():
            want[name] += g
    return model, want


def _nothing_lost(model, want, name):
    for param, p in model.named_parameters():  # lr 1, op Sum: the parameters are minus the sum of gradients
        total = hvd.allreduce(want[param], op=hvd.Sum, name=f"test.auto.{name}.{param}")
        torch.testing.assert_close(-p.detach(), total, rtol=1e-4, atol=1e-3)


def test_a_compressed_plan_slower_than_the_dense_steps_before_it_is_not_kept(monkeypatch):
    """The calibration ran dense (``calibrate_compressed=False``) and the model
    plans the weight compressed on the slow link; its trial steps are made
    slower than the dense steps were: every rank adopts the dense plan rank 0
    picked, and what the compressed trial held back is sent out in full."""
    auto = hvd_compress.Auto(codec_costs=CODEC_COSTS, calibration_steps=3, recheck_every=0, trial_steps=2,
                             calibrate_compressed=False, trial_plans=2)
    model, want = _train_slower_when_compressed(auto, 13, monkeypatch)
    state = auto.plan_state
    dense = state.trials[-1]
    assert dense.get("before") and state.trial_pick == len(state.trials) - 1, auto.describe()
    assert any(label != "none" for t in state.trials_run() for label in t["labels"].values()), auto.describe()
    assert set(auto.current_plan().values()) == {"none"} and same_on_all_ranks(
        [state.trial_pick, [t["step_s"] for t in state.trials]], "test.auto.dense_trial_same")
    _nothing_lost(model, want, "dense_trial")


def test_a_recheck_tries_the_plan_it_proposes_and_keeps_the_faster(monkeypatch):
    """The first decision kept the dense plan, measured faster than the
    compressed one the model proposes; the re-check proposes it again and
    tries it against the dense steps before it: every rank keeps the dense
    plan rank 0 picked, under collective names that agree, and nothing the
    compressed trials held back is lost."""
    auto = hvd_compress.Auto(codec_costs=CODEC_COSTS, calibration_steps=3, recheck_every=6, trial_steps=2,
                             calibrate_compressed=False, trial_plans=2, replan_threshold=0.0)
    model, want = _train_slower_when_compressed(auto, 16, monkeypatch)
    state = auto.plan_state
    assert len(state.earlier_trials) == 1 and state.trials[-1].get("in_force"), auto.describe()
    assert state.trial_pick == 1 and set(auto.current_plan().values()) == {"none"}, auto.describe()
    # the re-check's plan ran its trial_steps, then the dense plan in force came back (where
    # they start depends on how many plans the first decision tried: the calibrated step, a
    # real clock, sets which plans are predicted close enough to try)
    tried, back = [start for start, _, _ in state.history][-2:]
    assert back - tried == auto.trial_steps and tried > state.earlier_trials[0]["trials"][0]["start"], auto.describe()
    assert same_on_all_ranks([state.trial_pick, [t["step_s"] for t in state.trials]], "test.auto.recheck_same")
    _nothing_lost(model, want, "recheck")
