"""scripts/convergence.py's and convergence_rows.py's bookkeeping, without training: a
recipe's flags, the key that keeps recipes apart, and the convergence target's check on made-up rows."""
import argparse
import os
import sys

import pytest

from hvdc_examples_util import REPO

sys.path.insert(0, os.path.join(REPO, "scripts"))

import convergence  # noqa: E402
import convergence_rows  # noqa: E402


def _args(**kw):
    base = dict(ratio=None, dense_below=0, warmup_steps=0, warmup_epochs=0, ramp_epochs=0)
    return argparse.Namespace(**{**base, **kw})


def test_warmup_epochs_become_steps_at_each_world_size():
    # 4000 training digits, batch 32 per rank: ceil(2000/32) = 63 steps an epoch at 2 ranks, 32 at 4
    assert convergence.recipe_flags(_args(warmup_epochs=1), 2) == ["--warmup-steps", "63"]
    assert convergence.recipe_flags(_args(warmup_epochs=2), 4) == ["--warmup-steps", "64"]
    assert convergence.recipe_flags(_args(ratio=0.1, dense_below=1024), 2) == ["--ratio", "0.1",
                                                                               "--dense-below", "1024"]
    assert convergence.recipe_flags(_args(), 2) == []


def test_ramp_epochs_become_steps_a_stage_at_each_world_size():
    assert convergence.recipe_flags(_args(warmup_epochs=2, ramp_epochs=1), 2) == ["--warmup-steps", "126",
                                                                                  "--ramp-steps", "63"]
    assert convergence.recipe_flags(_args(ramp_epochs=1), 4) == ["--ramp-steps", "32"]


def test_recipe_flags_reach_schemes_not_baselines_and_baselines_stay_unless_named():
    cfgs = convergence.configs_for("torch", False, ["topk", "int8"], ("compressor",), (True,),
                                   recipe_flags=["--dense-below", "1024"])
    assert [c[1] for c in cfgs] == ["topk", "int8"]  # no baseline rows at a recipe of one scheme
    assert all(c[4][-2:] == ["--dense-below", "1024"] for c in cfgs)
    cfgs = convergence.configs_for("torch", False, ["none", "topk"], ("optimizer",), (True,),
                                   recipe_flags=["--warmup-steps", "5"])
    assert cfgs[0] == ("none", "none", False, "optimizer", ["--compression", "none"])
    cfgs = convergence.configs_for("torch", False, ["fp16", "int8"], ("optimizer",),
                                   (convergence.DEFAULT_FEEDBACK,))
    assert [(c[1], c[2]) for c in cfgs if c[1] in ("fp16", "int8")] == [("fp16", False), ("int8", True)]


def _row(scheme, acc, seeds=(1, 2, 3), ef=True, placement="compressor", model="cnn", ranks=2, **recipe):
    argv = (convergence.recipe_for("torch", model) + ["--compression", scheme]
            + sum(([f"--{k.replace('_', '-')}", str(v)] for k, v in recipe.items()), []))
    return {"framework": "torch", "model": model, "ranks": ranks, "scheme": scheme, "error_feedback": ef,
            "momentum_placement": placement, "final_test_accuracy": acc, "final_test_accuracy_std": 0.1,
            "seeds": list(seeds), "recipe": convergence_rows.recipe_of(argv, ranks, placement)}


def test_a_ratio_ramp_is_a_row_of_its_own_and_shown_in_the_per_row_tables():
    flat = _row("dgc", 97.0, dense_below=1024, warmup_steps=63)
    ramped = _row("dgc", 97.4, dense_below=1024, warmup_steps=63, ramp_steps=63)
    assert flat["recipe"]["ramp_steps"] == 0 and ramped["recipe"]["ramp_steps"] == 63
    assert convergence_rows.row_key(flat) != convergence_rows.row_key(ramped)
    assert convergence_rows.merge_rows([flat], [ramped]) == [flat, ramped]
    old = dict(flat, recipe={k: v for k, v in flat["recipe"].items() if k != "ramp_steps"})  # rows from before
    assert convergence_rows.row_key(old) == convergence_rows.row_key(flat)
    lines = convergence_rows.report([_row("none", 97.5, ef=False, placement="optimizer"), flat, ramped]).splitlines()
    assert any("| 63, ratio ramp 63 a stage |" in l and "97.40%" in l for l in lines), lines
    assert any("| 63 |" in l and "97.00%" in l for l in lines), lines


