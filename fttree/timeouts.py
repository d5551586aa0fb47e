"""How long a backup node waits for a confirmation before it acts (pure: no clock inside).

`StaticTimeouts` is the thesis's single timeout. `AdaptiveTimeouts` learns, per watched link
and phase, how long a confirmation normally takes, in the spirit of RFC 6298:

    SRTT <- (1 - a) SRTT + a R,   RTTVAR <- (1 - b) RTTVAR + b |SRTT - R|,   a = 1/8, b = 1/4
    deadline = clamp((SRTT + K RTTVAR) * max(1, bytes / typical_bytes), floor, ceiling) * backoff

`bytes` is what the sender had queued on that link when it announced the data, so a large
tensor, or many chunks queued behind each other, stretch the deadline instead of looking like
a failure. Karn's rule: a watch that already fired gives no sample. A timeout doubles the
backoff for that link and phase until a clean sample arrives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol


class Phase(Enum):
    REDUCE = "reduce"
    BCAST = "bcast"


WatchKey = tuple[int, int, Phase]  # (sender, receiver, phase)


class TimeoutPolicy(Protocol):
    def deadline_s(self, key: WatchKey, nbytes: int) -> float: ...

    def observe(self, key: WatchKey, elapsed_s: float, nbytes: int) -> None: ...

    def timed_out(self, key: WatchKey) -> None: ...


@dataclass
class StaticTimeouts:
    """One fixed timeout for every watch (the thesis's scheme), plus time to send what the
    sender had queued ahead at `allowance_bytes_per_s`, so chunks of a large tensor queued
    behind each other are not taken for lost."""

    timeout_s: float
    allowance_bytes_per_s: float = 200e6

    def deadline_s(self, key: WatchKey, nbytes: int) -> float:
        return self.timeout_s + max(0, nbytes) / self.allowance_bytes_per_s

    def observe(self, key: WatchKey, elapsed_s: float, nbytes: int) -> None:
        pass

    def timed_out(self, key: WatchKey) -> None:
        pass


@dataclass
class _Estimate:
    srtt: float
    rttvar: float
    typical_bytes: float
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
    allowance_bytes_per_s: float = 200e6  # before any sample: time allowed per queued byte
    _est: dict[WatchKey, _Estimate] = field(default_factory=dict)

    def deadline_s(self, key: WatchKey, nbytes: int) -> float:
        est = self._est.get(key)
        if est is None:  # like the static policy until the first sample
            return min(max(self.initial_s, self.floor_s), self.ceiling_s) + max(0, nbytes) / self.allowance_bytes_per_s
        scale = max(1.0, nbytes / est.typical_bytes) if est.typical_bytes > 0 else 1.0
        base = (est.srtt + self.k * est.rttvar) * scale
        return float(min(max(base, self.floor_s) * est.backoff, self.ceiling_s * scale))

    def observe(self, key: WatchKey, elapsed_s: float, nbytes: int) -> None:
        r = max(0.0, elapsed_s)
        est = self._est.get(key)
        if est is None:
            self._est[key] = _Estimate(srtt=r, rttvar=r / 2, typical_bytes=float(max(nbytes, 1)), samples=1)
            return
        est.rttvar = (1 - self.beta) * est.rttvar + self.beta * abs(est.srtt - r)
        est.srtt = (1 - self.alpha) * est.srtt + self.alpha * r
        est.typical_bytes = (1 - self.alpha) * est.typical_bytes + self.alpha * max(nbytes, 1)
        est.backoff = 1.0
        est.samples += 1

    def timed_out(self, key: WatchKey) -> None:
        est = self._est.get(key)
        if est is not None:
            est.backoff = min(est.backoff * 2, self.max_backoff)

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Current estimates, for status pages and tests."""
        return {f"{a}->{b} {p.value}": {"srtt_s": e.srtt, "rttvar_s": e.rttvar, "samples": e.samples,
                                          "backoff": e.backoff, "deadline_s": self.deadline_s((a, b, p), 0)}
                for (a, b, p), e in self._est.items()}
