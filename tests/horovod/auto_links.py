"""The emulated links and fixed codec costs of the Auto tests (torch and TF):
a stand-in for Auto's link probe that reports a chosen sequence of links (on
a host whose ranks each have a core, whatever this machine has), and
codec costs given to ``Auto(codec_costs=...)`` instead of timed, so a test
decides everything the planner sees and its outcome does not depend on how
fast the machine runs at that moment."""
from hvd_compress.auto import comm_time, default_candidates
from hvd_compress.costmodel.model import LINK_ONLY

#: 1 ns an element for every lossy candidate, none free.  With the tests'
#: 64x512 weight (32768 elements, 128 KB) and links: on the fast link
#: (1 us, 1 TB/s) none's allreduce takes 2 (N-1) us + 0.1 us and the cheapest
#: lossy candidate's codec alone 33 us, so none wins by 8x at N <= 3; on the
#: slow link (100 us, 1 MB/s) none's allreduce takes 131 ms or more and Int8's
#: payload a quarter of it, so compression wins by 3x.
CODEC_COSTS = {c.label: 1e-9 for c in default_candidates()[1:]}


def links(sequence, monkeypatch, module, size):
    """Make the i-th link probe of ``module`` (``hvd_compress.auto.calibration`` or
    ``hvd_compress.auto.tf_auto``) report the i-th link of ``sequence`` (the last one after) for
    a world of ``size`` ranks; returns the list of probed plan versions."""
    calls = []

    def probe(numels, version, process_set):
        link = sequence[min(len(calls), len(sequence) - 1)]
        calls.append(version)
        return [comm_time("allreduce", 4 * n, size, link.bytes_per_s, link.latency_s)[1] for n in numels]
    monkeypatch.setattr(module, "probe_link", probe)
    # the host, too: every rank a core of its own, however many share this machine's
    monkeypatch.setattr(module, "host_machine", lambda *a: LINK_ONLY)
    return calls


def early_link(link, monkeypatch, module, size):
    """Make the early probe of ``module`` report ``link`` (for a world of ``size`` ranks)."""
    def probe(numels, process_set):
        return [comm_time("allreduce", 4 * n, size, link.bytes_per_s, link.latency_s)[1] for n in numels]
    monkeypatch.setattr(module, "probe_early", probe)


def misread_plan_on(rank, this_rank, auto, monkeypatch):
    """On ``rank`` only, make ``auto`` read the broadcast plan wrongly (every
    ``none`` becomes Int8 and everything else ``none``): a forced disagreement."""
    if this_rank != rank:
        return
    original = auto.labels_from_indices
    monkeypatch.setattr(auto, "labels_from_indices",
                        lambda keys, idx: {k: ("Int8" if v == "none" else "none")
                                           for k, v in original(keys, idx).items()})


def probe_with_clocks_apart(hvd, module, probe_name, monkeypatch):
    """Run ``module``'s (``calibration`` or ``tf_auto``) early probe or a
    decision's (``probe_name``: ``"probe_early"`` or ``"probe_link"``, version
    "7") over sizes 1024 and 4096 while rank 1's clock reads every allreduce as
    1 s and rank 0's as what it took; returns (the collective names this rank
    issued, their prefix, the seconds the probe returned)."""
    import types
    from hvd_compress.auto import probe
    names, real = [], hvd.allreduce

    def counting(tensor, name=None, **kwargs):
        names.append(name)
        return real(tensor, name=name, **kwargs)
    monkeypatch.setattr(hvd, "allreduce", counting)
    if hvd.rank() == 1:
        ticks = iter(range(100))
        monkeypatch.setattr(probe, "time", types.SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    if probe_name == "probe_early":
        return names, "hvdc.auto.probe_early", module.probe_early((1024, 4096), hvd.global_process_set)
    return names, "hvdc.auto.probe.7", module.probe_link((1024, 4096), "7", hvd.global_process_set)
