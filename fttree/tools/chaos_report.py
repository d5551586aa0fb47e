"""The lines `fttree chaos` prints per fault kind, alike for real and simulated runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

from . import chaos_schedule as cs


class Measured(Protocol):
    """A fault's measure, real (chaos.Measure) or simulated (chaos_sim.SimMeasure)."""

    @property
    def fault(self) -> cs.Fault: ...
    @property
    def detected_s(self) -> float | None: ...
    @property
    def healed_s(self) -> float | None: ...


M = TypeVar("M", bound=Measured)


def by_kind(measures: Sequence[M]) -> list[tuple[str, list[M]]]:
    """The measures grouped by their fault's kind, kinds in name order."""
    groups: dict[str, list[M]] = {}
    for m in measures:
        groups.setdefault(m.fault.kind, []).append(m)
    return sorted(groups.items())


def stats(xs: list[float]) -> str:
    """' (median M s, max X s)', or nothing for no figures."""
    if not xs:
        return ""
    xs = sorted(xs)
    return f" (median {xs[len(xs) // 2]:.2f} s, max {xs[-1]:.2f} s)"


def kind_line(kind: str, measures: Sequence[Measured]) -> str:
    """How many faults of `kind` were detected and healed, and how fast. A stop or straggler
    heals only when the group evicted it and the runner restarted it."""
    faults = len(measures)
    detected = [m.detected_s for m in measures if m.detected_s is not None]
    healed = [m.healed_s for m in measures if m.healed_s is not None]
    return (f"  {kind:9s} x{faults:<3d} detected {len(detected)}/{faults}" + stats(detected)
            + (f"; healed {len(healed)}/{faults}" + stats(healed) if kind in cs.REJOINS else "")
            + (f"; evicted and restarted {len(healed)}, healed" + stats(healed)
               if kind not in cs.REJOINS and healed else ""))
