"""The fault language shared by `--faults`, the simulator and the netem scripts.

A schedule is rules separated by ';', each optionally limited to a window of steps::

    cut 1-0 @5..10        link 1<->0 drops every frame of steps 5 to 10 (silently)
    drop 3-1 20% @2..     link 3<->1 drops each frame with probability 0.2 from step 2 on
    loss 3 20% @12..15    every link of rank 3 drops frames with probability 0.2
    delay 2-0 50ms        link 2<->0 delays every frame by 50 ms
    isolate 4 @7          every link of rank 4 drops everything in step 7

Links are undirected (a rule on 1-0 hits 1->0 and 0->1), as a firewall cut between two
hosts would. Steps are the allreduce step numbers, so a schedule is deterministic in-process;
the real-fault runner maps the same windows to wall-clock by watching step progress.
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


@dataclass(frozen=True, slots=True, kw_only=True)
class FaultRule:
    kind: FaultKind
    a: int  # rank (a link's one end, or the worker for loss/isolate)
    b: int | None = None  # the link's other end; None for worker-wide rules
    probability: float = 1.0
    delay_s: float = 0.0
    first_step: int | None = None  # inclusive; None: from the start
    last_step: int | None = None  # inclusive; None: forever

    def active(self, step: int) -> bool:
        if self.first_step is not None and step < self.first_step:
            return False
        return self.last_step is None or step <= self.last_step

    def touches(self, src: int, dst: int) -> bool:
        if self.b is None:
            return self.a in (src, dst)
        return {self.a, self.b} == {src, dst}

    def ranks(self) -> tuple[int, ...]:
        return (self.a,) if self.b is None else (self.a, self.b)

    def __str__(self) -> str:
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
    link_kinds = (FaultKind.CUT, FaultKind.DROP, FaultKind.DELAY)
    want = {FaultKind.CUT: 1, FaultKind.ISOLATE: 1, FaultKind.DROP: 2, FaultKind.LOSS: 2, FaultKind.DELAY: 2}[kind]
    if len(args) != want:
        usage = {
            FaultKind.CUT: "cut A-B [@S..E]",
            FaultKind.ISOLATE: "isolate R [@S..E]",
            FaultKind.DROP: "drop A-B P% [@S..E]",
            FaultKind.LOSS: "loss R P% [@S..E]",
            FaultKind.DELAY: "delay A-B 50ms [@S..E]",
        }[kind]
        raise ConfigError(f"fault {text!r} has the wrong arguments: use {usage}")
    if kind in link_kinds:
        m = _LINK.match(args[0])
        if not m:
            raise ConfigError(f"fault {text!r} needs a link A-B, got {args[0]!r}")
        a, b = int(m.group(1)), int(m.group(2))
        if a == b:
            raise ConfigError(f"fault {text!r} names a link from rank {a} to itself")
    else:
        m = _RANK.match(args[0])
        if not m:
            raise ConfigError(f"fault {text!r} needs a rank, got {args[0]!r}")
        a, b = int(m.group(1)), None
    probability, delay_s = 1.0, 0.0
    if kind in (FaultKind.DROP, FaultKind.LOSS):
        m = _PERCENT.match(args[1])
        if not m or not 0 <= float(m.group(1)) <= 100:
            raise ConfigError(f"fault {text!r} needs a probability like 20%, got {args[1]!r}")
        probability = float(m.group(1)) / 100
    elif kind is FaultKind.DELAY:
        m = _DURATION.match(args[1])
        if not m:
            raise ConfigError(f"fault {text!r} needs a delay like 50ms or 0.2s, got {args[1]!r}")
        delay_s = float(m.group(1)) / (1000 if m.group(2) == "ms" else 1)
    return FaultRule(kind=kind, a=a, b=b, probability=probability, delay_s=delay_s,
                     first_step=first_step, last_step=last_step)


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
                 seed: int = 0) -> None:
        self.rules = parse(rules) if isinstance(rules, str) or rules is None else list(rules)
        if world is not None:
            for rule in self.rules:
                for r in rule.ranks():
                    if not 0 <= r < world:
                        raise ConfigError(f"fault {str(rule)!r} names rank {r}, outside the world of {world}")
        self._rng = random.Random(seed)

    def __bool__(self) -> bool:
        return bool(self.rules)

    def verdict(self, src: int, dst: int, step: int) -> Verdict:
        delay = 0.0
        for rule in self.rules:
            if not rule.touches(src, dst) or not rule.active(step):
                continue
            if rule.kind in (FaultKind.CUT, FaultKind.ISOLATE):
                return Verdict(drop=True)
            if rule.kind in (FaultKind.DROP, FaultKind.LOSS):
                if self._rng.random() < rule.probability:
                    return Verdict(drop=True)
            elif rule.kind is FaultKind.DELAY:
                delay += rule.delay_s
        return Verdict(delay_s=delay) if delay else PASS

    def __str__(self) -> str:
        return "; ".join(str(r) for r in self.rules)
