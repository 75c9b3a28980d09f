"""Links that stand for real clusters (:mod:`hvd_compress.tools.link_mapping`)."""
import pytest

from hvd_compress.tools import link_mapping as L


def test_the_rate_gives_the_ratio():
    m = L.link_for_ratio(2.0, lambda mbit: 1.0 + 100.0 / mbit, 1.0, "x")
    assert m.link_mbit == pytest.approx(100.0, rel=1e-3)
    assert m.ratio_at_link == pytest.approx(2.0, rel=1e-3)


def test_no_rate_when_latency_alone_exceeds_the_ratio():
    m = L.link_for_ratio(0.5, lambda mbit: 1.0 + 100.0 / mbit, 1.0, "x")
    assert m.link_mbit is None and "unshaped" in m.why


def test_reference_ratios_fall_with_the_rate_and_bert_is_more_communication_bound():
    for ref in L.REFERENCE_MODELS:
        r = [L.reference_ratio(ref, g) for g in (1, 10, 100)]
        assert r[0] > r[1] > r[2] > 0
    assert L.reference_ratio("bert-large", 10) > L.reference_ratio("resnet50", 10)
    with pytest.raises(ValueError, match="model must be one of"):
        L.reference_ratio("vgg", 10)


def test_map_links_reproduces_each_reference_ratio():
    numels = [1_000_000, 1000, 4_000_000]
    out = L.map_links(numels, 4, 0.5, 1e-4, links=("1gbit", "10gbit"), machine=L.emulated_machine(4, cpus=4))
    for ref, links in out.items():
        for link, m in links.items():
            assert m.link_mbit is not None
            assert m.ratio_at_link == pytest.approx(L.reference_ratio(ref, L.REFERENCE_GBIT[link]), rel=0.01)
    with pytest.raises(ValueError, match="link must be one of"):
        L.map_links(numels, 4, 0.5, 1e-4, links=("2gbit",))
