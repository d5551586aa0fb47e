"""What comes into the tree machine (TreeMachine.handle): a local contribution, a frame, a
timer that fired, a link the driver saw fail."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .effects import LinkState, TimerKey
from .messages import Message


@dataclass(frozen=True, slots=True, kw_only=True)


class Submit:
    """The local contribution to one op. `data` is 1-D and now owned by the machine."""

    step: int
    chunk: int = 0
    chunks: int = 1  # how many chunks the step has: the tree a chunk runs on depends on it
    data: np.ndarray
    signature: str  # dtype and shape of the whole tensor, compared across workers
    contribute: bool = True  # False: `data` is zeros and this rank is not among the result's contributors
    abort: str = ""  # fail this step everywhere for this reason, naming this rank (a NaN, Config.nonfinite)
    reduce: str = "sum"  # how contributions meet (reduce_ops.py); named in the signature, so ranks agree
    # float32 data of this step travels as "bf16", "fp16" or "int8" (None: Config.compression).
    # Ranks may differ: every hop decodes what it gets
    compression: str | None = None
    # under straggler_policy="deadline", the step may close without late ranks (gradient buckets);
    # False (a broadcast, a layout check, an audit): it waits for every member
    closable: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)


class Received:
    msg: Message
    link: LinkState | None = None  # LINK_QUERY_KINDS: the link from this rank to msg.target


@dataclass(frozen=True, slots=True, kw_only=True)


class TimerFired:
    key: TimerKey
    alive: frozenset[int] | None = None  # DEADLINE, ROOT_DEADLINE: peers whose bytes arrived lately
    uplink: float = 0.0  # DEADLINE, ROOT_DEADLINE: this rank's measured uplink, bytes per second (0.0: unknown)
    # DEADLINE, ROOT_DEADLINE: members that said lately they are alive and have not submitted
    # a step -> the oldest such step (Membership.computing)
    computing: Mapping[int, int] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)


class LinkDown:
    """The driver saw a hard failure on the link to `peer` (refused, reset, closed)."""

    peer: int
    reason: str


Event = Submit | Received | TimerFired | LinkDown
