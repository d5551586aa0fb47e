"""Stragglers: when a tree's root closes a step without its slowest inputs (Config.straggler_policy
= "deadline"), and what a late rank takes part with.

Synchronous steps wait for the slowest worker: one whose compute is twice as slow sets everyone's
pace. The backup-worker idea (Chen et al. 2016, "Revisiting distributed synchronous SGD") closes
a step without the slowest contributions. In a tree only a rank's parent sees it missing, and a
late rank may hold its children's sums, so the decision goes down the tree:

- the root of each tree counts its inputs (its own contribution and each child's subtree sum) as
  they come. Once at most `max_late` are missing, it waits `straggler_grace_s` past the (upper)
  median arrival of those that came (`close_at`), then closes: it sends
  META_CLOSE to each child whose sum has not come, and takes part with zeros itself if its own
  contribution is the late one;
- a rank that gets META_CLOSE from its parent passes it on to its own missing children, and if
  it has not submitted, takes part at once with zeros (`identity_zeros`): it is late. Its
  children's sums still go up through it, so only the late ranks' own contributions are left out.

A late rank's zeros are not counted: the result names it in `late`, not in `contributors`, and
every member sees the same labels. Only the late rank decides whether its contribution is its
data or zeros, so a contribution is added once or not at all whatever messages cross. When its
own contribution comes after all, it is not added: the rank takes the result the others made. No
rank is evicted for being slow; a silent one is still the membership's business.
"""

from __future__ import annotations

import numpy as np

from .messages import BF16, INT8

#: the dtypes a late rank's zeros may have (a META_CLOSE naming another is a protocol violation)
ZERO_DTYPES = frozenset({"<f2", "<f4", "<f8", "<i4", "<i8"})
#: a late rank takes part with zeros only in steps at most this far past its newest submit: one
#: further behind is waited for (each closed step keeps its result until the rank takes it)
CLOSE_AHEAD_STEPS = 64


def close_at(arrivals: list[float], inputs: int, max_late: int, grace_s: float) -> float | None:
    """When a root closes its op: `grace_s` past the upper median of the arrivals so far, once
    at most `max_late` of its `inputs` are missing (None: not yet, or nothing is missing)."""
    missing = inputs - len(arrivals)
    if not arrivals or missing <= 0 or missing > max_late:
        return None
    return sorted(arrivals)[len(arrivals) // 2] + grace_s


def data_dtype(wire: str) -> str:
    """The dtype of data that travels as `wire` (compressed forms are float32's)."""
    return "<f4" if wire in (BF16, INT8) else wire


def identity_zeros(size: int, dtype: str) -> np.ndarray:
    """What a late rank adds to a sum: -0.0 for floats (x + -0.0 is x to the bit), 0 for ints."""
    kind = np.dtype(dtype)
    return np.full(size, -0.0 if kind.kind == "f" else 0, dtype=kind)
