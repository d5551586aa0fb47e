"""Emulated edge uplinks for `fttree bench --uplink`: a private network namespace in which each
rank's uplink is shaped (netem/cluster.sh, uplink.sh, loss.sh) and its bytes counted."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys

from ..errors import ConfigError
from . import SOURCE_ROOT
from .units import parse_uplinks


class Uplinks:
    """A private network namespace in which every rank has its own uplink (netem/uplink.sh: an
    htb class per rank address on lo, matched by source). Workers run inside it (`wrap`);
    `apply` sets fresh limits (and zeroes the counters) for a run; `close` removes the limits
    and the namespace, killing anything left inside, and is safe to call twice.

    Nobody outside the namespace is shaped: other jobs on this machine's lo keep full speed."""

    def __init__(self, rate: str, name: str | None = None, loss: float = 0.0) -> None:
        self.spec = parse_uplinks(rate)  # a default rate and per-rank ones: "100mbit,3=10mbit"
        self.rate = self.spec.default
        self.bps = self.spec.bps
        self.loss = loss  # percent of packets to and from every rank dropped (netem/loss.sh)
        self.name = name or f"fttree-bench-{os.getpid()}"
        self.netem = SOURCE_ROOT / "netem"
        self._up = False

    @staticmethod
    def missing() -> str:
        """Why uplinks cannot be emulated here ('' when they can)."""
        if sys.platform != "linux":
            return "uplink limits need Linux (network namespaces, tc)"
        if os.geteuid() != 0:
            return "uplink limits need root (ip netns, tc): run the bench with sudo"
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                return f"uplink limits need {tool} (apt-get install iproute2)"
        return ""

    def _script(self, name: str, *args: str) -> str:
        out = subprocess.run(["bash", str(self.netem / name), *args], capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise ConfigError(f"netem/{name} {' '.join(args)}: {(out.stderr or out.stdout).strip()}")
        return out.stdout

    def start(self, ranks: int) -> None:
        why = self.missing()
        if why:
            raise ConfigError(why)
        self._up = True  # from here on close() has something to undo, even if `up` fails half way
        self._script("cluster.sh", "up", self.name, "-n", str(ranks))

    def apply(self, world: int) -> None:
        args = ["--netns", self.name, "--ranks", str(world),
                *(arg for r, rate in self.spec.by_rank if r < world for arg in ("--rank", f"{r}={rate}")), self.rate]
        self._script("uplink.sh", *args)
        if self.loss:
            self._script("reset.sh", "--netns", self.name)  # the last run's rules (a smaller world's too)
            self._script("uplink.sh", *args)
            for rank in range(world):
                self._script("loss.sh", "--netns", self.name, str(rank), f"{self.loss:g}")

    def lift(self) -> None:
        """No limits until the next `apply`: runs whose speed the uplinks must not set."""
        self._script("uplink.sh", "--netns", self.name, "--remove")

    def counters(self) -> dict[int, int]:
        """rank -> bytes its uplink has carried since the last `apply` (IP headers included)."""
        rows = [line.split() for line in self._script("uplink.sh", "--netns", self.name, "--counters").splitlines()]
        return {int(r[0]): int(r[3]) for r in rows if len(r) >= 4}

    def wrap(self, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *cmd]

    def close(self) -> None:
        if not self._up:
            return
        self._up = False
        with contextlib.suppress(ConfigError, OSError, subprocess.SubprocessError):
            self._script("uplink.sh", "--netns", self.name, "--remove")
        with contextlib.suppress(ConfigError, OSError, subprocess.SubprocessError):
            self._script("cluster.sh", "down", self.name, "--kill")

    def __enter__(self) -> Uplinks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