def test_ramp_gains_pairs_the_ramp_with_the_row_without_it_over_their_common_seeds():
    def with_acc(row, accs):
        return dict(row, final_test_accuracy_per_seed=accs, final_test_accuracy=sum(accs) / len(accs))
    base = with_acc(_row("none", 0, seeds=range(1, 7), ef=False, placement="optimizer"), [97.0] * 6)
    flat = with_acc(_row("dgc", 0, dense_below=1024, warmup_steps=63), [96.0, 96.5, 97.0])
    ramped = with_acc(_row("dgc", 0, seeds=range(1, 7), dense_below=1024, warmup_steps=63, ramp_steps=63),
                      [96.5, 96.5, 97.5, 90.0, 90.0, 90.0])  # seeds 4-6 have no partner: left out of the gain
    for r in (base, flat, ramped):
        r["compression_ratio_whole_run"] = 1.0 if r is base else 9.5 if r is flat else 5.9
    lines = convergence_rows.ramp_gains([base, flat, ramped]).splitlines()
    assert len(lines) == 3, lines
    assert lines[2] == ("| torch cnn 2 ranks | DGC(0.001) | -0.50 ± 0.29 | -3.58 ± 1.54 (6 seeds) | +0.33 ± 0.17 "
                        "| 9.5x / 5.9x |"), lines[2]


def test_a_recipe_is_a_row_of_its_own():
    bare, tuned = _row("topk", 97.0, ratio=0.01), _row("topk", 97.6, ratio=0.01, dense_below=1024, warmup_steps=63)
    assert convergence_rows.row_key(bare) != convergence_rows.row_key(tuned)
    assert convergence_rows.merge_rows([bare], [tuned]) == [bare, tuned]
    assert convergence_rows.merge_rows([bare, tuned], [dict(tuned, final_test_accuracy=90.0)])[-1][
        "final_test_accuracy"] == 90.0


def _measured(row, finals, curve, seconds):
    return dict(row, final_test_accuracy=sum(finals) / len(finals), final_test_accuracy_per_seed=finals,
                diverged_seeds=[], test_accuracy_per_epoch=curve, train_loss_per_epoch=[1.0, 0.5],
                final_residual_norm=2.0, seconds_per_run=seconds)


def test_add_seeds_pools_the_seeds_of_one_recipe_into_one_row():
    first = _measured(_row("topk", 0, seeds=(1, 2, 3), ratio=0.01), [90.0, 91.0, 92.0], [80.0, 90.0], 10.0)
    more = _measured(_row("topk", 0, seeds=(4,), ratio=0.01), [95.0], [84.0, 94.0], 30.0)
    other = _row("topk", 97.0, ratio=0.01, dense_below=1024)
    merged = convergence_rows.merge_rows([first, other], [more], add_seeds=True)
    assert merged[0] is other and len(merged) == 2
    row = merged[1]
    assert row["seeds"] == [1, 2, 3, 4] and row["final_test_accuracy_per_seed"] == [90.0, 91.0, 92.0, 95.0]
    assert row["final_test_accuracy"] == 92.0
    assert row["final_test_accuracy_std"] == pytest.approx(2.160, abs=1e-3)  # sample std of 90, 91, 92, 95
    assert row["test_accuracy_per_epoch"] == [81.0, 91.0] and row["seconds_per_run"] == 15.0
    # without the flag, the new measurement replaces the old one, as before
    assert convergence_rows.merge_rows([first], [more]) == [more]


def test_add_seeds_refuses_a_seed_the_row_already_has():
    first = _measured(_row("topk", 0, seeds=(1, 2, 3), ratio=0.01), [90.0, 91.0, 92.0], [80.0, 90.0], 10.0)
    again = _measured(_row("topk", 0, seeds=(3, 4), ratio=0.01), [92.0, 95.0], [84.0, 94.0], 30.0)
    with pytest.raises(ValueError, match=r"--add-seeds: seeds \[3\] are already in the row"):
        convergence_rows.merge_rows([first], [again], add_seeds=True)


