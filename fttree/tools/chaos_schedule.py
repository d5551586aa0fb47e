"""A seeded random fault schedule for `fttree chaos`: what happens to whom, and when.

Faults arrive with exponential gaps (a Poisson process) of mean `every_s`, each of a kind drawn
uniformly from the kinds asked for, each holding for a random while. The same (world, duration,
every, seed, kinds) always gives the same schedule, so a failing chaos run can be run again.

**The majority rule.** A view change needs a majority of the current view (docs/failures.md),
so a group that loses too many members at once stops. The schedule never disturbs more than
`max_disturbed(world) = (world - 1) // 2` ranks at once (3 of 7): the untouched ranks are then a
majority of the full world, and so of every view the survivors can form. A rank counts as
disturbed from its fault until the fault ends, and for kills and leaves until the restarted or
new process has had `heal_allowance_s` to contribute again; a cut or a loss burst disturbs both
ends of its link. A fault drawn while too few ranks are free waits for the earliest moment
enough are. The runner enforces the same rule at run time (`allowed`), where heals take as long
as they take.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

KILL, STOP, CUT, LOSS, STRAGGLER, LEAVE = "kill", "stop", "cut", "loss", "straggler", "leave"
KINDS = (KILL, STOP, CUT, LOSS, STRAGGLER, LEAVE)
ROOT_KINDS = frozenset({CUT, LOSS})  # iptables rules in a network namespace: need root
LINK_KINDS = frozenset({CUT, LOSS})  # a link (two ranks), not a rank
REJOINS = frozenset({KILL, LEAVE})  # a new process must contribute again before the rank is whole

# how long each kind holds, seconds (uniform between the two)
HOLD_S: dict[str, tuple[float, float]] = {
    KILL: (0.5, 4.0),  # from the SIGKILL to the restart
    STOP: (0.3, 3.0),  # SIGSTOP to SIGCONT: past the 1 s node deadline the group evicts it
    CUT: (2.0, 8.0),  # an iptables cut of one link
    LOSS: (2.0, 8.0),  # iptables random drops on one link
    STRAGGLER: (3.0, 8.0),  # SIGSTOP bursts: the rank runs at a fraction of its speed
    LEAVE: (1.0, 5.0),  # from the graceful leave to a new process joining in its place
}
LOSS_PERCENTS = (10.0, 30.0, 50.0)


@dataclass(frozen=True, slots=True)
class Fault:
    """One fault: `kind` on `ranks` (two for a link) at `at_s` seconds into the run, for
    `hold_s` (see HOLD_S for what the hold is of each kind)."""

    at_s: float
    kind: str
    ranks: tuple[int, ...]
    hold_s: float
    percent: float = 0.0  # loss bursts: the share of packets dropped

    def busy_until(self, heal_allowance_s: float) -> float:
        """Until when the schedule counts its ranks as disturbed."""
        return self.at_s + self.hold_s + (heal_allowance_s if self.kind in REJOINS else 0.0)

    def link(self) -> str:
        a, b = self.ranks
        return f"{min(a, b)}-{max(a, b)}"

    def __str__(self) -> str:
        what = f"link {self.link()}" if self.kind in LINK_KINDS else f"rank {self.ranks[0]}"
        extra = f" {self.percent:g}%" if self.kind == LOSS else ""
        return f"{self.at_s:7.2f} s  {self.kind:9s} {what}{extra} for {self.hold_s:.2f} s"

    def to_dict(self) -> dict[str, Any]:
        return {"at_s": round(self.at_s, 3), "kind": self.kind, "ranks": list(self.ranks),
                "hold_s": round(self.hold_s, 3), "percent": self.percent}


def max_disturbed(world: int) -> int:
    """The most ranks faults may touch at once: the others stay a majority of the world."""
    return (world - 1) // 2


def allowed(disturbed: set[int], victims: tuple[int, ...], world: int) -> bool:
    """May a fault on `victims` start while `disturbed` ranks are? (never one already disturbed)"""
    return not (set(victims) & disturbed) and len(disturbed) + len(victims) <= max_disturbed(world)


def parse_kinds(text: str) -> tuple[str, ...]:
    """"kill,stop" -> ("kill", "stop"); every name checked."""
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ConfigError(f"fault kinds must be a comma-separated list of {', '.join(KINDS)}; got {text!r}")
    return tuple(dict.fromkeys(kinds))


def draw(world: int, duration_s: float, every_s: float, seed: int, kinds: tuple[str, ...] = KINDS, *,
         heal_allowance_s: float = 10.0) -> list[Fault]:
    """The schedule: faults with exponential gaps of mean `every_s` in [0, duration_s), kinds
    mixed uniformly, never more ranks disturbed at once than max_disturbed(world)."""
    if world < 3:
        raise ConfigError(f"a chaos run needs at least 3 workers (a fault must leave a majority), got {world}")
    if not duration_s > 0 or not every_s > 0:
        raise ConfigError(f"duration and the mean time between faults must be > 0 s, got {duration_s!r} and "
                          f"{every_s!r}")
    parse_kinds(",".join(kinds))
    if max_disturbed(world) < 2 and LINK_KINDS & set(kinds):
        raise ConfigError(f"cuts and loss bursts disturb two ranks, more than {world} workers allow at once "
                          f"(a majority must stay untouched): use at least 5 workers, or leave them out")
    rng = random.Random(seed)
    faults: list[Fault] = []
    recent: list[Fault] = []  # faults still disturbing someone at t (at most max_disturbed)
    t = 0.0
    while True:
        t += rng.expovariate(1.0 / every_s)
        kind = rng.choice(kinds)
        size = 2 if kind in LINK_KINDS else 1
        recent = [f for f in recent if f.busy_until(heal_allowance_s) > t]
        t = _when_free(recent, t, size, world, heal_allowance_s)
        if t >= duration_s:
            return faults
        busy = _disturbed(recent, t, heal_allowance_s)
        victims = tuple(rng.sample(sorted(set(range(world)) - busy), size))
        low, high = HOLD_S[kind]
        hold = rng.uniform(low, high)
        percent = rng.choice(LOSS_PERCENTS) if kind == LOSS else 0.0
        faults.append(Fault(t, kind, victims, hold, percent))
        recent.append(faults[-1])


def _disturbed(faults: list[Fault], t: float, heal_allowance_s: float) -> set[int]:
    return {r for f in faults if f.at_s <= t < f.busy_until(heal_allowance_s) for r in f.ranks}


def _when_free(faults: list[Fault], t: float, size: int, world: int, heal_allowance_s: float) -> float:
    """The first moment from t at which `size` more ranks may be disturbed."""
    while len(_disturbed(faults, t, heal_allowance_s)) + size > max_disturbed(world):
        t = min(f.busy_until(heal_allowance_s) for f in faults if f.busy_until(heal_allowance_s) > t)
    return t
