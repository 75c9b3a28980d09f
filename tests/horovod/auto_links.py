"""The emulated links of the Auto tests (torch and TF): a stand-in for Auto's
link probe that reports a chosen sequence of links, so a test decides what
Auto measures without shaping a real link."""
from hvd_compress.auto import comm_time


def links(sequence, monkeypatch, module, size):
    """Make the i-th link probe of ``module`` (``auto_calibration`` or
    ``auto_tf``) report the i-th link of ``sequence`` (the last one after) for
    a world of ``size`` ranks; returns the list of probed plan versions."""
    calls = []

    def probe(numels, version, process_set):
        link = sequence[min(len(calls), len(sequence) - 1)]
        calls.append(version)
        return [comm_time("allreduce", 4 * n, size, link.bytes_per_s, link.latency_s)[1] for n in numels]
    monkeypatch.setattr(module, "probe_link", probe)
    return calls


def misread_plan_on(rank, this_rank, auto, monkeypatch):
    """On ``rank`` only, make ``auto`` read the broadcast plan wrongly (every
    ``none`` becomes Int8 and everything else ``none``): a forced disagreement."""
    if this_rank != rank:
        return
    original = auto.labels_from_indices
    monkeypatch.setattr(auto, "labels_from_indices",
                        lambda keys, idx: {k: ("Int8" if v == "none" else "none")
                                           for k, v in original(keys, idx).items()})
