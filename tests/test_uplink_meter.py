"""UplinkMeter (net/uplink.py): the rank's uplink speed from acknowledged bytes, and the in-flight
budget that follows. Pure arithmetic: fed by hand here."""

from __future__ import annotations

import pytest

from fttree.net.uplink import INITIAL_BUDGET_BYTES, POLL_MIN_S, QUEUE_TARGET_S, SLICE_S, UplinkMeter


def feed(meter: UplinkMeter, link_bytes_per_s: float, rtt_s: float, slices: int, start: float = 0.0) -> float:
    """Busy slices in which the rank sends what the budget lets out: a budget's worth every
    round trip (at least the transport's 2 ms poll), or the link's rate if that is less."""
    now = start
    for _ in range(slices):
        per_s = min(link_bytes_per_s, meter.budget() / max(rtt_s, POLL_MIN_S))
        now += SLICE_S
        meter.add(SLICE_S, int(per_s * SLICE_S), now)
    return now


def test_a_fast_link_is_not_paced_by_what_the_first_budget_let_through() -> None:
    """On loopback 32 KB every 2 ms reads as 16 MB/s: a lower bound while the budget holds the
    rank back. Reported as a link rate it started a pace round at 15.5 MB/s on loopback (a
    training job's buckets then travelled cut for a 125 Mbit/s link)."""
    meter = UplinkMeter()
    meter.saw_rtt(50e-6)
    feed(meter, 1e9, 50e-6, 1)
    assert meter.rate == pytest.approx(INITIAL_BUDGET_BYTES / 0.002)
    assert meter.link_rate == 0.0  # the budget, not the link
    assert meter.budget() > 10 * INITIAL_BUDGET_BYTES  # and it grows from there
    feed(meter, 1e9, 50e-6, 4, start=1.0)
    assert meter.link_rate == pytest.approx(1e9)
    assert meter.budget() == pytest.approx(1e9 * (50e-6 + QUEUE_TARGET_S), rel=1e-3)


@pytest.mark.parametrize("mbit", [1, 10, 100])
def test_a_slow_link_is_measured_at_once(mbit: float) -> None:
    """Behind a slow uplink the budget's bytes wait in the link's queue: the link limits the
    rate from the first slice, and the budget settles near rate x (min_rtt + 50 ms)."""
    rate = mbit * 1e6 / 8
    meter = UplinkMeter()
    meter.saw_rtt(0.001)
    feed(meter, rate, 0.001, 4)
    assert meter.link_rate == pytest.approx(rate)
    assert meter.budget() == pytest.approx(max(rate * (0.001 + QUEUE_TARGET_S), 16 * 1024), rel=1e-3)


def test_a_budget_that_holds_the_rank_back_grows_at_every_sample() -> None:
    """The transport samples every 50 ms; on loopback a 1.63 MB step is busy for milliseconds,
    so waiting for a whole 0.2 s slice kept the first budget for dozens of steps (1.63 MB steps
    took 1.2x as long). While the budget is the limit, each sample grows it."""
    meter = UplinkMeter()
    meter.saw_rtt(50e-6)
    budgets = [meter.budget()]
    for i in range(3):
        meter.add(0.05, int(meter.budget() / POLL_MIN_S * 0.05), 0.05 * (i + 1))
        budgets.append(meter.budget())
    assert budgets[1] > 10 * budgets[0], budgets  # 32 KB every 2 ms: 16 MB/s, grown to 0.8 MB at once
    assert budgets[2] > 10 * budgets[1], budgets  # and again, until the link or the cap limits it
    assert budgets[3] <= 64 * 1024 * 1024
    assert meter.link_rate == 0.0


def test_a_socket_closed_under_us_has_no_counters_and_raises_nothing() -> None:
    """uvloop's socket object for a connection whose descriptor was closed raises ValueError
    (a negative file descriptor); escaping, it once cut short the actions of a step."""
    import socket

    from fttree.net.uplink import tcp_counters

    class Closed:
        def getsockopt(self, *args: object) -> bytes:
            raise ValueError("negative file descriptor")

    assert tcp_counters(Closed()) is None  # type: ignore[arg-type]
    sock = socket.socket()
    sock.close()
    assert tcp_counters(sock) is None
