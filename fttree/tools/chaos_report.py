"""The lines `fttree chaos` prints per fault kind, alike for real and simulated runs."""

from __future__ import annotations

from . import chaos_schedule as cs


def stats(xs: list[float]) -> str:
    """' (median M s, max X s)', or nothing for no figures."""
    if not xs:
        return ""
    xs = sorted(xs)
    return f" (median {xs[len(xs) // 2]:.2f} s, max {xs[-1]:.2f} s)"


def kind_line(kind: str, faults: int, detected: list[float], healed: list[float]) -> str:
    """How many faults of `kind` were detected and healed, and how fast. A stop or straggler
    heals only when the group evicted it and the runner restarted it."""
    return (f"  {kind:9s} x{faults:<3d} detected {len(detected)}/{faults}" + stats(detected)
            + (f"; healed {len(healed)}/{faults}" + stats(healed) if kind in cs.REJOINS else "")
            + (f"; evicted and restarted {len(healed)}, healed" + stats(healed)
               if kind not in cs.REJOINS and healed else ""))
