"""``hvd-compress bench tta``: its bookkeeping (targets, first reach, combined curves, the
table) and a 2-rank smoke run on the emulated cluster: the JSON schema, and "reached"
computed from the evaluation curve."""
import json

import pytest

from hvd_compress.tools.bench import tta
from test_bench import cluster_or_skip  # tests/bench/test_bench.py: root, ip, sshd and tc


def _curve(accs, step=10, seconds=1.0, wire=100):
    return [{"step": step * (i + 1), "time_s": seconds * (i + 1), "wire_bytes": wire * (i + 1), "accuracy": a}
            for i, a in enumerate(accs)]


def test_first_reach_and_the_target():
    curve = _curve([80.0, 90.0, 89.0, 95.0])
    assert tta.first_reach(curve, 90.0)["step"] == 20
    assert tta.first_reach(curve, 96.0) is None
    assert tta.dense_target([97.0, 98.0, 96.0], "none") == 97.0
    assert tta.dense_target([97.0, 98.0, 96.0], "TopK(0.01)") == 96.5
    assert tta.dense_target([97.0, 98.0, 96.0], "Int8()") == 96.7
    with pytest.raises(ValueError, match="dense_finals"):
        tta.dense_target([], "none")


def test_a_row_is_reached_only_from_its_curve_and_nothing_is_extrapolated():
    args = dict(model="cnn", params=1, framework="torch", workers=4, link="unshaped", link_mbit=None, seed=1,
                measured=True, command="c", steps=40)
    hit = tta.make_row(scheme="none", target=90.0, curve=_curve([80.0, 90.5, 91.0, 92.0]), **args)
    assert set(tta.FIELDS) <= set(hit) and hit["reached"]
    assert (hit["steps_to_target"], hit["time_to_target_s"], hit["wire_bytes_to_target"]) == (20, 2.0, 200)
    assert hit["final_accuracy"] == 92.0
    miss = tta.make_row(scheme="none", target=93.0, curve=_curve([80.0, 90.5, 91.0, 92.0]), **args)
    assert not miss["reached"] and miss["time_to_target_s"] is None and miss["budget_steps"] == 40


def test_combined_curve_charges_the_start_up_and_the_dense_warmup_at_dense_step_time():
    curve = _curve([50.0, 60.0, 70.0])
    out = tta.combined_curve(curve, 15, 2.0, 0.5)
    assert [p["time_s"] for p in out] == [20.0, 30.0 + 2.5, 30.0 + 7.5]
    assert [p["accuracy"] for p in out] == [50.0, 60.0, 70.0]
    charged = tta.combined_curve(curve, 15, 2.0, 0.5, traces=[(0, 7.0)])
    assert [p["time_s"] for p in charged] == [27.0, 39.5, 44.5]
    # a retrace at step index 12 (the epoch's short batch) is charged from the first point past it
    retraced = tta.combined_curve(curve, 15, 2.0, 0.5, traces=[(0, 7.0), (12, 3.0)])
    assert [p["time_s"] for p in retraced] == [27.0, 42.5, 47.5]
    assert tta.trace_steps({"step_times_s": [7.5, 0.04, 0.05, 0.06], "median_step_s": 0.05}) == [(0, pytest.approx(7.45))]
    assert tta.trace_steps({"step_times_s": [], "median_step_s": None}) == []


def test_trace_steps_are_the_first_and_every_step_of_five_medians_or_more():
    rec = {"step_times_s": [5.0, 0.05, 0.06, 0.05, 0.24, 0.05, 2.05, 0.05], "median_step_s": 0.05}
    got = tta.trace_steps(rec)
    assert [i for i, _ in got] == [0, 6]  # 0.24 s is under five medians: a slow step, not a trace
    assert [s for _, s in got] == pytest.approx([4.95, 2.0])
    assert sum(s for _, s in got) == pytest.approx(6.95)
    assert tta.dense_phase_steps("TopK(0.01)", "cnn", 32) == 32
    assert tta.dense_phase_steps("DGC(0.001)", "transformer", 32) == 2 * 32 + 4 * 32
    assert tta.dense_phase_steps("Auto()", "cnn", 32) == 0