@pytest.mark.parametrize("acc, met", [(97.55, True), (97.45, False)])
def test_targets_take_the_best_recipe_over_three_seeds(acc, met):
    rows = [_row("none", 98.0, ef=False, placement="optimizer"),
            _row("topk", 96.0, ratio=0.01),                                       # the bare scheme: far off
            _row("topk", 99.9, seeds=(1,), ratio=0.01, dense_below=1024),         # one seed never counts
            _row("topk", 99.9, ratio=0.1),                                        # not the ratio the target names
            _row("topk", acc, ratio=0.01, dense_below=1024, warmup_steps=63)]
    checks = {name.split(": ", 1)[1]: (ok, detail) for name, ok, detail in convergence_rows.check_expectations(rows)}
    ok, detail = checks["TopK(0.01)+EF within 0.5 point of none"]
    assert ok is met and "dense <= 1024 elements" in detail and "63 dense warmup steps" in detail
    assert checks["OneBit within 1.0 point of none"][0] is None  # not measured is neither met nor failed


def test_recipe_table_gives_the_difference_with_its_standard_error():
    base = dict(_row("none", 98.0, ef=False, placement="optimizer"), final_test_accuracy_std=0.3)
    tuned = dict(_row("topk", 97.0, ratio=0.01, dense_below=1024, warmup_steps=63), final_test_accuracy_std=0.4)
    # rows without per-seed accuracies: the two means, sqrt(0.3^2/3 + 0.4^2/3) = 0.2887
    d, se = convergence_rows.versus_dense(tuned, base)
    assert d == -1.0 and abs(se - 0.2887) < 1e-4
    line = next(l for l in convergence_rows.recipe_table([base, tuned]).splitlines() if l.startswith("| `TopK(0.01)`"))
    assert "97.00 ± 0.40 (-1.00 ± 0.29) not met" in line
    brief = convergence_rows.recipe_table([base, tuned], brief=True).splitlines()
    assert brief[0].startswith("| scheme | torch cnn 2 ranks |") and brief[1].startswith("|---|---:|")
    assert any(l.startswith("| `TopK(0.01)` | 97.00 ± 0.40 (-1.00) not met | not measured |") for l in brief)


def _tta(scheme, seed, steps, ranks=4, model="transformer", budget=1280):
    return {"framework": "torch", "model": model, "workers": ranks, "link": "unshaped", "measured": True,
            "scheme": scheme, "seed": seed, "reached": steps is not None, "steps_to_target": steps,
            "budget_steps": budget}


def test_a_recipe_with_a_longer_budget_is_judged_by_time_to_target_where_bench_tta_measured_it():
    group = ("torch", "transformer", 4, 0.0, 20, "")
    topk = next(r for r in convergence_rows.RECIPES if r.label == "TopK(0.01)")
    dense = [_tta("none", s, n, budget=640) for s, n in ((1, 608), (2, 576), (3, None))]
    met = dense + [_tta("TopK(0.01)", s, n) for s, n in ((1, 640), (2, 864), (3, 800))]
    assert convergence_rows.time_to_target_verdict(met, group, topk) == (
        True, "time to target: 3/3 seeds, at most 864 steps (dense: 592; budget 1280)")
    # past 1.5x dense's median steps (608 and 576; seed 3 did not reach: 592; 1.5x: 888), or a seed short: not met
    assert not convergence_rows.time_to_target_verdict(dense + [_tta("TopK(0.01)", 1, 896)], group, topk)[0]
    short = convergence_rows.time_to_target_verdict(dense + [_tta("TopK(0.01)", 1, 640), _tta("TopK(0.01)", 2, None)],
                                                   group, topk)
    assert short == (False, "time to target: 1/2 seeds, at most 640 steps (dense: 592; budget 1280)")
    # no rows of this column, or a recipe that trains dense's length: the fixed-length criterion
    assert convergence_rows.time_to_target_verdict(met, ("torch", "transformer", 2, 0.0, 20, ""), topk) is None
    assert convergence_rows.time_to_target_verdict(met, ("torch", "cnn", 4, 0.0, 10, ""), topk) is None
    int8 = next(r for r in convergence_rows.RECIPES if r.label == "Int8()")
    assert convergence_rows.time_to_target_verdict(met, group, int8) is None


