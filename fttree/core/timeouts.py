"""How long a backup node waits for a confirmation before it acts (pure: no clock inside).

`StaticTimeouts` is the thesis's single timeout. `AdaptiveTimeouts` learns, per watched link
and phase, how long a confirmation normally takes, in the spirit of RFC 6298:

    SRTT <- (1 - a) SRTT + a R,   RTTVAR <- (1 - b) RTTVAR + b |SRTT - R|,   a = 1/8, b = 1/4
    deadline = min(max(SRTT + K RTTVAR, floor) * backoff, ceiling) + max(0, bytes - 4 MiB) / uplink

`bytes` is what the sender had queued (on all its links: they share its uplink) when it
announced the data, and `uplink` Config.uplink_bytes_per_s (50 MB/s, a LAN); beyond one
chunk, the allowance turns it into time to send it (both policies get it), so a large tensor, or many chunks queued
behind each other, stretch the deadline instead of looking like a failure. Karn's rule: a
watch that already fired gives no sample. A timeout doubles the backoff for that link and
phase until a clean sample arrives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol


class Phase(Enum):
    REDUCE = "reduce"
    BCAST = "bcast"


WatchKey = tuple[int, int, Phase]  # (sender, receiver, phase)


ALLOWANCE_FREE_BYTES = 4 * 1024 * 1024  # one default chunk: what learnt deadlines already cover
ALLOWANCE_BYTES_PER_S = 50e6  # conservative: 7 workers on 2 cores move ~100 MB/s each way


def queued_allowance_s(nbytes: int, bytes_per_s: float = ALLOWANCE_BYTES_PER_S) -> float:
    """Extra patience for data queued ahead of the watched message, beyond one chunk, at the
    sender's uplink pace (Config.uplink_bytes_per_s)."""
    return max(0, nbytes - ALLOWANCE_FREE_BYTES) / bytes_per_s


class TimeoutPolicy(Protocol):
    def deadline_s(self, key: WatchKey, nbytes: int) -> float: ...

    def observe(self, key: WatchKey, elapsed_s: float, nbytes: int) -> None: ...

    def timed_out(self, key: WatchKey) -> None: ...

    def longest_s(self) -> float:
        """The longest deadline a watch would get now (before any queued-bytes allowance)."""


@dataclass
class StaticTimeouts:
    """One fixed timeout for every watch (the thesis's scheme), plus time to send what the
    sender had queued ahead beyond one chunk, so chunks of a large tensor queued behind each
    other are not taken for lost."""

    timeout_s: float
    bytes_per_s: float = ALLOWANCE_BYTES_PER_S

    def deadline_s(self, key: WatchKey, nbytes: int) -> float:
        return self.timeout_s + queued_allowance_s(nbytes, self.bytes_per_s)

    def observe(self, key: WatchKey, elapsed_s: float, nbytes: int) -> None:
        pass

    def timed_out(self, key: WatchKey) -> None:
        pass

    def longest_s(self) -> float:
        return self.timeout_s


@dataclass
class _Estimate:
    srtt: float
    rttvar: float
    backoff: float = 1.0
    samples: int = 0


@dataclass
class AdaptiveTimeouts:
    """Per-(link, phase) deadlines learnt from how long confirmations take."""

    initial_s: float = 0.5  # before any sample (RFC 6298 uses 1 s)
    floor_s: float = 0.08
    ceiling_s: float = 2.0
    k: float = 4.0
    alpha: float = 1 / 8
    beta: float = 1 / 4
    max_backoff: float = 8.0
    bytes_per_s: float = ALLOWANCE_BYTES_PER_S
    _est: dict[WatchKey, _Estimate] = field(default_factory=dict)

    def deadline_s(self, key: WatchKey, nbytes: int) -> float:
        est = self._est.get(key)
        learnt = self.initial_s if est is None else est.srtt + self.k * est.rttvar
        backoff = 1.0 if est is None else est.backoff
        return float(min(max(learnt, self.floor_s) * backoff, self.ceiling_s)) + \
            queued_allowance_s(nbytes, self.bytes_per_s)

    def observe(self, key: WatchKey, elapsed_s: float, nbytes: int) -> None:
        r = max(0.0, elapsed_s)
        est = self._est.get(key)
        if est is None:
            self._est[key] = _Estimate(srtt=r, rttvar=r / 2, samples=1)
            return
        est.rttvar = (1 - self.beta) * est.rttvar + self.beta * abs(est.srtt - r)
        est.srtt = (1 - self.alpha) * est.srtt + self.alpha * r
        est.backoff = 1.0
        est.samples += 1

    def timed_out(self, key: WatchKey) -> None:
        est = self._est.get(key)
        if est is not None:
            est.backoff = min(est.backoff * 2, self.max_backoff)

    def longest_s(self) -> float:
        if not self._est:
            return min(self.initial_s, self.ceiling_s)
        return max(self.deadline_s(key, 0) for key in self._est)

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Current estimates, for status pages and tests."""
        return {f"{a}->{b} {p.value}": {"srtt_s": e.srtt, "rttvar_s": e.rttvar, "samples": e.samples,
                                          "backoff": e.backoff, "deadline_s": self.deadline_s((a, b, p), 0)}
                for (a, b, p), e in self._est.items()}