def test_curves_launch_once_per_step_budget_the_models_first():
    calls = []
    ses = tta.Session(None, {"model": "transformer", "steps": 640, "threads": 1}, "/tmp", None)
    ses.launch = lambda label, schemes, seeds, compute_steps=0, steps=None: (
        calls.append((label, schemes, steps)) or [{"scheme": s, "steps": steps} for s in schemes])
    recs = ses.launch_budgets("curves", ["TopK(0.01)", "none", "DGC(0.001)", "BF16()", "Auto()"], [1],
                              compute_steps=3)
    # Auto may plan a sparsifier: it trains their budget
    assert calls == [("curves", ["none", "BF16()"], 640),
                     ("curves, 1280 steps", ["TopK(0.01)", "DGC(0.001)", "Auto()"], 1280)]
    assert {r["scheme"]: r["steps"] for r in recs} == {"none": 640, "BF16()": 640, "TopK(0.01)": 1280,
                                                       "DGC(0.001)": 1280, "Auto()": 1280}


def test_the_table_gives_speedups_at_the_schemes_target_and_names_missing_cells():
    args = dict(model="cnn", params=1, framework="torch", workers=4, link="unshaped", link_mbit=None, seed=1,
                measured=True, command="c", steps=40)
    rows = [tta.make_row(scheme="none", target=90.0, curve=_curve([85.0, 89.6, 90.2], seconds=2.0), **args),
            tta.make_row(scheme="TopK(0.01)", target=89.5, curve=_curve([85.0, 89.6, 90.2], seconds=1.0), **args),
            tta.make_row(scheme="EFSignSGD()", target=89.0, curve=_curve([85.0, 86.0], seconds=1.0), **args)]
    cells = {c["scheme"]: c for c in tta.speedups(rows)}
    assert cells["TopK(0.01)"]["time_s"] == 2.0 and cells["TopK(0.01)"]["vs_none"] == pytest.approx(2.0)
    assert cells["EFSignSGD()"]["time_s"] is None
    text = tta.markdown(rows)
    assert "not reached (0/1 seeds)" in text and "2.0 s, 2.00x" in text
    # the same model at 2 ranks is a table of its own: no cell mixes rank counts
    two = [dict(r, workers=2, curve=_curve([80.0, 85.0, 90.5], seconds=1.0)) for r in rows[:2]]
    cells = {(c["workers"], c["scheme"]): c for c in tta.speedups(rows + two)}
    assert cells[(4, "TopK(0.01)")]["vs_none"] == pytest.approx(2.0) and cells[(2, "TopK(0.01)")]["time_s"] == 3.0
    both = tta.markdown(rows + two)
    assert "**torch cnn, 2 ranks**" in both and "**torch cnn, 4 ranks**" in both


