"""hvd-compress bench breakdown (hvd_compress/tools/bench/breakdown.py)."""
import json

import pytest

from hvd_compress.tools.bench.breakdown import parse_timeline


def test_step_breakdown_reads_horovods_timeline(tmp_path):
    """bench breakdown: negotiation and execution spans summed by
    op, activities by name, cycles counted, from a timeline as Horovod leaves
    it (the array unclosed, a trailing comma)."""
    events = [{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "w"}},
              {"name": "CYCLE_START", "ph": "i", "ts": 0, "s": "g"},
              {"name": "NEGOTIATE_ALLGATHER", "ph": "B", "ts": 100, "pid": 1},
              {"name": "0", "ph": "X", "ts": 150, "pid": 1, "dur": 0},
              {"ph": "E", "ts": 400, "pid": 1},
              {"name": "ALLGATHER", "ph": "B", "ts": 400, "pid": 1},
              {"name": "GLOO_ALLGATHER", "ph": "B", "ts": 410, "pid": 1},
              {"ph": "E", "ts": 1410, "pid": 1},
              {"ph": "E", "ts": 1500, "pid": 1},
              {"name": "CYCLE_START", "ph": "i", "ts": 2000, "s": "g"},
              {"name": "NEGOTIATE_ALLREDUCE", "ph": "B", "ts": 2000, "pid": 2},
              {"ph": "E", "ts": 2100, "pid": 2},
              {"name": "ALLREDUCE", "ph": "B", "ts": 2100, "pid": 2},
              {"ph": "E", "ts": 2600, "pid": 2}]
    path = tmp_path / "timeline.json"
    path.write_text("[\n" + "".join(json.dumps(e) + ",\n" for e in events))
    got = parse_timeline(str(path))
    assert got["cycles"] == 2
    assert got["negotiate"] == pytest.approx({"ALLGATHER": 300e-6, "ALLREDUCE": 100e-6})
    assert got["execute"] == pytest.approx({"ALLGATHER": 1100e-6, "ALLREDUCE": 500e-6})
    assert got["activity"] == pytest.approx({"GLOO_ALLGATHER": 1000e-6})
    assert got["collectives"] == {"ALLGATHER": 1, "ALLREDUCE": 1}
