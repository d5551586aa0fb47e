"""UplinkMeter (net/uplink.py): the rank's uplink speed from acknowledged bytes, and the in-flight
budget that follows. Pure arithmetic: fed by hand here."""

from __future__ import annotations

import pytest

from fttree.net.uplink import (
    CLEAR_BYTES,
    INITIAL_BUDGET_BYTES,
    MAX_BUDGET_BYTES,
    POLL_MIN_S,
    QUEUE_TARGET_S,
    SLICE_S,
    WINDOW_S,
    LossHistory,
    TcpCounters,
    UplinkMeter,
    ahead_s,
    fast_rto_min,
    lost_nothing,
    stall_found,
    stall_wait_s,
    stalled,
)


def feed(meter: UplinkMeter, link_bytes_per_s: float, rtt_s: float, slices: int, start: float = 0.0) -> float:
    """Busy slices in which the rank sends what the budget lets out: a budget's worth every
    round trip (at least the transport's 2 ms poll), or the link's rate if that is less; a
    queue forms on the path when the link, not the budget, is the limit."""
    now = start
    for _ in range(slices):
        budget_rate = meter.budget() / max(rtt_s, POLL_MIN_S)
        per_s = min(link_bytes_per_s, budget_rate)
        now += SLICE_S
        meter.add(SLICE_S, int(per_s * SLICE_S), now, queued=link_bytes_per_s < budget_rate)
    return now


def test_a_fast_link_is_not_paced_by_what_its_cpu_or_budget_let_through() -> None:
    """On loopback the budget, or a busy CPU (7 workers on 2 cores), limits what is sent, and no
    queue forms on the path: such a rate is no link's. Taken as one, it held a 7-worker
    loopback job to a pace of 23.5 MB/s (its steps twice as long)."""
    meter = UplinkMeter()
    meter.saw_rtt(50e-6)
    for i in range(20):
        meter.add(SLICE_S, int(23.5e6 * SLICE_S), SLICE_S * (i + 1), queued=False)  # CPU-bound, no queue
    assert meter.rate == pytest.approx(23.5e6)
    assert meter.link_rate == 0.0  # nothing to pace by
    assert meter.budget() == INITIAL_BUDGET_BYTES  # a measured rate alone does not shrink or grow it


def test_a_budget_that_holds_the_rank_back_doubles_until_the_cap() -> None:
    """The budget grows as TCP's window does in slow start: doubled each time the link delivered
    all of it with no queue forming. On loopback that takes it from 32 KB to the cap within a
    few milliseconds of the first step (the sampled ramp it replaces kept 0.75 MB, and a
    1.63 MB step took twice as long)."""
    meter = UplinkMeter()
    budgets = [meter.budget()]
    for i in range(16):
        meter.grow(i * 0.01, rtt_s=0.01)
        meter.grow(i * 0.01 + 0.005, rtt_s=0.01)  # not again within the round trip
        budgets.append(meter.budget())
    assert budgets[1] == 2 * budgets[0]
    assert budgets[-1] == MAX_BUDGET_BYTES
    assert meter.link_rate == 0.0


@pytest.mark.parametrize("mbit", [1, 10, 100])
def test_a_slow_link_is_measured_at_once(mbit: float) -> None:
    """Behind a slow uplink the budget's bytes wait in the link's queue: the link limits the
    rate from the first slice, and the budget settles near rate x (min_rtt + 50 ms)."""
    rate = mbit * 1e6 / 8
    meter = UplinkMeter()
    meter.saw_rtt(0.001)
    for i in range(12):  # slow start, until the budget is more than the link carries in a round trip
        meter.grow(i * 0.001, rtt_s=0.001)
    feed(meter, rate, 0.001, 4)
    assert meter.link_rate == pytest.approx(rate)
    assert meter.budget() == pytest.approx(max(rate * (0.001 + QUEUE_TARGET_S), 16 * 1024), rel=1e-3)