def test_splice_puts_a_later_runs_cells_in_place_and_can_hold_them_to_the_tables_targets(tmp_path, capsys):
    """A later run's cells replace the table's rows of the same cells where they stood; with
    keep_targets they are held to the table's own dense target, their reach read again."""
    args = dict(model="cnn", params=1, framework="torch", workers=4, link="unshaped", link_mbit=None,
                measured=True, command="c", steps=40)
    table = [tta.make_row(scheme="none", seed=1, target=90.0, curve=_curve([85.0, 90.0]), **args),
             tta.make_row(scheme="Auto()", seed=1, target=89.5, curve=_curve([80.0, 81.0]), **args),
             tta.make_row(scheme="TopK(0.01)", seed=1, target=89.5, curve=_curve([89.0, 89.6]), **args)]
    later = [tta.make_row(scheme="none", seed=1, target=91.0, curve=_curve([85.0, 91.0]), **args),
             tta.make_row(scheme="Auto()", seed=1, target=90.5, curve=_curve([89.7, 90.6]), **args),
             tta.make_row(scheme="Auto()", seed=2, target=90.5, curve=_curve([88.0, 90.4]), **args)]
    out = tta.splice_rows(table, later, "Auto()", source="later.json")
    assert [(r["scheme"], r["seed"]) for r in out] == [("none", 1), ("Auto()", 1), ("Auto()", 2), ("TopK(0.01)", 1)]
    assert out[0] is table[0] and out[1]["target"] == 90.5 and out[1]["steps_to_target"] == 20
    assert out[1]["spliced_from"] == "later.json" and "spliced_from" not in later[1]
    held = tta.splice_rows(table, later, ["Auto()"], keep_targets=True)
    assert [r["target"] for r in held[1:3]] == [89.5, 89.5] and [r["own_target"] for r in held[1:3]] == [90.5] * 2
    assert [r["steps_to_target"] for r in held[1:3]] == [10, 20] and all(r["reached"] for r in held[1:3])
    with pytest.raises(ValueError, match="do not splice none"):
        tta.splice_rows(table, later, keep_targets=True)
    with pytest.raises(ValueError, match="no row of the schemes"):
        tta.splice_rows(table, later, "DGC(0.001)")
    # the command: --out rewritten in place
    src, dest = tmp_path / "later.json", tmp_path / "tta.json"
    src.write_text(json.dumps(later))
    dest.write_text(json.dumps(table))
    from hvd_compress.tools.cli import main
    assert main(["bench", "tta", "--splice", str(src), "--splice-schemes", "Auto()", "--keep-targets",
                 "--out", str(dest)]) == 0
    assert json.loads(dest.read_text())[2]["steps_to_target"] == 20
    # the table's plot, drawn again from its rows
    png = tmp_path / "cnn.png"
    assert main(["bench", "tta", "--report", "--out", str(dest), "--model", "cnn", "--png", str(png)]) == 0
    assert png.stat().st_size > 1000
    with pytest.raises(SystemExit):
        main(["bench", "tta", "--report", "--out", str(dest), "--model", "charlm", "--png", str(png)])
    assert "no rows of torch charlm at 4 ranks" in capsys.readouterr().err


def test_join_adds_the_seeds_a_table_lacks_and_targets_them_all_from_every_dense_seed():
    """A run in two sittings: seed 1 first, seeds 2 and 3 later (and a scheme seed 1 lacked);
    every row is then held to the median of all three dense seeds, less its tolerance."""
    args = dict(model="charlm", params=1, framework="torch", workers=4, link="unshaped", link_mbit=None,
                measured=True, command="c", steps=40)
    first = [tta.make_row(scheme="none", seed=1, target=46.0, curve=_curve([40.0, 46.0]), **args),
             tta.make_row(scheme="TopK(0.01)", seed=1, target=45.5, curve=_curve([45.2, 45.9]), **args),
             tta.make_row(scheme="none", seed=1, target=97.0, curve=_curve([90.0, 97.0]), **dict(args, model="cnn"))]
    later = [tta.make_row(scheme="none", seed=s, target=45.0, curve=_curve([40.0, a]), **args)
             for s, a in ((1, 44.0), (2, 45.0), (3, 47.0))]
    later += [tta.make_row(scheme="TopK(0.01)", seed=2, target=44.5, curve=_curve([45.2, 45.4]), **args),
              tta.make_row(scheme="hvd_fp16", seed=2, target=44.7, curve=_curve([45.9, 46.0]), **args)]
    out = tta.join_rows(first, later, source="later.json")
    assert [(r["model"], r["scheme"], r["seed"]) for r in out] == [
        ("charlm", "none", 1), ("charlm", "TopK(0.01)", 1), ("cnn", "none", 1),
        ("charlm", "none", 2), ("charlm", "none", 3), ("charlm", "TopK(0.01)", 2), ("charlm", "hvd_fp16", 2)]
    charlm = [r for r in out if r["model"] == "charlm"]
    # dense's finals 46 (seed 1 of the first sitting: its row is kept), 45, 47: the median 46
    assert {r["scheme"]: r["target"] for r in charlm} == {"none": 46.0, "TopK(0.01)": 45.5, "hvd_fp16": 45.7}
    assert [r["reached"] for r in charlm] == [True, True, False, True, False, True]
    assert out[2] is first[2] and out[3]["joined_from"] == "later.json" and out[5]["own_target"] == 44.5
    with pytest.raises(ValueError, match="in the table already"):
        tta.join_rows(out, later)


