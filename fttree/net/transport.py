"""The transport seam: what a Node needs from the network, whatever carries the frames.

`TcpTransport` (tcp.py) is the real one; `MemoryTransport` (fttree.testing) delivers frames on a
simulated clock; `FaultyTransport` (faulty.py) wraps either with the in-process fault layer. A
transport calls back into its `TransportEvents` (the Node) on the node's own loop or clock, and
reports its state as a frozen `TransportStatus` that the status layer reads: never its privates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from ..core.effects import LinkState
from ..core.messages import Frame
from .address import Address

__all__ = ["LinkHealth", "LinkState", "LinkStatus", "Transport", "TransportEvents", "TransportStatus"]


class TransportEvents(Protocol):
    """What a transport tells its node."""

    def on_message(self, msg: Frame) -> None: ...

    def on_link_down(self, peer: int, reason: str, refused: bool = False) -> None:
        """A hard failure on the link to `peer`: reset or closed, or (`refused`) a reconnect
        that nobody answered, which is what a dead process looks like."""

    def is_stale(self, msg: Frame) -> bool:
        """May a queued frame be dropped unsent (its op finished here)?"""

    def on_progress(self, peer: int) -> None:
        """Bytes of a frame from `peer` are arriving (a large one takes seconds on a slow link):
        whatever frame they belong to, they prove `peer` alive."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkStatus:
    """One outgoing link, as the transport sees it. `connected` is None for a transport
    without connections (in memory)."""

    peer: int
    connected: bool | None = None
    frames_sent: int = 0
    bytes_sent: int = 0
    frames_received: int = 0
    bytes_received: int = 0
    injected_drops: int = 0  # frames the in-process fault layer dropped (both directions)
    stale_dropped: int = 0  # queued frames of finished ops dropped unsent
    connects: int = 0  # connections dialled to the peer
    adopted: int = 0  # connections the peer dialled that carry our frames to it (it cannot be dialled from here)
    errors: int = 0  # connections that broke and were redialled
    last_error: str = ""
    rtt_s: float | None = None  # the kernel's smoothed round-trip time, where there is one
    relay: int = -1  # the rank that relays frames to this peer (they cannot connect: relay.py); -1: direct
    # hole punching to a peer reached through a relay (punch.py): "" never tried, trying,
    # connected (its frames go direct), failed (they stay on the relay), lost (back on it)
    punch: str = ""
    punch_tries: int = 0
    punch_connected: int = 0  # punches that connected
    punch_s: float = 0.0  # the last that connected: from GO to both connections proven
    punch_error: str = ""  # why the last one failed or broke
    punch_via: int = -1  # the rank that coordinated the last one


@dataclass(frozen=True, slots=True, kw_only=True)
class TransportStatus:
    rank: int
    address: str
    links: tuple[LinkStatus, ...]
    frame_errors: int = 0
    refusals: int = 0  # connections refused at the handshake (another job, no key, a wrong rank)
    last_frame_error: str = ""
    faults: str = ""  # the in-process fault schedule in force ("" for none)
    # through relays (relay.py), in bytes of envelopes: this rank's frames sent through one,
    # those it carried for two other ranks, those it received through one; envelopes dropped
    relayed_sent_bytes: int = 0
    relayed_forwarded_bytes: int = 0
    relayed_received_bytes: int = 0
    relay_drops: int = 0

    def link(self, peer: int) -> LinkStatus:
        for status in self.links:
            if status.peer == peer:
                return status
        return LinkStatus(peer=peer)


class LinkHealth(NamedTuple):
    """The counters of one link that a monitor compares after every step: a tuple, as building
    the whole `TransportStatus` after every step was a few percent of a 4 KB step's CPU."""

    frames_sent: int = 0
    errors: int = 0  # connections that broke and were redialled
    injected_drops: int = 0  # frames the in-process fault layer dropped (both directions)
    last_error: str = ""


class Transport(Protocol):
    """Frames between this rank and its peers. `send` never blocks: frames queue per link."""

    rank: int

    def bind(self, events: TransportEvents) -> None: ...

    async def start(self) -> None: ...

    async def wait_for_peers(self, peers: Sequence[int], deadline_s: float) -> None:
        """Connect to each peer, or raise PeerError naming those still unreachable."""

    def send(self, dst: int, msg: Frame) -> None: ...

    def add_peer(self, rank: int, address: Address) -> None:
        """A rank that joined after the start, reachable from now on at `address`."""

    def address_of(self, rank: int) -> str:
        """Where `rank` listens ("" if unknown): a joiner learns the members' addresses so."""

    def backlog_bytes(self, dst: int | None = None) -> int:
        """Bytes queued on the link to `dst` (every link: None) and not yet acknowledged."""

    def uplink_rate(self) -> float:
        """This rank's measured uplink speed in bytes per second (0.0: not measured yet)."""

    def retransmit_s(self, peer: int) -> float:
        """How long a frame lost on the way to `peer` waits before it is sent again (TCP's
        retransmission timeout, without backoff), once the link has lost one; 0.0 before."""

    def link_state(self, peer: int) -> LinkState:
        """Whether frames to `peer` are moving, as far as this end can tell."""

    def status(self) -> TransportStatus: ...

    def link_health(self, peer: int) -> LinkHealth:
        """The counters of the link to `peer` that `status` also reports, without building it."""

    async def close(self, flush_s: float = 2.0, *, abort: bool = False) -> None:
        """Stop, first giving queued frames up to `flush_s` to go out; with `abort`, at once,
        resetting every connection, as a killed process would."""
