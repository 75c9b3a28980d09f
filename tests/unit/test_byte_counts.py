"""Unit tests of :mod:`hvd_compress.byte_counts`: what ``per_tensor()`` and ``totals()``
report, for eager callers (one ``record`` per communication) and for graph callers
(live counters: ``record`` runs per trace, the graph updates variables)."""
import math

from hvd_compress.byte_counts import CompressionStats


class Live:
    """Stands in for a tf.Variable: something with ``.numpy()`` read at report time."""

    def __init__(self, value):
        self.value = value

    def numpy(self):
        return self.value


def test_eager_records_count_calls_and_keep_the_latest():
    stats = CompressionStats()
    stats.record("w", "TopK", 400, 40)
    stats.record("w", "TopK", 400, 44)
    stats.record("b", "FP16", 8, 4)
    assert stats.per_tensor() == {
        "w": {"scheme": "TopK", "dense_fp32_bytes": 400, "payload_bytes": 44, "calls": 2},
        "b": {"scheme": "FP16", "dense_fp32_bytes": 8, "payload_bytes": 4, "calls": 1},
    }
    assert stats.totals() == {"tensors": 2, "dense_fp32_bytes": 408, "payload_bytes": 48, "ratio": 408 / 48}


def test_graph_records_read_live_values_not_the_number_of_traces():
    """A schedule traces two branches (two ``record`` calls) and then runs 8 steps: calls,
    bytes and the scheme's name come from the live values the graph set."""
    stats = CompressionStats()
    names, which, nbytes, calls = ["NoCompression", "TopK"], Live(0), Live(0), Live(0)
    for _ in names:  # trace time: every branch records
        stats.record("w", lambda: names[which.numpy()], 400, nbytes, calls=calls)
    for step in range(8):  # run time: the branch that runs sets the values
        which.value, nbytes.value, calls.value = (0, 404, step + 1) if step < 3 else (1, 44, step + 1)
        row = stats.per_tensor()["w"]
        assert (row["scheme"], row["payload_bytes"], row["calls"]) == (names[which.value], nbytes.value, step + 1)
    assert stats.per_tensor()["w"] == {"scheme": "TopK", "dense_fp32_bytes": 400, "payload_bytes": 44, "calls": 8}


def test_empty_and_reset():
    stats = CompressionStats()
    assert stats.per_tensor() == {}
    assert math.isnan(stats.totals()["ratio"])
    stats.record("w", "Int8", 400, 104)
    stats.reset()
    assert stats.per_tensor() == {}