def test_the_mapping_table_says_which_cluster_each_link_stands_for():
    run = {"model": "cnn", "framework": "torch", "workers": 4, "compute_s": 0.05, "latency_s": 1e-4,
           "link_mapping": {"1gbit": {"stands_for": "resnet50 on 8xA100 at 1gbit", "target_ratio": 13.8,
                                      "link_mbit": 21.5, "ratio_at_link": 13.8},
                            "100gbit": {"stands_for": "resnet50 on 8xA100 at 100gbit", "target_ratio": 0.17,
                                        "link_mbit": None, "ratio_at_link": 0.9}}}
    lines = tta.mapping_markdown([run]).splitlines()
    assert "| cnn | torch | 4 | 50 ms | 100 us | 1gbit | resnet50 on 8xA100 at 1gbit | 13.8 | 21.5 | 13.8 |" in lines
    assert any("unshaped (none reaches it)" in x for x in lines)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="must include 'none'"):
        tta.run(schemes="TopK(0.01)")
    with pytest.raises(ValueError, match="links must be"):
        tta.run(schemes="none", links="2gbit")
    with pytest.raises(ValueError, match="has no recipe"):
        tta.run(schemes="none,TopK(0.2)")


def test_rates_from_takes_the_last_matching_runs_mapping_and_names_what_is_missing(tmp_path):
    def run(model, mbit):
        return {"model": model, "framework": "torch", "workers": 4,
                "link_mapping": {"1gbit": {"stands_for": "x", "link_mbit": mbit}}}
    meta = tmp_path / "tta.meta.json"
    unshaped_only = {"model": "cnn", "framework": "torch", "workers": 4, "link_mapping": {}}
    meta.write_text(json.dumps([run("cnn", 11.1), run("charlm", 42.8), run("cnn", 17.0), unshaped_only]))
    # a later run of the unshaped link alone maps nothing: the last run that maps the link is taken
    got = tta.saved_link_mapping(str(meta), "cnn", "torch", 4, ["unshaped", "1gbit"])
    assert got == {"1gbit": {"stands_for": "x", "link_mbit": 17.0}}
    with pytest.raises(ValueError, match=r"rates_from: .* no run of torch cnn at 4 ranks mapping the links \['10gbit'\]"):
        tta.saved_link_mapping(str(meta), "cnn", "torch", 4, ["unshaped", "10gbit"])
    with pytest.raises(ValueError, match="no run of tensorflow cnn"):
        tta.saved_link_mapping(str(meta), "cnn", "tensorflow", 4, ["1gbit"])


def test_auto_runs_with_its_momentum_in_the_compressor_and_the_recipes_warmup():
    """As Auto's docstring advises: the optimizer's momentum at 0, the compressor's at 0.9;
    the lossy recipes' dense warmup (an epoch) and dense small tensors; timing runs no warmup."""
    from hvd_compress.tools.bench.tta_worker import MOMENTUM, build_compression
    comp, placement, _ = build_compression("Auto()", "cnn", 32, "torch", seed=1)
    assert placement == "compressor"
    assert comp.feedback_memory is not None and comp.dense_memory is not None
    assert MOMENTUM == 0.9
    assert (comp.warmup_steps, comp.dense_below) == (32, 1024)
    timed, _, _ = build_compression("Auto()", "transformer", 32, "torch", seed=1, timing=True)
    assert (timed.warmup_steps, timed.dense_below) == (0, 2048)


def test_any_auto_spec_runs_under_autos_recipe_with_its_own_arguments():
    """``Auto(include_sign=True)`` gets the same recipe as ``Auto()`` (its arguments win where they
    overlap), trains on every link as Auto does, and is held to Auto's tolerance."""
    from hvd_compress.tools.bench import tta
    from hvd_compress.tools.bench.specs import keyword_args
    from hvd_compress.tools.bench.tta_worker import build_compression
    from hvd_compress.tools.recipes import is_auto_spec, tolerance_of
    comp, placement, _ = build_compression("Auto(include_sign=True, warmup_steps=5)", "cnn", 32, "torch")
    assert placement == "compressor" and (comp.warmup_steps, comp.dense_below) == (5, 1024)
    assert "EFSignSGD" in [c.label for c in comp.candidates]
    assert is_auto_spec("Auto(include_sign=True)") and is_auto_spec("Auto()") and not is_auto_spec("TopK(0.01)")
    assert tta.dense_phase_steps("Auto(include_sign=True)", "cnn", 32) == 0
    assert tolerance_of("Auto(include_sign=True)") == tolerance_of("Auto()") == 0.5
    assert keyword_args("Auto(include_sign=True)") == {"include_sign": True} and keyword_args("Int8") == {}
    with pytest.raises(ValueError, match="must be Python literals"):
        keyword_args("Auto(rules=[Rule()])")


