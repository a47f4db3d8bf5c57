"""The alpha-beta link model and its command-line spelling."""

import pytest

from quietsync.link import LinkModel, idle_links, parse_links, traffic


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
    assert parse_links(["inter=50MB"])["inter"].bandwidth == parse_links(["inter=400mbit"])["inter"].bandwidth


@pytest.mark.parametrize("spec,match", [
    ("wan=1gbit", "--link must look like"),
    ("inter", "--link must look like"),
    ("inter=fast", "bandwidth must be a number with a unit"),
    ("inter=100mbit,soon", "latency must be a number with a unit"),
    ("inter=0mbit", "bandwidth must be > 0"),
    # a small b is bits to some, bytes to others: the unit must say which (8x either way)
    ("inter=100mb", r"bandwidth '100mb' is ambiguous: write 100mbit \(bits per second\) or 100MB"),
    ("inter=1Gb,5ms", "bandwidth '1Gb' is ambiguous"),
    ("inter=100mbit@0s,10mb@60s", "bandwidth '10mb' is ambiguous"),
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


# ---------------------------------------------------------------------------------------------- schedules
def test_schedule_spelling_each_entry_is_a_link_at_a_time():
    link = parse_links(["inter=100mbit,5ms@0s,10mbit@60s,100mbit,1ms@2min"])["inter"]
    assert link.scheduled
    assert [(r.at_s, r.bandwidth, r.latency) for r in link.rates()] == [
        (0.0, pytest.approx(12.5e6), pytest.approx(0.005)),
        (60.0, pytest.approx(1.25e6), pytest.approx(0.005)),  # no latency given: the previous entry's
        (120.0, pytest.approx(12.5e6), pytest.approx(0.001)),
    ]
    assert link.bandwidth == pytest.approx(12.5e6)  # the rate from 0 s (what the planner reads)
    assert str(link) == "100mbit,5ms@0s,10mbit,5ms@60s,100mbit,1ms@120s"
    assert not parse_links(["inter=100mbit"])["inter"].scheduled


@pytest.mark.parametrize("spec,match", [
    ("inter=100mbit@0s,10mbit@60s,100mbit@30s", r"--link inter: schedule goes back in time: '100mbit@30s'.*"
                                                  r"BW\[,LAT\]@TIME"),
    ("inter=100mbit@0s,10mbit@0s", "goes back in time"),
    ("inter=100mbit@0s,0mbit@60s", "bandwidth must be > 0"),
    ("inter=100mbit@5s,10mbit@60s", "must start at @0s"),
    ("inter=100mbit@0s,10mbit", r"--link inter: schedule must be BW\[,LAT\]@TIME"),
    ("inter=100mbit@0s,,10mbit@60s", "schedule must be"),
    ("inter=100mbit,5ms,1ms@0s", "must be BW\\[,LAT\\]@TIME"),
    ("inter=100mbit@0s@1s", "must be BW\\[,LAT\\]@TIME"),
    ("inter=100mbit@soon", "schedule time must be a number with a unit"),
    ("inter=100mbit@0s,fast@60s", "--link inter: bandwidth must be a number"),
])
def test_bad_schedules_are_refused_naming_the_argument_and_the_form(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_links([spec])


def _reference_seconds(rates, start, nbytes, messages):
    """Integrate the piecewise-constant rate by hand, 1 µs at a time: the latency in force at ``start``, then the
    bytes drain at whatever rate is in force at each instant."""
    lat = [lat for at, _, lat in rates if at <= start][-1]
    t, left, dt = start + messages * lat, float(nbytes), 1e-6
    while left > 0:
        bw = [bw for at, bw, _ in rates if at <= t + 1e-12][-1]
        left -= bw * dt
        t += dt
    return t - start


def test_transfer_time_follows_the_schedule_on_an_injected_clock():
    link = LinkModel.parse("1000B,0.1s@0s,100B@2s,1000B,0s@3s")  # 1000 B/s, 100 B/s from 2 s, 1000 B/s from 3 s
    link.start_clock(50.0)  # the run's t = 0 is perf_counter 50 s
    rates = [(r.at_s, r.bandwidth, r.latency) for r in link.rates()]
    # before the drop: 1 message x 0.1 s + 500 B / 1000 B/s
    assert link.book_transfer("send", 500, 2, start=50.0, rx=False) == (50.0, pytest.approx(50.6))
    # straddles the drop at 2 s: starts at 1.5 s, latency 0.1 s, 400 B at 1000 B/s by 2.0 s, the other 100 B at
    # 100 B/s take 1 s -> ends at 3.0 s
    begin, end = link.book_transfer("send", 500, 2, start=51.5, rx=False)
    assert (begin, end) == (51.5, pytest.approx(53.0))
    assert end - begin == pytest.approx(_reference_seconds(rates, 1.5, 500, 1), abs=1e-4)
    # queued behind it (FIFO), served from 3.0 s at the restored rate with the new latency 0
    assert link.book_transfer("send", 500, 2, start=52.0, rx=False) == (pytest.approx(53.0), pytest.approx(53.5))
    # spans two changes: starts at 1.9 s (receive queue is free), 0.1 s latency, then 100 B/s for 1 s, then 1000 B/s
    begin, end = link.book_transfer("recv", 1100, 2, start=51.9, tx=False)
    assert end - begin == pytest.approx(_reference_seconds(rates, 1.9, 1100, 1), abs=1e-4)
    assert end - begin == pytest.approx(0.1 + 1.0 + 1000 / 1000)
    # a collective's modeled time at a moment on an idle link: 2 messages at the 2 s entry's latency (to 2.7 s),
    # 30 B at 100 B/s up to 3 s, the other 970 B at 1000 B/s
    assert link.time("all_reduce", 1000, 2, at=2.5) == pytest.approx(2 * 0.1 + 0.3 + 970 / 1000)
    assert link.time("all_reduce", 1000, 2) == pytest.approx(2 * 0.1 + 1.0)  # no moment: the 0 s rate


def test_a_scheduled_link_needs_its_clock():
    link = LinkModel.parse("100mbit@0s,10mbit@1s")
    with pytest.raises(RuntimeError, match="clock started"):
        link.book_transfer("send", 1000, 2, rx=False)


def test_a_link_prints_in_the_units_a_person_writes_and_parses_back_to_it():
    measured = LinkModel(bandwidth=4702.34e6 / 8, latency=0.369138e-3)  # a probe's floor: six digits mean nothing
    assert str(measured) == "4.702gbit,369.1us"
    assert str(LinkModel.parse("900gbit,2us")) == "900gbit,2us"
    assert str(LinkModel.parse("100mbit,5ms")) == "100mbit,5ms"
    again = LinkModel.parse(str(measured))
    assert again.rate_at(0).bandwidth == pytest.approx(measured.rate_at(0).bandwidth, rel=1e-3)
    assert again.rate_at(0).latency == pytest.approx(measured.rate_at(0).latency, rel=1e-3)


def test_a_link_no_traffic_crosses_is_named_with_the_flag_that_would_use_it():
    # torchrun --nnodes 1: every worker on one node, so nothing crosses inter; the local launcher's default (one
    # worker per node) leaves intra unused
    (inter,) = idle_links(["inter"], nodes=1, workers_per_node=2)
    assert inter.startswith("--link inter emulates the link between nodes") and "--nodes N" in inter
    (intra,) = idle_links(["intra", "inter"], nodes=2, workers_per_node=1)
    assert intra.startswith("--link intra emulates the link inside a node")
    assert idle_links(["inter", "intra"], nodes=2, workers_per_node=2) == []