def test_the_recipe_table_says_which_cells_time_to_target_judges():
    base = dict(_row("none", 92.0, ef=False, placement="optimizer", model="transformer", ranks=4),
                final_test_accuracy_std=0.3)
    topk = dict(_row("topk", 91.0, ratio=0.01, dense_below=2048, warmup_steps=63, model="transformer", ranks=4),
                final_test_accuracy_std=0.4)
    tta_rows = [_tta("none", 1, 608, budget=640)] + [_tta("TopK(0.01)", s, 700) for s in (1, 2, 3)]
    line = next(l for l in convergence_rows.recipe_table([base, topk], tta_rows=tta_rows).splitlines()
                if l.startswith("| `TopK(0.01)`"))
    assert "2x the steps on the transformer and charlm, judged by time to target" in line
    assert ("(-1.00 ± 0.29) not met at dense's length; time to target: 3/3 seeds, at most 700 steps "
            "(dense: 608; budget 1280) |") in line  # one dense seed: its steps


def test_versus_dense_pairs_the_seeds_and_takes_only_the_rows_own_from_a_longer_dense_row():
    base = _measured(_row("none", 0, seeds=(1, 2, 3, 4), ef=False, placement="optimizer"),
                     [90.0, 92.0, 94.0, 80.0], [80.0, 90.0], 10.0)
    tuned = _measured(_row("topk", 0, ratio=0.01, dense_below=1024, warmup_steps=63),
                      [89.0, 91.5, 94.5], [80.0, 90.0], 10.0)
    d, se = convergence_rows.versus_dense(tuned, base)
    # per-seed differences -1.0, -0.5, +0.5 (seed 4's 80.0 plays no part): mean -1/3, spread 0.7638 / sqrt(3)
    assert d == pytest.approx(-1 / 3) and se == pytest.approx(0.44096, abs=1e-4)
    line = next(l for l in convergence_rows.recipe_table([base, tuned]).splitlines() if l.startswith("| `TopK(0.01)`"))
    assert "91.67 ± 0.10 (-0.33 ± 0.44) |" in line  # the row's own spread is _row's 0.1
    dense = next(l for l in convergence_rows.recipe_table([base, tuned]).splitlines() if l.startswith("| dense"))
    assert "89.00 ± 0.10 (4 seeds)" in dense
    ok = {n.split(": ", 1)[1]: ok for n, ok, _ in convergence_rows.check_expectations([base, tuned])}
    assert ok["TopK(0.01)+EF within 0.5 point of none"] is True  # -0.33 on its seeds, not 91.67 - 89.00


def _lr_warmup_row(scheme, acc, lr_warmup, **kw):
    row = _row(scheme, acc, **kw)
    argv = convergence.recipe_for("torch", "cnn", lr_warmup_epochs=lr_warmup) + ["--compression", scheme]
    row["recipe"] = dict(row["recipe"], lr_warmup_epochs=convergence_rows.recipe_of(argv, 2, "optimizer")[
        "lr_warmup_epochs"])
    return row


def test_an_lr_warmup_is_a_group_of_its_own_with_its_own_baseline():
    assert convergence.recipe_for("torch", "cnn", lr_warmup_epochs=1)[-2:] == ["--lr-warmup-epochs", "1"]
    assert "--lr-warmup-epochs" not in convergence.recipe_for("torch", "cnn")
    rows = [_lr_warmup_row("none", 96.0, 0, ef=False, placement="optimizer"),
            _lr_warmup_row("none", 98.0, 1, ef=False, placement="optimizer"),
            _lr_warmup_row("topk", 95.8, 0, ratio=0.01),   # met against the baseline without warmup
            _lr_warmup_row("topk", 97.0, 1, ratio=0.01)]   # not met against its own (98.0)
    assert len({convergence_rows.row_key(r) for r in rows}) == 4
    checks = {name: ok for name, ok, _ in convergence_rows.check_expectations(rows)}
    assert checks["torch cnn np=2: TopK(0.01)+EF within 0.5 point of none"] is True
    assert checks["torch cnn np=2 lr warmup 1: TopK(0.01)+EF within 0.5 point of none"] is False
    assert "**torch cnn 2 ranks, lr warmup 1 epoch**" in convergence_rows.report(rows)


def test_the_transformer_trains_20_epochs_and_other_epochs_are_a_group_of_their_own():
    argv = convergence.recipe_for("torch", "transformer")
    assert argv[argv.index("--epochs") + 1] == "20"
    long, short = _row("none", 92.0, ef=False, placement="optimizer"), _row("none", 88.0, ef=False,
                                                                             placement="optimizer")
    long.update(model="transformer", epochs=20)
    short.update(model="transformer", epochs=10)
    assert convergence_rows.row_key(long) != convergence_rows.row_key(short)
    assert convergence_rows.group_title(convergence_rows.group_of(short)) == "torch transformer 2 ranks, 10 epochs"
    assert convergence_rows.group_title(convergence_rows.group_of(long)) == "torch transformer 2 ranks"


