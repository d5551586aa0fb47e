"""Sizes and rates as `fttree bench` and the `fttree` command spell them: tensor sizes ('16MB',
'mlp') in float32 elements, tc rates ('100mbit') in bits per second, and the least bytes an
allreduce must send. No benchmark here: the product CLI imports it for --uplink."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .sizes import THESIS_MLP_PARAMS

_UNITS = {"B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3}


def parse_size(text: str) -> int:
    """float32 elements for '4KB', '1.6MB', '100MB', '16MiB', 'mlp' (the thesis's 407,050) or a bare count."""
    t = text.strip().upper()
    if t == "MLP":
        return THESIS_MLP_PARAMS
    if t.isdigit():
        n = int(t)
    else:
        num = t.rstrip("KMGIB")
        unit = t[len(num):]
        try:
            n = int(float(num) * _UNITS[unit]) // 4
        except (KeyError, ValueError):
            raise ConfigError(f"bad size {text!r}: use 4KB, 1.6MB, 100MB, 16MiB, mlp or an element count") from None
    if n < 1:
        raise ConfigError(f"size {text!r} is less than one float32")
    return n


def format_bytes(elements: int) -> str:
    b = elements * 4
    for unit, scale in (("GB", 1000**3), ("MB", 1000**2), ("KB", 1000)):
        if b >= scale:
            v = b / scale
            return f"{v:.3g} {unit}" if v < 100 else f"{v:.0f} {unit}"
    return f"{b} B"


_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bps": 8.0, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}


def parse_rate(text: str) -> float:
    """Bits per second of a tc rate: 100mbit, 1gbit, 500kbit, 10mbps (bytes)."""
    t = text.strip().lower()
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    try:
        bps = float(num) * _RATE_UNITS[t[len(num):]]
    except (KeyError, ValueError):
        raise ConfigError(f"bad rate {text!r}: use tc units like 100mbit, 1gbit, 500kbit or 10mbps") from None
    if bps < 8:
        raise ConfigError(f"rate {text!r} is less than a byte per second")
    return bps


def format_rate(bps: float) -> str:
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g} {unit}"
    return f"{bps:g} bit/s"


def ring_bound_bytes(size: int, world: int) -> float:
    """The least any rank can send in an allreduce of `size` float32 (every rank must send
    2N(p-1)/p bytes for the others to get its share in and the sum out): the ring's figure."""
    return 2 * size * 4 * (world - 1) / world


@dataclass(frozen=True)
class UplinkSpec:
    """`--uplink 100mbit,3=10mbit`: every rank's uplink at a default tc rate, some ranks at rates
    of their own (edges of unequal speed)."""

    default: str
    by_rank: tuple[tuple[int, str], ...] = ()

    @property
    def bps(self) -> float:
        """The default rate, bits per second."""
        return parse_rate(self.default)

    def rate_of(self, rank: int) -> str:
        return dict(self.by_rank).get(rank, self.default)

    def bytes_per_s(self, world: int) -> tuple[float, ...]:
        """Each rank's uplink of a world, bytes per second."""
        return tuple(parse_rate(self.rate_of(r)) / 8 for r in range(world))

    def declared(self, world: int) -> str:
        """Config.uplinks_by_rank for a world's workers ('' when every rank has the default)."""
        if not any(r < world for r, _ in self.by_rank):
            return ""
        return ",".join(f"{r}={b:g}" for r, b in enumerate(self.bytes_per_s(world)))

    def __str__(self) -> str:
        return ",".join([self.default, *(f"{r}={rate}" for r, rate in self.by_rank)])


def parse_uplinks(text: str) -> UplinkSpec:
    """'100mbit' or '100mbit,3=10mbit,5=50mbit': a default rate, then RANK=RATE overrides."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or "=" in parts[0]:
        raise ConfigError(f"bad uplinks {text!r}: start with the default rate, then RANK=RATE, like 100mbit,3=10mbit")
    parse_rate(parts[0])
    by_rank: dict[int, str] = {}
    for part in parts[1:]:
        rank, eq, rate = part.partition("=")
        if not eq or not rank.strip().isdigit():
            raise ConfigError(f"bad uplinks {text!r}: {part!r} is not RANK=RATE (like 3=10mbit)")
        parse_rate(rate)
        by_rank[int(rank)] = rate.strip()
    return UplinkSpec(parts[0], tuple(sorted(by_rank.items())))


def split_uplink_list(text: str) -> list[str]:
    """'10mbit,3=1mbit,100mbit' -> ['10mbit,3=1mbit', '100mbit']: a list of uplink specs, each
    rate with the RANK=RATE overrides that follow it."""
    specs: list[str] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        if "=" in part and specs:
            specs[-1] += f",{part}"
        else:
            specs.append(part)
    return specs
