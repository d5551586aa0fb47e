"""The fault language shared by `--faults`, the simulator and the netem scripts.

A schedule is rules separated by ';', each optionally limited to a window of steps::

    cut 1-0 @5..10            link 1<->0 drops every frame of steps 5 to 10 (silently)
    drop 3-1 20% @2..         link 3<->1 drops each frame with probability 0.2 from step 2 on
    loss 3 20% @12..15        every link of rank 3 drops frames with probability 0.2
    delay 2-0 50ms            link 2<->0 delays every frame by 50 ms
    isolate 4 @7              every link of rank 4 drops everything in step 7
    partition 1,3,4 @8..12    every link between {1, 3, 4} and the other ranks drops everything
    crash 4 @12               rank 4 dies when it reaches step 12 (a SIGKILL: its sockets reset)
    hang 2 @12..14            rank 2 stops when it reaches step 12 (a SIGSTOP: sockets stay open,
                              nothing comes) and goes on once the others have finished step 14

Links are undirected (a rule on 1-0 hits 1->0 and 0->1), as a firewall cut between two hosts
would. Steps are the numbers the user sees: allreduce steps for `fttree worker`, training steps
in a training loop (the fault layer maps allreduce steps onto them, fttree.net.faulty). Link rules are applied
frame by frame (`verdict`, `blocks`); crash and hang are node faults, carried out by whoever runs
the node (the simulator, `fttree launch`), found with `node_faults`.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from enum import Enum

from ..errors import ConfigError


class FaultKind(Enum):
    CUT = "cut"
    DROP = "drop"
    LOSS = "loss"
    DELAY = "delay"
    ISOLATE = "isolate"
    PARTITION = "partition"
    CRASH = "crash"
    HANG = "hang"
    RESTART = "restart"  # simulator only: the rank's process dies and a new one rejoins
    JOIN = "join"  # simulator only: a new rank joins the running group
    LEAVE = "leave"  # simulator only: the rank leaves the group for good instead of taking step S



LINK_KINDS = frozenset({FaultKind.CUT, FaultKind.DROP, FaultKind.DELAY})  # name one link A-B
# happen to a worker, not to frames
NODE_KINDS = frozenset({FaultKind.CRASH, FaultKind.HANG, FaultKind.RESTART, FaultKind.JOIN, FaultKind.LEAVE})
#: what only the simulator does (fttree.testing.simulate), and what real workers do instead
#: (docs/failures.md, "Elastic jobs")
_STARTS_A_PROCESS = "starts a process: on real workers start one with `fttree worker --join`"
SIMULATED_KINDS = {
    FaultKind.RESTART: _STARTS_A_PROCESS,
    FaultKind.JOIN: _STARTS_A_PROCESS,
    FaultKind.LEAVE: "is the training loop's to do: on real workers send `fttree worker` SIGTERM, or call "
                     "FTTreeAllreduce.leave()",
}
CERTAIN_DROPS = frozenset({FaultKind.CUT, FaultKind.ISOLATE, FaultKind.PARTITION})

USAGE = {
    FaultKind.CUT: "cut A-B [@S..E]",
    FaultKind.DROP: "drop A-B P% [@S..E]",
    FaultKind.LOSS: "loss R P% [@S..E]",
    FaultKind.DELAY: "delay A-B 50ms [@S..E]",
    FaultKind.ISOLATE: "isolate R [@S..E]",
    FaultKind.PARTITION: "partition R,R,.. [@S..E]",
    FaultKind.CRASH: "crash R @S",
    FaultKind.HANG: "hang R @S[..E]",
    FaultKind.RESTART: "restart R @S[..E]",
    FaultKind.JOIN: "join R @S",
    FaultKind.LEAVE: "leave R @S",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class FaultRule:
    kind: FaultKind
    a: int  # rank (a link's one end, or the worker of loss/isolate/crash/hang; the group's first)
    b: int | None = None  # the link's other end; None for worker-wide rules
    group: tuple[int, ...] = ()  # partition: the ranks cut off from all others
    probability: float = 1.0
    delay_s: float = 0.0
    first_step: int | None = None  # inclusive; None: from the start
    last_step: int | None = None  # inclusive; None: forever

    def active(self, step: int) -> bool:
        if self.first_step is not None and step < self.first_step:
            return False
        return self.last_step is None or step <= self.last_step

    def touches(self, src: int, dst: int) -> bool:
        if self.kind is FaultKind.PARTITION:
            return (src in self.group) != (dst in self.group)
        if self.kind in NODE_KINDS:
            return False
        if self.b is None:
            return self.a in (src, dst)
        return {self.a, self.b} == {src, dst}

    def ranks(self) -> tuple[int, ...]:
        if self.group:
            return self.group
        return (self.a,) if self.b is None else (self.a, self.b)

    def __str__(self) -> str:
        if self.kind is FaultKind.PARTITION:
            where = ",".join(map(str, self.group))
        else:
            where = str(self.a) if self.b is None else f"{self.a}-{self.b}"
        arg = ""
        if self.kind in (FaultKind.DROP, FaultKind.LOSS):
            arg = f" {self.probability * 100:g}%"
        elif self.kind is FaultKind.DELAY:
            arg = f" {self.delay_s * 1000:g}ms"
        window = ""
        if self.first_step is not None or self.last_step is not None:
            first = "" if self.first_step is None else str(self.first_step)
            last = "" if self.last_step is None else str(self.last_step)
            window = f" @{first}..{last}" if first != last else f" @{first}"
        return f"{self.kind.value} {where}{arg}{window}"


_LINK = re.compile(r"^(\d+)-(\d+)$")
_RANK = re.compile(r"^(\d+)$")
_GROUP = re.compile(r"^\d+(,\d+)*$")
_PERCENT = re.compile(r"^(\d+(?:\.\d+)?)%$")
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s)$")
_WINDOW = re.compile(r"^@(\d*)(?:\.\.(\d*))?$")


def _window(token: str, text: str) -> tuple[int | None, int | None]:
    m = _WINDOW.match(token)
    if not m or (m.group(1) == "" and not m.group(2)):
        raise ConfigError(f"bad step window {token!r} in fault {text!r}: use @S..E, @S.. or @S")
    first = int(m.group(1)) if m.group(1) else None
    last = first if ".." not in token else int(m.group(2)) if m.group(2) else None
    if first is not None and last is not None and last < first:
        raise ConfigError(f"step window {token!r} in fault {text!r} ends before it starts")
    return first, last


def parse_rule(text: str) -> FaultRule:
    tokens = text.split()
    if not tokens:
        raise ConfigError("empty fault rule")
    first_step = last_step = None
    if tokens[-1].startswith("@"):
        first_step, last_step = _window(tokens[-1], text)
        tokens = tokens[:-1]
    try:
        kind = FaultKind(tokens[0].lower())
    except ValueError:
        known = ", ".join(k.value for k in FaultKind)
        raise ConfigError(f"unknown fault {tokens[0]!r} in {text!r}: known faults are {known}") from None
    args = tokens[1:]
    want = 2 if kind in (FaultKind.DROP, FaultKind.LOSS, FaultKind.DELAY) else 1
    if len(args) != want:
        raise ConfigError(f"fault {text!r} has the wrong arguments: use {USAGE[kind]}")
    if kind in NODE_KINDS and first_step is None:
        raise ConfigError(f"fault {text!r} needs the step it happens at: use {USAGE[kind]}")
    if kind in (FaultKind.CRASH, FaultKind.JOIN, FaultKind.LEAVE) and last_step != first_step:
        raise ConfigError(f"fault {text!r}: a {kind.value} happens at one step; use {USAGE[kind]}")
    a, b, group = _where(kind, args[0], text)
    probability, delay_s = _amount(kind, args, text)
    return FaultRule(kind=kind, a=a, b=b, group=group, probability=probability, delay_s=delay_s,
                     first_step=first_step, last_step=last_step)


def _where(kind: FaultKind, arg: str, text: str) -> tuple[int, int | None, tuple[int, ...]]:
    """The ranks a rule names: a link A-B, a group R,R,.. (partition), or one rank."""
    if kind in LINK_KINDS:
        m = _LINK.match(arg)
        if not m:
            raise ConfigError(f"fault {text!r} needs a link A-B, got {arg!r}")
        a, b = int(m.group(1)), int(m.group(2))
        if a == b:
            raise ConfigError(f"fault {text!r} names a link from rank {a} to itself")
        return a, b, ()
    if kind is FaultKind.PARTITION:
        if not _GROUP.match(arg):
            raise ConfigError(f"fault {text!r} needs ranks like 1,3,4, got {arg!r}")
        group = tuple(sorted({int(r) for r in arg.split(",")}))
        return group[0], None, group
    m = _RANK.match(arg)
    if not m:
        raise ConfigError(f"fault {text!r} needs a rank, got {arg!r}")
    return int(m.group(1)), None, ()


def _amount(kind: FaultKind, args: list[str], text: str) -> tuple[float, float]:
    """(probability, delay_s) of a drop, loss or delay rule; (1.0, 0.0) for the others."""
    if kind in (FaultKind.DROP, FaultKind.LOSS):
        m = _PERCENT.match(args[1])
        if not m or not 0 <= float(m.group(1)) <= 100:
            raise ConfigError(f"fault {text!r} needs a probability like 20%, got {args[1]!r}")
        return float(m.group(1)) / 100, 0.0
    if kind is FaultKind.DELAY:
        m = _DURATION.match(args[1])
        if not m:
            raise ConfigError(f"fault {text!r} needs a delay like 50ms or 0.2s, got {args[1]!r}")
        return 1.0, float(m.group(1)) / (1000 if m.group(2) == "ms" else 1)
    return 1.0, 0.0


def parse(text: str | None) -> list[FaultRule]:
    """Parse a whole schedule; an empty or None text is no faults."""
    if not text:
        return []
    return [parse_rule(part.strip()) for part in text.split(";") if part.strip()]


@dataclass(frozen=True, slots=True)
class Verdict:
    drop: bool = False
    delay_s: float = 0.0


PASS = Verdict()


class FaultSchedule:
    """Decides, frame by frame, what the in-process fault layer does to traffic of a step."""

    def __init__(self, rules: list[FaultRule] | str | None = None, *, world: int | None = None,
                 seed: int = 0, simulated: bool = False, launcher: bool = False) -> None:
        """`simulated`: the schedule drives a simulation, which alone may start processes
        (restart, join) and make a training loop leave; elsewhere those are refused, naming
        what to do instead. `launcher`: `fttree launch`, which restarts a rank it killed."""
        self.rules = parse(rules) if isinstance(rules, str) or rules is None else list(rules)
        for rule in self.rules:
            if rule.kind is FaultKind.RESTART and launcher:
                continue
            if rule.kind in SIMULATED_KINDS and not simulated:
                raise ConfigError(f"fault {str(rule)!r} {SIMULATED_KINDS[rule.kind]}; only the simulator does "
                                  "it itself (fttree.testing.simulate)")
        joiners = {r.a for r in self.rules if r.kind is FaultKind.JOIN}
        if world is not None:
            for rule in self.rules:
                if rule.kind is FaultKind.JOIN:
                    if rule.a < world:
                        raise ConfigError(f"fault {str(rule)!r} names rank {rule.a}, which is in the world of "
                                          f"{world} already: a new rank is {world} or more")
                    continue
                for r in rule.ranks():
                    if not (0 <= r < world or r in joiners):
                        raise ConfigError(f"fault {str(rule)!r} names rank {r}, outside the world of {world}")
                if rule.kind is FaultKind.PARTITION and len(rule.group) >= world:
                    raise ConfigError(f"fault {str(rule)!r} puts every rank on one side: nothing is cut")
        self._link_rules = [r for r in self.rules if r.kind not in NODE_KINDS]
        self._rng = random.Random(seed)

    def __bool__(self) -> bool:
        return bool(self._link_rules)

    def verdict(self, src: int, dst: int, step: int) -> Verdict:
        """What happens to one frame from `src` to `dst` that belongs to `step`."""
        delay = 0.0
        for rule in self._link_rules:
            if not rule.touches(src, dst) or not rule.active(step):
                continue
            if rule.kind in CERTAIN_DROPS:
                return Verdict(drop=True)
            if rule.kind in (FaultKind.DROP, FaultKind.LOSS):
                if self._rng.random() < rule.probability:
                    return Verdict(drop=True)
            elif rule.kind is FaultKind.DELAY:
                delay += rule.delay_s
        return Verdict(delay_s=delay) if delay else PASS

    def longest_delay_s(self) -> float:
        """The most a frame is held back (every delay rule on one link at once)."""
        return sum(r.delay_s for r in self._link_rules if r.kind is FaultKind.DELAY)

    def blocks(self, src: int, dst: int, step: int) -> bool:
        """Does a rule drop *every* frame from `src` to `dst` in `step` (cut, isolate, partition)?"""
        return any(r.kind in CERTAIN_DROPS and r.touches(src, dst) and r.active(step) for r in self._link_rules)

    def node_faults(self, rank: int | None = None) -> list[FaultRule]:
        """The crash, hang, restart, join and leave rules (of one rank, or all), for whoever runs the nodes."""
        return [r for r in self.rules if r.kind in NODE_KINDS and (rank is None or r.a == rank)]

    def __str__(self) -> str:
        return "; ".join(str(r) for r in self.rules)
