"""How long a backup node waits for a confirmation before it checks on the link (pure: no clock).

A watch's deadline is what the link's own figures say the confirmation needs: the time to send
what the sender had queued ahead of (and including) the watched frame at the rate the sender
measured its uplink at (both stamped on META_*_SENT), with SLACK to spare, plus the latency
that this explains nothing of, learnt per watched link and phase in the spirit of RFC 6298:

    excess = elapsed - queued / rate
    SRTT <- (1 - a) SRTT + a excess,   RTTVAR <- (1 - b) RTTVAR + b |SRTT - excess|,   a = 1/8, b = 1/4
    deadline = min(max(SRTT + K RTTVAR, floor) * backoff, ceiling) + SLACK * queued / rate

A sender that has not measured its uplink yet stamps rate 0: `Config.uplink_bytes_per_s` (a
LAN's 50 MB/s unless the user gives their link's) stands in. A deadline that passes is not a
failure: the watcher asks the sender whether its frame is still moving (protocol.py), and the
answer, carrying fresh figures, re-arms the watch. So a low guess costs a small round trip,
never a relay. That round trip has its own deadline (`check_s`), learnt from the answers.
Karn's rule: a watch that needed a check gives no sample. A check that went unanswered doubles
the backoff for that link and phase until a clean sample arrives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol


class Phase(Enum):
    REDUCE = "reduce"
    BCAST = "bcast"


WatchKey = tuple[int, int, Phase]  # (sender, receiver, phase)

SLACK = 1.5  # the queued bytes' time is stretched this much: rates wobble, links are shared
CHECK_FLOOR_S = 0.5  # a check's answer is given at least this long: it and the check wait behind a little bulk data


def transfer_s(nbytes: int, rate: float) -> float:
    """Seconds to send `nbytes` at `rate` bytes per second."""
    return max(0, nbytes) / rate


class TimeoutPolicy(Protocol):
    def deadline_s(self, key: WatchKey, nbytes: int, rate: float) -> float: ...

    def observe(self, key: WatchKey, elapsed_s: float, nbytes: int, rate: float) -> None: ...

    def timed_out(self, key: WatchKey) -> None: ...

    def check_s(self) -> float:
        """How long a check's answer may take before the watcher acts."""

    def observe_check(self, elapsed_s: float) -> None: ...


@dataclass
class _Rtt:
    """RFC 6298's smoothed round trip and its variation."""

    srtt: float
    rttvar: float
    backoff: float = 1.0
    samples: int = 1

    def add(self, r: float, alpha: float = 1 / 8, beta: float = 1 / 4) -> None:
        self.rttvar = (1 - beta) * self.rttvar + beta * abs(self.srtt - r)
        self.srtt = (1 - alpha) * self.srtt + alpha * r
        self.backoff = 1.0
        self.samples += 1


@dataclass
class StaticTimeouts:
    """One fixed timeout for every watch (the thesis's scheme), plus the time to send what the
    sender had queued at its uplink's rate, so chunks queued behind each other are not taken
    for lost."""

    timeout_s: float

    def deadline_s(self, key: WatchKey, nbytes: int, rate: float) -> float:
        return self.timeout_s + SLACK * transfer_s(nbytes, rate)

    def observe(self, key: WatchKey, elapsed_s: float, nbytes: int, rate: float) -> None:
        pass

    def timed_out(self, key: WatchKey) -> None:
        pass

    def check_s(self) -> float:
        return max(self.timeout_s, CHECK_FLOOR_S)

    def observe_check(self, elapsed_s: float) -> None:
        pass


@dataclass
class AdaptiveTimeouts:
    """Per-(link, phase) deadlines: the queued bytes' time plus a learnt latency."""

    initial_s: float = 0.5  # the latency before any sample (RFC 6298 uses 1 s)
    floor_s: float = 0.08
    ceiling_s: float = 2.0  # on the latency part: the queued bytes' time has no ceiling
    k: float = 4.0
    max_backoff: float = 8.0
    _est: dict[WatchKey, _Rtt] = field(default_factory=dict)
    _check: _Rtt | None = None

    def _latency_s(self, key: WatchKey) -> float:
        est = self._est.get(key)
        if est is None:
            return min(self.initial_s, self.ceiling_s)
        return float(min(max(est.srtt + self.k * est.rttvar, self.floor_s) * est.backoff, self.ceiling_s))

    def deadline_s(self, key: WatchKey, nbytes: int, rate: float) -> float:
        return self._latency_s(key) + SLACK * transfer_s(nbytes, rate)

    def observe(self, key: WatchKey, elapsed_s: float, nbytes: int, rate: float) -> None:
        excess = max(0.0, elapsed_s - transfer_s(nbytes, rate))
        est = self._est.get(key)
        if est is None:
            self._est[key] = _Rtt(srtt=excess, rttvar=excess / 2)
        else:
            est.add(excess)

    def timed_out(self, key: WatchKey) -> None:
        est = self._est.get(key)
        if est is not None:
            est.backoff = min(est.backoff * 2, self.max_backoff)

    def check_s(self) -> float:
        est = self._check
        if est is None:
            return max(2 * self.initial_s, CHECK_FLOOR_S)
        return float(min(max(est.srtt + self.k * est.rttvar, CHECK_FLOOR_S), 2 * self.ceiling_s))

    def observe_check(self, elapsed_s: float) -> None:
        if self._check is None:
            self._check = _Rtt(srtt=elapsed_s, rttvar=elapsed_s / 2)
        else:
            self._check.add(elapsed_s)

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Current estimates, for status pages and tests."""
        return {f"{a}->{b} {p.value}": {"srtt_s": e.srtt, "rttvar_s": e.rttvar, "samples": e.samples,
                                          "backoff": e.backoff, "latency_s": self._latency_s((a, b, p))}
                for (a, b, p), e in self._est.items()}