def _attention_row(scheme, acc, attention, **kw):
    row = _row(scheme, acc, **kw)
    argv = convergence.recipe_for("tensorflow", "transformer", attention=attention) + ["--compression", scheme]
    row.update(framework="tensorflow", model="transformer", epochs=20)
    row["recipe"] = dict(row["recipe"], attention=convergence_rows.recipe_of(argv, 2, "optimizer")["attention"])
    return row


def test_the_tf_transformers_attention_is_a_group_of_its_own_with_its_own_baseline():
    argv = convergence.recipe_for("tensorflow", "transformer", attention="torch")
    assert argv[-2:] == ["--attention", "torch"] and "--attention" not in convergence.recipe_for("tensorflow",
                                                                                                 "transformer")
    rows = [_attention_row("none", 93.4, None, ef=False, placement="optimizer"),
            _attention_row("none", 92.7, "torch", ef=False, placement="optimizer"),
            _attention_row("topk", 92.3, None, ratio=0.01),      # not met against Keras' attention's 93.4
            _attention_row("topk", 92.3, "torch", ratio=0.01),   # met against its own 92.7
            _attention_row("topk", 92.3, "keras", ratio=0.01)]   # Keras' named: the default's row
    assert len({convergence_rows.row_key(r) for r in rows}) == 4
    checks = {name: ok for name, ok, _ in convergence_rows.check_expectations(rows)}
    assert checks["tensorflow transformer np=2: TopK(0.01)+EF within 0.5 point of none"] is False
    assert checks["tensorflow transformer np=2 torch attention: TopK(0.01)+EF within 0.5 point of none"] is True
    assert "**TF transformer 2 ranks, torch attention**" in convergence_rows.report(rows)


def test_attention_is_refused_outside_the_tf_transformer(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["convergence.py", "--frameworks", "torch", "--model", "transformer",
                                      "--attention", "torch", "--outdir", "/nonexistent"])
    with pytest.raises(SystemExit):
        convergence.main()
    assert "--attention is the TF transformer's; not torch's transformer" in capsys.readouterr().err


def _recipes_script_calls(tmp_path, *groups):
    """scripts/convergence_recipes.sh with a stand-in python that records each convergence.py
    call (and runs ``-c`` snippets for real): the calls it made, one line each."""
    import subprocess
    stub = tmp_path / "python"
    log = tmp_path / "calls"
    stub.write_text(f'#!/bin/bash\nif [ "$1" = -c ]; then exec {sys.executable} "$@"; fi\necho "$*" >> {log}\n')
    stub.chmod(0o755)
    subprocess.run(["bash", os.path.join(REPO, "scripts", "convergence_recipes.sh"), *groups],
                   check=True, capture_output=True, env=dict(os.environ, PYTHON=str(stub), OUTDIR=str(tmp_path)))
    return log.read_text().splitlines()


def _call_flag(call, name):
    """``--name``'s value in one recorded convergence.py call (the last one wins, as in argparse)."""
    return convergence_rows._flag(call.split(), f"--{name}")


def test_recipes_script_runs_each_group_with_its_flags(tmp_path):
    calls = _recipes_script_calls(tmp_path, "tensorflow cnn 4 1 1")
    runs = [c for c in calls if "--report" not in c]
    assert len(runs) == 7 and calls[-1].endswith(f"--report plots --outdir {tmp_path}")
    assert all("--frameworks tensorflow --model cnn --ranks 4 --lr-warmup-epochs 1" in c for c in runs)
    no_ef = next(c for c in runs if "--error-feedback off" in c and "--schemes topk" in c)
    assert no_ef.endswith("--lr 0.02")  # the model's rate, from convergence_rows.MODEL_LR_PER_RANK
    assert all("--warmup-epochs 1" in c for c in runs if "--schemes topk,dgc" in c or "randomk" in c)
    assert all("--dense-below 1024" in c for c in runs if "--error-feedback on" in c)


