"""Shaped uplinks in netem/nat.sh's network (`fttree launch --shape-uplink`): each rank's egress
limited where it leaves the rank, on the interface of its own namespace (eth0 in NAME-rR), by
netem/uplink.sh. A rank behind a NAT is limited on its side of the router, like a public rank
on its side of the bridge, so the two kinds are limited alike and a run with NATs differs from
an all-public one by the NATs only. The limits go with the namespaces when the network is
removed."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import ConfigError
from .realfaults import run_script
from .units import UplinkSpec

DEV = "eth0"  # nat.sh gives every rank's namespace one interface, eth0


@dataclass(frozen=True, slots=True)
class UplinkCounter:
    """What one rank's shaped uplink carried (uplink.sh --counters: bytes with IP headers)."""

    rank: int
    address: str
    rate: str  # as tc prints it: 100Mbit
    sent_bytes: int
    packets: int
    dropped: int
    overlimits: int  # how often a packet waited for the limit: 0 if the limit never held the rank back


def check_spec(spec: UplinkSpec, world: int) -> None:
    """Refuse a RANK=RATE for a rank the job does not have, before anything is built."""
    for rank, rate in spec.by_rank:
        if rank >= world:
            raise ConfigError(f"--shape-uplink {spec}: rank {rank} ({rank}={rate}) is not one of 0..{world - 1}")


def rank_addresses(network: str, world: int) -> list[str]:
    """Each rank's address in `network`, from `nat.sh peers --site-local` (`HOST:PORT [behind SITE]`)."""
    lines = run_script("nat.sh", "peers", network, "--site-local").splitlines()
    if len(lines) != world:
        raise ConfigError(f"network {network} has {len(lines)} ranks, not {world}")
    return [line.split()[0].rsplit(":", 1)[0] for line in lines]


def _uplink_args(network: str, rank: int, address: str) -> list[str]:
    # uplink.sh's rank 0 from base ADDRESS is this rank: one class, matched by its source address
    return ["--netns", f"{network}-r{rank}", "--dev", DEV, "--base", address, "--ranks", "1"]


def shape(network: str, spec: UplinkSpec, world: int) -> dict[int, str]:
    """Limit every rank's uplink in `network` to its rate in `spec`; returns rank -> rate. A
    failure raises RealFaultError with uplink.sh's words (the caller removes the network)."""
    check_spec(spec, world)
    rates = {}
    for rank, address in enumerate(rank_addresses(network, world)):
        rates[rank] = spec.rate_of(rank)
        run_script("uplink.sh", *_uplink_args(network, rank, address), rates[rank])
    return rates


def counters(network: str, world: int) -> dict[int, UplinkCounter]:
    """rank -> what its shaped uplink carried since `shape`."""
    out: dict[int, UplinkCounter] = {}
    for rank, address in enumerate(rank_addresses(network, world)):
        text = run_script("uplink.sh", *_uplink_args(network, rank, address), "--counters")
        rows = [line.split() for line in text.splitlines() if line.strip()]
        if len(rows) != 1 or len(rows[0]) != 7:
            raise ConfigError(f"uplink.sh --counters in {network}-r{rank}: expected one line of 7 fields, "
                              f"got {text!r}")
        _, addr, rate, sent, packets, dropped, overlimits = rows[0]
        out[rank] = UplinkCounter(rank, addr, rate, int(sent), int(packets), int(dropped), int(overlimits))
    return out


def describe(uplinks: Mapping[int, UplinkCounter], steps: int) -> list[str]:
    """The launch's lines on its uplinks: what each rank sent through its limit, per step too."""
    per = max(steps, 1)
    return [f"uplink of rank {c.rank} ({c.address}, {c.rate}, on {DEV} in its namespace): sent "
            f"{c.sent_bytes:,} bytes ({c.sent_bytes / per:,.0f} a step over {steps} steps), held back by the "
            f"limit {c.overlimits:,} times, {c.dropped:,} packets dropped" for c in uplinks.values()]
