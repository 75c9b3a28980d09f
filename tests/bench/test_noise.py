"""``hvd-compress bench noise``: the spread of one configuration timed twice, read from the
benchmarks' rows, and the tables docs/results/benchmarks.md prints from it."""
import json
import os
import subprocess
import sys

from hvd_compress.tools.bench import noise

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "docs", "results")


def _row(seed, seconds, steps=100, command="c1", scheme="none", measured=True, link="unshaped"):
    return {"model": "cnn", "framework": "torch", "workers": 4, "link": link, "seed": seed, "scheme": scheme,
            "measured": measured, "command": command,
            "curve": [{"step": steps // 2, "time_s": seconds * steps / 2}, {"step": steps, "time_s": seconds * steps}]}


def test_seconds_a_step_is_the_curves_last_time_over_its_steps():
    assert noise.seconds_a_step(_row(1, 0.05)) == 0.05
    assert noise.seconds_a_step({"curve": []}) is None


def test_the_spread_is_of_one_seed_across_runs_and_a_copied_row_counts_once(tmp_path):
    a, b = tmp_path / "tta.json", tmp_path / "tta_more.json"
    a.write_text(json.dumps([_row(1, 0.04, command="c1"), _row(2, 0.10, command="c1"),
                             _row(1, 0.5, command="c1", scheme="TopK(0.01)"),
                             _row(1, 0.9, command="c1", link="1gbit", measured=False)]))
    # tta_more holds c1's seed-1 row again (a splice) and a second run, c2, of both seeds
    b.write_text(json.dumps([_row(1, 0.04, command="c1"), _row(1, 0.10, command="c2"),
                             _row(2, 0.11, command="c2", steps=300)]))
    runs = noise.tta_none_runs([str(a), str(b)])
    assert runs == {("cnn", "torch", 4, "unshaped", False, 1): {"c1": 0.04, "c2": 0.10},
                    ("cnn", "torch", 4, "unshaped", False, 2): {"c1": 0.10, "c2": 0.11}}
    (cell,) = noise.across_runs(runs)
    assert (cell["runs"], cell["seeds"], cell["fastest_s"], cell["slowest_s"]) == (2, [1, 2], 0.04, 0.11)
    assert abs(cell["largest_spread"] - 2.5) < 1e-9 and abs(cell["smallest_spread"] - 1.1) < 1e-9
    # one run only: nothing to compare
    assert noise.across_runs(noise.tta_none_runs([str(a)])) == []
    # ranks bound to cores are another configuration, never compared with unbound ones
    c = tmp_path / "tta_pinned.json"
    c.write_text(json.dumps([{**_row(1, 0.03, command="c3"), "pinned_cores": True}]))
    assert noise.across_runs(noise.tta_none_runs([str(a), str(c)])) == []


def test_within_a_run_only_an_auto_that_planned_every_tensor_dense_counts():
    def r(scheme, step, plan=None, link=None, model="resnet50"):
        return {"model": model, "framework": "torch", "workers": 2, "link_mbit": link, "scheme": scheme,
                "median_step_s": step, "plan": plan}
    rows = [r("none", 2.0), r("Auto()", 2.5, {"none": 161}),
            r("none", 6.0, link=100.0), r("Auto()", 2.0, {"none": 100, "TopK(0.01)": 61}, link=100.0),
            r("Auto()", 1.0, {"none": 10}, model="bert")]  # no none row in its run
    (cell,) = noise.within_runs(rows)
    assert (cell["model"], cell["link_mbit"], cell["ratio"]) == ("resnet50", None, 0.8)


def test_the_command_prints_what_benchmarks_md_shows():
    out = subprocess.run([sys.executable, "-m", "hvd_compress.tools.cli", "bench", "noise", "--results", RESULTS],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout.strip()
    assert "| cnn | torch | 4 | unshaped | no |" in out and "`none` / `Auto()`" in out
    with open(os.path.join(RESULTS, "benchmarks.md")) as f:
        doc = f.read()
    assert out in doc, "benchmarks.md's 'What this machine can tell apart' differs from `hvd-compress bench noise`"