def test_recipes_script_more_seeds_reproduces_every_row_measured_over_more_than_three_seeds(tmp_path):
    import json
    runs = [c for c in _recipes_script_calls(tmp_path, "more-seeds") if "--report" not in c]
    assert all(" --add-seeds" in c for c in runs)

    # seeds 1-3 (the groups' runs) and the ones each line adds (the last --seeds wins), per row: a
    # ratio ramp's row is not the row without it
    called = {(_call_flag(c, "frameworks"), _call_flag(c, "model"), int(_call_flag(c, "ranks")), scheme,
               "--ramp-epochs" in c): [1, 2, 3] + [int(s) for s in _call_flag(c, "seeds").split(",")]
              for c in runs for scheme in _call_flag(c, "schemes").split(",")}
    assert {len(seeds) for seeds in called.values()} == {6, 10}
    with open(os.path.join(REPO, "docs", "results", "convergence.json")) as f:
        rows = json.load(f)
    # (seeds 11-15 of two TF rows are the attention group's, and the CNN's ramp rows the cnn-ramp
    # group's, tested below)
    pooled = {(r["framework"], r["model"], r["ranks"], r["scheme"], bool(r["recipe"].get("ramp_steps"))):
              [s for s in r["seeds"] if s <= 10] for r in rows
              if len(r.get("seeds") or []) > 3 and not convergence_rows.attention_of(r)
              and not (r["model"] == "cnn" and r["recipe"].get("ramp_steps"))
              and convergence_rows.epochs_of(r) == convergence_rows.MODEL_EPOCHS[r["model"]]}
    assert called == pooled


def test_recipes_script_attention_measures_every_row_of_torchs_attention_layout(tmp_path):
    import json
    runs = [c for c in _recipes_script_calls(tmp_path, "attention") if "--report" not in c]

    called = {}
    for c in runs:
        attention = "" if _call_flag(c, "attention") == "keras" else _call_flag(c, "attention")
        for scheme in _call_flag(c, "schemes").split(","):
            key = (attention, int(_call_flag(c, "ranks")), scheme)
            called[key] = called.get(key, []) + [int(s) for s in _call_flag(c, "seeds").split(",")]
    with open(os.path.join(REPO, "docs", "results", "convergence.json")) as f:
        rows = json.load(f)
    measured = {(convergence_rows.attention_of(r), r["ranks"], r["scheme"]): r["seeds"] for r in rows
                if convergence_rows.attention_of(r) and convergence_rows.epochs_of(r) == 20}
    assert {k: v for k, v in called.items() if k[0]} == measured
    # Keras' own attention: seeds 11-15 on top of the 1-10 the table's rows have
    keras = {(r["ranks"], r["scheme"]): r["seeds"] for r in rows if r["framework"] == "tensorflow"
             and r["model"] == "transformer" and len(r.get("seeds") or []) == 15}
    assert keras == {(2, s): list(range(1, 16)) for s in ("none", "topk")}
    assert all(called[("", 2, s)] == list(range(11, 16)) for s in ("none", "topk"))


def test_recipes_script_cnn_ramp_measures_every_ratio_ramp_row_of_the_cnn(tmp_path):
    import json
    runs = [c for c in _recipes_script_calls(tmp_path, "cnn-ramp") if "--report" not in c]
    assert all(_call_flag(c, "schemes") == "dgc" and _call_flag(c, "ramp-epochs") == "1" for c in runs)
    called = {(_call_flag(c, "frameworks"), int(_call_flag(c, "ranks")), float(_call_flag(c, "lr-warmup-epochs"))):
              [int(s) for s in _call_flag(c, "seeds").split(",")] for c in runs}
    with open(os.path.join(REPO, "docs", "results", "convergence.json")) as f:
        rows = json.load(f)
    measured = {(r["framework"], r["ranks"], float(convergence_rows.lr_warmup_of(r))): r["seeds"] for r in rows
                if r["model"] == "cnn" and r["recipe"].get("ramp_steps")}
    assert len(called) == 4 and called == measured


@pytest.mark.parametrize("group, epochs, cells", [("longer", 40, 9), ("longest", 80, 3)])
def test_recipes_script_long_groups_measure_every_row_of_their_length(tmp_path, group, epochs, cells):
    """``longer`` ran every 40-epoch row of convergence.json, ``longest`` every 80-epoch row."""
    import json
    runs = [c for c in _recipes_script_calls(tmp_path, group) if "--report" not in c]
    assert all(_call_flag(c, "epochs") == str(epochs) and _call_flag(c, "model") == "transformer" for c in runs)
    # the run's seeds are the script's default, 1-3 (a --seeds of the line would follow it and win)
    called = {(_call_flag(c, "frameworks"), int(_call_flag(c, "ranks")), scheme, "--ramp-epochs" in c):
              [int(s) for s in _call_flag(c, "seeds").split(",")] for c in runs
              for scheme in _call_flag(c, "schemes").split(",")}
    with open(os.path.join(REPO, "docs", "results", "convergence.json")) as f:
        rows = json.load(f)
    measured = {(r["framework"], r["ranks"], r["scheme"], bool(r["recipe"].get("ramp_steps"))): r["seeds"]
                for r in rows if convergence_rows.epochs_of(r) == epochs}
    assert len(called) == cells and called == measured


