"""hvd-compress bench link-change (hvd_compress/tools/bench/link_change.py)."""
import pytest

from hvd_compress.tools.bench.link_change import verdicts


def test_link_change_verdicts_judge_auto_against_topk_in_the_same_run():
    auto = "Auto(recheck_every=10)"
    rows = [{"scheme": auto, "recheck_step": 17, "replan_step": 17, "median_after_recheck_s": 0.25},
            {"scheme": "TopK(0.01)", "median_after_s": 0.23}, {"scheme": "none", "median_after_s": 5.9}]
    v = verdicts(rows, auto, change_at=10, recheck_every=10)
    assert v["rechecked_within_recheck_period"] == {"lag_steps": 7, "recheck_every": 10, "new_plan_at": 17,
                                                    "met": True}
    assert v["after_recheck_within_1.2x_of_topk"]["ratio"] == pytest.approx(0.25 / 0.23)
    assert v["after_recheck_within_1.2x_of_topk"]["met"]
    late = [dict(rows[0], recheck_step=None, median_after_recheck_s=None), rows[1]]
    v = verdicts(late, auto, change_at=10, recheck_every=10)
    assert not v["rechecked_within_recheck_period"]["met"] and not v["after_recheck_within_1.2x_of_topk"]["met"]
    assert verdicts(rows[1:], auto, 10, 10) == {}  # no Auto row: nothing to judge
