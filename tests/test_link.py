"""The alpha-beta link model and its command-line spelling."""

import pytest

from quietsync.link import LinkModel, parse_links, traffic


def test_ring_traffic_formulas():
    assert traffic("all_reduce", 1000, 4) == (6, 1500)
    assert traffic("reduce_scatter", 1000, 4) == (3, 750)
    assert traffic("all_gather", 1000, 4) == (3, 750)
    assert traffic("all_reduce", 1000, 1) == (0, 0)
    assert traffic("send", 1000, 2) == (1, 1000)


def test_modeled_time_is_latency_plus_bytes_over_bandwidth():
    link = LinkModel.parse("100mbit,5ms")
    assert link.bandwidth == pytest.approx(12.5e6)
    assert link.latency == pytest.approx(0.005)
    assert link.time("all_reduce", 10_000_000, 2) == pytest.approx(2 * 0.005 + 10_000_000 / 12.5e6)


def test_link_is_fifo():
    link = LinkModel(1000.0, 0.0)
    assert link.reserve(1.0, start=10.0) == 11.0
    assert link.reserve(1.0, start=10.5) == 12.0  # queued behind the first
    assert link.reserve(1.0, start=20.0) == 21.0
    assert link.book(1.0, start=20.5) == (21.0, 22.0)  # (start on the wire, finish)


def test_parse_links_cli_spelling():
    links = parse_links(["inter=100mbit,5ms", "intra=10gbit,0.05ms"])
    assert links["inter"].bandwidth == pytest.approx(12.5e6)
    assert links["intra"].latency == pytest.approx(5e-5)
    assert parse_links(["inter=1gbit"])["inter"].latency == 0


@pytest.mark.parametrize("spec,match", [
    ("wan=1gbit", "--link must look like"),
    ("inter", "--link must look like"),
    ("inter=fast", "bandwidth must be a number with a unit"),
    ("inter=100mbit,soon", "latency must be a number with a unit"),
    ("inter=0mbit", "bandwidth must be > 0"),
])
def test_bad_link_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_links([spec])


def test_same_link_twice():
    with pytest.raises(ValueError, match="given twice"):
        parse_links(["inter=1gbit", "inter=2gbit"])


def test_link_is_full_duplex_collectives_book_both_directions():
    link = LinkModel(1000.0, 0.0)
    assert link.reserve(1.0, start=10.0, tx=True, rx=False) == 11.0  # a send
    assert link.reserve(1.0, start=10.0, tx=False, rx=True) == 11.0  # a receive at the same time overlaps
    assert link.reserve(1.0, start=10.0, tx=True, rx=False) == 12.0  # a second send queues behind the first
    assert link.reserve(1.0, start=10.0) == 13.0  # a collective waits for both queues and holds both
    assert link.reserve(1.0, start=10.0, tx=False, rx=True) == 14.0
    link.reset()
    assert link.reserve(1.0, start=0.0, tx=False, rx=True) == 1.0
    with pytest.raises(ValueError, match="at least one of tx and rx"):
        link.reserve(1.0, tx=False, rx=False)