def test_recipes_script_sends_the_transformers_embedding_dense_for_topk_dgc_and_powersgd(tmp_path):
    runs = [c for c in _recipes_script_calls(tmp_path, "torch transformer 4 2") if "--report" not in c]
    for schemes in ("topk,dgc", "powersgd"):
        line = next(c for c in runs if f"--schemes {schemes} " in c)
        assert "--dense-below 2048 --warmup-epochs 2" in line and "--lr 0.05" in line
    assert all("--dense-below 1024" in c for c in runs if "--schemes efsignsgd" in c or "randomk" in c)


def test_recipe_table_takes_each_models_dense_threshold():
    base = _row("none", 92.0, ef=False, placement="optimizer")
    rows = []
    for dense_below, acc in ((1024, 90.0), (2048, 91.8)):
        r = _row("topk", acc, ratio=0.01, dense_below=dense_below, warmup_steps=126)
        rows.append(r)
    for ramp, acc in ((63, 91.5), (0, 80.0)):
        r = _row("dgc", acc, dense_below=2048, warmup_steps=126)
        r["recipe"]["ramp_steps"] = ramp
        rows.append(r)
    for r in [base] + rows:
        r["model"] = "transformer"
        r["epochs"] = 20
        r["recipe"] = dict(r["recipe"], lr_per_rank=0.05)
    table = convergence_rows.recipe_table([base] + rows)
    line = next(l for l in table.splitlines() if l.startswith("| `TopK(0.01)`"))
    assert "dense <= 1024 elements (transformer: 2048)" in line
    assert "91.80 ± 0.10 (-0.20 ± 0.08)" in line and "90.00" not in line and "ratio ramp" not in line
    # DGC's recipe on the transformer ramps the ratio (RAMP_EPOCHS): a row without the ramp is not its cell
    line = next(l for l in table.splitlines() if l.startswith("| `DGC(0.001)`"))
    assert "ratio ramp (transformer: 1 epoch a stage)" in line
    assert "91.50 ± 0.10 (-0.50 ± 0.08)" in line and "80.00" not in line
    assert convergence_rows.per_model(convergence_rows.DENSE_BELOW_WITH_EMBEDDINGS, "cnn") == 1024


def test_plot_draws_rows_of_any_epoch_count(tmp_path):
    # --quick measures 4 epochs: no recipe-table column has them, the plot still shows them
    rows = []
    for scheme, ef, acc in (("none", False, 96.0), ("topk", True, 95.5), ("topk", False, 94.0)):
        r = _row(scheme, acc, seeds=(1,), ef=ef, placement="optimizer", ratio=0.01)
        r.update(epochs=4, test_accuracy_per_epoch=[90.0, 93.0, 95.0, acc])
        rows.append(r)
    convergence_rows.plot(rows, str(tmp_path / "quick.png"))
    assert (tmp_path / "quick.png").stat().st_size > 10_000


def test_the_docs_print_the_reports_of_the_committed_results():
    """The recipe table and the ratio ramp's table of docs/results/convergence.md, and the
    per-row tables of docs/results/convergence_rows.md, are what ``--report`` prints from
    convergence.json."""
    import json
    with open(os.path.join(REPO, "docs", "results", "convergence.json")) as f:
        rows = json.load(f)

    def text(path):
        with open(os.path.join(REPO, path)) as f:
            return f.read()
    with open(os.path.join(REPO, "docs", "results", "tta.json")) as f:
        tta_rows = json.load(f)
    assert convergence_rows.recipe_table(rows, tta_rows=tta_rows) in text("docs/results/convergence.md")
    assert convergence_rows.ramp_gains(rows) in text("docs/results/convergence.md")
    assert convergence_rows.report(rows).strip("\n") in text("docs/results/convergence_rows.md")
