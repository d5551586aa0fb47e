"""What the transport measures that the replica's decisions need: the uplink's rate and
retransmission time (the view's pace follows them), and the backlog stamped on metadata frames
(observers' deadlines scale with it). The node reads them here and hands them to the replica."""

from __future__ import annotations

from ..core.membership import Membership, Uplink
from ..core.messages import Message
from .transport import Transport


class Senses:
    """One node's readings of its transport."""

    def __init__(self, rank: int, transport: Transport) -> None:
        self.rank = rank
        self.transport = transport
        self._retransmit_s = 0.0  # the membership was last told this retransmission timeout
        self._stamped: tuple[Message, Message] | None = None  # the last metadata frame stamped

    def uplink(self, membership: Membership) -> float:
        """The rate a step deadline may assume: the slower of this rank's uplink and the
        slowest the view knows of (0: none measured yet)."""
        rates = [r for r in (self.transport.uplink_rate(), membership.slowest_uplink) if r > 0]
        return min(rates, default=0.0)

    def uplink_news(self, membership: Membership) -> Uplink | None:
        """What the membership should hear of the measured uplink, if it changed: far from the
        view's pace, a pace round follows."""
        rate = self.transport.uplink_rate()
        neighbours = membership.view.neighbours(self.rank).all if self.rank in membership.view else ()
        retransmit = round(max((self.transport.retransmit_s(p) for p in neighbours), default=0.0), 3)
        if rate != membership.rate or retransmit != self._retransmit_s:
            # 0 too: the link showed no queue for the meter's window (uplink.py link_rate), so
            # a pace that a loss burst or a slow spell brought is lifted (joins.target_pace)
            self._retransmit_s = retransmit
            return Uplink(rate=rate, retransmit_s=retransmit)
        return None

    def forget_stamp(self) -> None:
        """The backlog may have changed since the last stamp (a batch began, a payload went)."""
        self._stamped = None

    def stamp(self, msg: Message) -> Message:
        """`msg` saying how much this worker had queued ahead of it and not yet acknowledged, and
        how fast its uplink sends, so observers' deadlines scale with both: every link counts,
        as they all leave through this worker's one uplink. Only sends with a payload change
        the first number, so it is counted once per run of metadata frames, and a frame the
        protocol sends to several observers is copied once."""
        stamped = self._stamped
        if stamped is not None and stamped[0] is msg:
            return stamped[1]
        if stamped is None:
            queued, rate = self.transport.backlog_bytes(), int(self.transport.uplink_rate())
        else:
            queued, rate = stamped[1].queued_bytes, stamped[1].rate
        out = msg.but(queued_bytes=msg.queued_bytes if msg.answer else queued, rate=rate)
        self._stamped = (msg, out)
        return out
