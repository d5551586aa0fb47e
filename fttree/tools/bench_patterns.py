"""What `fttree bench` measures: the thesis's link-fault patterns and the step times it reports
for them (Tables 1-2, Figs. 14-17), the node-failure patterns (issue 11) and the targets they are
held to, and which links or ranks each pattern strikes in a tree of a given size."""

from __future__ import annotations

from ..errors import ConfigError
from .analyze import bridgeable

# ---- what the thesis reports ---------------------------------------------------------------

PATTERNS = ("none", "1", "2p", "2s")
PATTERN_NAMES = {"none": "no fault", "1": "1 fault", "2p": "2 parallel", "2s": "2 serial"}
# Tables 1 (timeout 0.5 s) and 2 (1 s): step seconds for no fault, 1 fault, 2 parallel, 2 serial
THESIS: dict[float, dict[int, tuple[float, float, float, float]]] = {
    0.5: {7: (0.033, 1.449, 1.495, 2.822), 15: (0.062, 1.510, 1.513, 2.890), 31: (0.091, 1.497, 1.494, 2.880)},
    1.0: {7: (0.034, 2.441, 2.473, 4.839), 15: (0.065, 2.541, 2.498, 4.860), 31: (0.093, 2.509, 2.541, 4.911)},
}
FIGURE_OF_WORLD = {3: 14, 7: 15, 15: 16, 31: 17}  # Figs. 14-17: time per iteration, faults at steps 5-10
# Links cut by each pattern: at the same height (parallel) or at consecutive heights (serial).
PATTERN_LINKS: dict[str, list[tuple[int, int]]] = {"1": [(1, 0)], "2p": [(3, 1), (5, 2)], "2s": [(3, 1), (1, 0)]}
POLICIES = ("static", "adaptive")
# Node failures (issue 11): runs of their own, a worker killed or stopped before NODE_STEP.
NODE_PATTERNS = ("crash-leaf", "crash-interior", "crash-root", "hang")
PATTERN_NAMES.update({"crash-leaf": "crash leaf", "crash-interior": "crash interior", "crash-root": "crash root",
                      "hang": "hang"})
NODE_STEP = 8  # warm-up 0-1, no-fault steps 2-7, the fault before step 8
HANG_STEPS = 3  # a hang lasts until the others have finished this many steps without the victim
NODE_LATER = 10  # steps after the fault (after the hang's window) measured against the plain tree
# Targets of issue 11, seconds over the no-fault median, and the later-steps ratio.
NODE_TARGET_S = {"crash-leaf": 1.0, "crash-interior": 1.0, "crash-root": 1.0, "hang": 3.0}
LATER_TARGET = 1.2

FIRST_WINDOW = 5  # the thesis's links fail between the 5th and the 10th iteration
WARMUP_STEPS = 2


def node_victim(world: int, pattern: str) -> int | None:
    """The rank a node pattern strikes in a tree of `world`, or None where it does not apply:
    a leaf that is not in the last slot (its hole gets filled), rank 1 when it has children,
    the root, and for a hang rank 2 (interior from 7 workers on)."""
    if world < 3:
        return None  # one survivor of two is no majority
    if pattern == "crash-leaf":
        return world - 3 if world - 3 >= world // 2 else world - 1
    if pattern == "crash-interior":
        return 1 if world >= 4 else None
    if pattern == "crash-root":
        return 0
    if pattern == "hang":
        return 2
    raise ConfigError(f"unknown node pattern {pattern!r}; known: {', '.join(NODE_PATTERNS)}")


def node_rule(world: int, pattern: str, step: int = NODE_STEP) -> str | None:
    """The fault schedule of a node pattern (None where it does not apply)."""
    victim = node_victim(world, pattern)
    if victim is None:
        return None
    return f"hang {victim} @{step}..{step + HANG_STEPS - 1}" if pattern == "hang" else f"crash {victim} @{step}"


def thesis_figure(timeout_s: float, world: int, pattern: str) -> float | None:
    row = THESIS.get(timeout_s, {}).get(world)
    return None if row is None else row[PATTERNS.index(pattern)]


def pattern_links(world: int, pattern: str) -> list[tuple[int, int]] | None:
    """The links a pattern cuts in a tree of `world`, or None where it cannot apply (a rank is
    missing, or the one-hop backups could not bridge it, as for 2 faults in 3 workers)."""
    links = PATTERN_LINKS[pattern]
    if any(max(a, b) >= world for a, b in links) or not bridgeable(world, set(links)):
        return None
    return links


def node_window(pattern: str) -> tuple[int, int]:
    """The steps a node pattern's fault covers: the crash's step, or the hang's window."""
    return NODE_STEP, NODE_STEP + (HANG_STEPS - 1 if pattern == "hang" else 0)