def test_tta_smoke_two_ranks(tmp_path):
    cluster = cluster_or_skip("ttat")
    out = tmp_path / "tta.json"
    rows, meta = tta.run(model="cnn", schemes="none,TopK(0.01),Auto()", seeds="1", links="unshaped", workers=2, steps=12,
                         eval_every=4, prefix="ttat", out_json=str(out), out_png=str(tmp_path / "tta.png"),
                         run_timeout=150, progress=False, command="test")
    assert not meta["failures"], meta["failures"]
    data = json.loads(out.read_text())
    assert [(r["scheme"], r["link"], r["measured"]) for r in data] == [("none", "unshaped", True),
                                                                        ("TopK(0.01)", "unshaped", True),
                                                                        ("Auto()", "unshaped", True)]
    assert data[2]["auto_plan"] == {} and "auto_plan" not in data[0]  # 12 steps: inside Auto's warmup
    # what each planned weight warmed up with (dense or a quantizer), and no trial before the first plan
    assert sorted(data[2]["auto_warmup"]) == ["conv2.weight", "fc1.weight", "fc2.weight"]
    assert set(data[2]["auto_warmup"].values()) <= {"none", "FP16", "Int8", "FP16/two_phase", "Int8/two_phase"}
    assert data[2]["auto_trials"] == [] and "auto_warmup" not in data[0]
    for r in data:
        assert set(tta.FIELDS) <= set(r)
        assert r["workers"] == 2 and r["framework"] == "torch" and 200_000 < r["params"] < 230_000
        assert r["pinned_cores"] is True  # each rank bound to a core, by default
        assert [p["step"] for p in r["curve"]] == [4, 8, 12]
        assert all(p["wire_bytes"] > 0 and p["time_s"] > 0 for p in r["curve"])
        first = next((p for p in r["curve"] if p["accuracy"] >= r["target"]), None)
        assert r["reached"] == (first is not None)
        assert r["steps_to_target"] == (first and first["step"])
        assert r["final_accuracy"] == r["curve"][-1]["accuracy"]
    assert data[0]["target"] == data[0]["final_accuracy"]  # one dense seed: its own final accuracy
    assert data[1]["target"] == pytest.approx(data[0]["final_accuracy"] - 0.5)
    assert meta["compute_s"] > 0 and (tmp_path / "tta.png").exists() and meta["pinned_cores"] is True
    assert json.loads((tmp_path / "tta.meta.json").read_text())[0]["command"] == "test"
    assert "ttat" not in cluster.existing_clusters()


def test_a_launch_binds_its_ranks_unless_told_not_to_and_rows_say_so(tmp_path):
    class Ran:
        returncode, stdout, stderr = 0, "", ""

    class FakeCluster:
        iface = "eth0"

        def __init__(self):
            self.argv = []

        def horovodrun_command(self, cmd, **kw):
            return list(cmd)

        def run(self, host, argv, **kw):
            self.argv.append(argv)
            return Ran()

    for pin in (True, False):
        c = FakeCluster()
        a = {"framework": "torch", "model": "cnn", "workers": 2, "threads": 1, "run_timeout": 10, "steps": 4,
             "eval_every": 2, "pin_cores": pin}
        tta.Session(c, a, str(tmp_path), None).launch("x", ["none"], [1])
        assert ("--pin-cores" in c.argv[0]) is pin
    args = dict(model="cnn", params=1, framework="torch", workers=4, link="unshaped", link_mbit=None, seed=1,
                scheme="none", target=90.0, curve=_curve([91.0]), measured=True, command="c", steps=10)
    assert tta.make_row(pinned_cores=True, **args)["pinned_cores"] is True
    assert "pinned_cores" not in tta.make_row(**args)