def test_a_queue_brings_a_grown_budget_down_to_the_link() -> None:
    """A budget grown to the cap on a fast path (a job that started on a LAN) meets a slow link:
    the queue it fills is seen at once, and the budget comes down to what the link carries."""
    meter = UplinkMeter()
    meter.saw_rtt(0.01)
    for i in range(16):
        meter.grow(i * 0.01, rtt_s=0.01)
    assert meter.budget() == MAX_BUDGET_BYTES
    meter.add(SLICE_S, int(1.25e6 * SLICE_S), SLICE_S, queued=True)  # 10 Mbit/s
    meter.saw_queue()
    assert meter.link_rate == pytest.approx(1.25e6)
    assert meter.budget() == pytest.approx(1.25e6 * (0.01 + QUEUE_TARGET_S), rel=1e-3)


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


# ---- when a silent connection is stalled (uplink.stalled) ---------------------------------------


def counters(*, rtt_s: float = 50e-6, retransmits: int = 0, last_ack_s: float = 0.0, unacked: int = 8,
             total_retrans: int = 0, segs_out: int = 1000, delivery_rate: float = 1e9) -> TcpCounters:
    return TcpCounters(rtt_s=rtt_s, rttvar_s=rtt_s / 2, min_rtt_s=rtt_s, retransmits=retransmits,
                       last_ack_s=last_ack_s, total_retrans=total_retrans, unacked_packets=unacked,
                       segs_out=segs_out, delivery_rate=delivery_rate, snd_mss=1448)


def test_a_cut_lan_link_is_stalled_after_tens_of_milliseconds() -> None:
    """A LAN link that lost nothing: a silence of 60 ms with segments in flight and a
    retransmission timeout in vain is a cut. TCP's own evidence, three timeouts in a row, took
    1.5 s (a 7-worker loopback cut cost 1.6 s a step against 0.1 s before)."""
    c = counters(retransmits=1, last_ack_s=0.06, total_retrans=2)
    assert lost_nothing(counters(total_retrans=3, retransmits=0))  # a few lost segments in a life: no lossy link
    assert stalled(c, silent_s=0.06, clean=True)
    assert not stalled(c, silent_s=0.03, clean=True)  # not yet
    assert not stalled(counters(retransmits=0, last_ack_s=0.06), silent_s=0.06, clean=True)  # no timeout yet
    assert not stalled(counters(retransmits=2, last_ack_s=0.01), silent_s=0.06, clean=True)  # duplicates come
    closed_window = counters(retransmits=2, last_ack_s=0.06, unacked=0)
    assert not stalled(closed_window, silent_s=0.06, clean=True)
    # a connection that has delivered nothing measurable yet (its first bytes) takes the careful rule
    assert not stalled(counters(retransmits=2, last_ack_s=0.06, delivery_rate=0.0), silent_s=0.06, clean=True)


def test_a_lossy_link_takes_the_careful_rule() -> None:
    """A link that has lost packets (2% loss: its holes hold the acknowledgements for a
    retransmission timeout or two) is stalled only after STALL_MIN_S and three timeouts in a
    row, as before: a false detour there doubles a slow link's traffic."""
    lossy = counters(total_retrans=40, segs_out=2000)
    assert not lost_nothing(lossy)
    assert not stalled(counters(retransmits=2, last_ack_s=0.9), silent_s=0.9, clean=False)
    assert not stalled(counters(retransmits=3, last_ack_s=0.9), silent_s=0.9, clean=False)
    assert stalled(counters(retransmits=3, last_ack_s=1.0), silent_s=1.0, clean=False)


def test_the_quiet_wait_scales_with_the_link_and_what_is_queued_ahead() -> None:
    """Evidence follows the link: four round trips of a far link, and twice the time the rank's
    uplink needs for its other connections' bytes ahead of this one's."""
    far = counters(rtt_s=0.1, retransmits=1)
    assert stall_wait_s(far, clean=True) == pytest.approx(0.4, rel=1e-3)
    slow = counters(unacked=44, delivery_rate=1.25e6)  # 64 KB in flight at 10 Mbit/s: 51 ms of its own
    assert stall_wait_s(slow, clean=True) == pytest.approx(0.05 + 2 * 44 * 1448 / 1.25e6)
    behind = stall_wait_s(counters(), clean=True, queued_ahead_s=ahead_s(250_000, 1.25e6))
    assert behind == pytest.approx(0.45, rel=1e-3)
    assert ahead_s(125_000, 0.0) == pytest.approx(1.0)  # an unmeasured uplink is taken as 1 Mbit/s
    assert stall_wait_s(counters(unacked=1), clean=True) > 0.2  # one segment: its acknowledgement may be delayed


def test_only_a_connection_that_proved_fast_gets_the_short_retransmission_timeout() -> None:
    """Behind a 10 Mbit/s uplink on loopback the handshake's round trip is microseconds: a
    20 ms least timeout there sent queued 64 KB segments again and again."""
    assert fast_rto_min(counters(rtt_s=50e-6, delivery_rate=3e9))  # loopback
    assert not fast_rto_min(counters(rtt_s=50e-6, delivery_rate=0.0))  # nothing delivered yet
    assert not fast_rto_min(counters(rtt_s=50e-6, delivery_rate=1.25e6))  # a shaped 10 Mbit/s uplink
    assert not fast_rto_min(counters(rtt_s=0.02, delivery_rate=3e9))  # far


def test_the_transport_and_the_simulator_share_one_stall_rule() -> None:
    """stall_found, which net/tcp.py and testing/shaped.py both call: the link's loss history is
    judged at new acknowledgements only (a silence's own retransmissions, read later, do not make
    the link look lossy), and the quick rule needs a link that lost nothing behind an uplink with
    no bottleneck; bytes of other connections ahead in the uplink lengthen the wait."""
    fast, slow = UplinkMeter(), UplinkMeter()
    fast.grow(0.0, rtt_s=50e-6)  # loopback: the budget grew with no queue on the path
    feed(slow, 1.25e6, 50e-6, 40)  # 10 Mbit/s: a queue formed, the link's rate measured
    assert fast.unbottlenecked
    assert not slow.unbottlenecked
    clean = LossHistory().judged(counters(), progress_at=1.0)
    assert clean == LossHistory(clean=True, as_of=1.0)
    cut = counters(retransmits=1, last_ack_s=0.06, total_retrans=200)
    assert clean.judged(cut, progress_at=1.0) is clean
    assert stall_found(cut, clean, 0.06, 0, fast)
    assert not stall_found(cut, clean, 0.06, 0, slow)  # the careful rule behind a bottleneck
    lossy = LossHistory().judged(counters(total_retrans=40, segs_out=2000), progress_at=1.0)
    assert not lossy.clean
    assert not stall_found(cut, lossy, 0.06, 0, fast)
    assert not stall_found(cut, clean, 0.06, int(fast.rate or 1e9), fast)  # a second's bytes ahead


def test_a_link_rate_is_forgotten_after_a_window_of_traffic_with_no_queue() -> None:
    """A slow spell (or a loss burst) gives a link rate, which the group paces itself by; once
    the link carried CLEAR_BYTES over WINDOW_S with no queue forming, it limits nothing and the
    figure is forgotten. Idle time alone forgets nothing (a slow link's rounds apart), and a
    queue seen on the way starts the spell again."""
    meter = UplinkMeter(min_rtt_s=0.001)
    for i in range(1, 6):  # a queue on the path: a measured link
        meter.add(SLICE_S, int(1.25e6 * SLICE_S), i * SLICE_S, queued=True)
    queued_at = 5 * SLICE_S
    assert meter.link_rate == pytest.approx(1.25e6)
    meter.acknowledged(queued_at + WINDOW_S + 100, 0, queued=False)  # idle: kept
    assert meter.link_rate == pytest.approx(1.25e6)
    half = CLEAR_BYTES // 2
    meter.acknowledged(queued_at + 1, half, queued=False)
    meter.acknowledged(queued_at + WINDOW_S / 2, half, queued=True)  # a queue again: the spell restarts
    meter.acknowledged(queued_at + WINDOW_S + 1, CLEAR_BYTES, queued=False)
    assert meter.link_rate == pytest.approx(1.25e6)  # not a window since the last queue
    meter.acknowledged(queued_at + WINDOW_S / 2 + WINDOW_S, 1, queued=False)
    assert meter.link_rate == 0.0
    assert meter.rate == pytest.approx(1.25e6)  # what it measured stays, as a rate, not a limit
