"""The torchrun guard: `torchrun ... -m fttree.training.rendezvous SCRIPT` tells torchrun's
agent the truth about the job, not about one worker (see `guard`). The address exchange through
the rendezvous store is fttree.net.rendezvous.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..net.rendezvous import env_value as _env
from ..net.rendezvous import store_from_env

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

__all__ = ["GUARD_POLL_S", "guard"]


# ---- running under torchrun's agent -------------------------------------------------------


GUARD_POLL_S = 1.0  # how often a guard whose worker failed looks for the job's outcome


def guard(argv: list[str]) -> int:
    """Run `python SCRIPT ARGS...` as a child; tell torchrun's agent the truth about the job,
    not about this one worker.

    torchrun's agent treats one failed worker as the failure of its whole group: it stops the
    node's other workers and, with restarts left, re-rendezvouses every node. fttree needs
    neither (the survivors evict the dead rank and go on). So a guard whose worker failed
    stays up (the agent sees a worker still running) and waits, in the agent's store, for the
    job's outcome: once any worker of the job finished well it exits 0 (the group went on
    without this one); if every worker failed it exits 1, and torchrun with it. A stop the
    agent asks for (SIGTERM/SIGINT/SIGHUP) is passed on to the child and its real exit status
    returned; so is a failure when there is no agent store to agree in.
    """
    import signal
    import subprocess

    if not argv or argv[0] in ("-h", "--help"):
        print("usage: torchrun [torchrun options] -m fttree.training.rendezvous SCRIPT [ARGS...]\n"
              "Runs SCRIPT; if it fails or is killed, keeps torchrun's agent from stopping the other workers "
              "and exits 0 once another worker finishes well (1 if every worker fails).", file=sys.stderr)
        return 2 if not argv else 0
    child = subprocess.Popen([sys.executable, "-u", *argv])
    asked: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        asked.append(signum)
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    rc = child.wait()
    status = rc if rc >= 0 else 128 - rc
    if asked:
        return status
    outcome = _GuardOutcome.from_env()
    if rc == 0:
        if outcome is not None:
            outcome.finished_well()
        return 0
    rank = _env("RANK") or "?"
    how = f"was killed by {signal.Signals(-rc).name}" if rc < 0 else f"exited with status {rc}"
    if outcome is None:
        print(f"fttree guard: rank {rank} (pid {child.pid}, {argv[0]}) {how}; no torchrun agent store to learn "
              f"whether the others went on, so this is its status", file=sys.stderr, flush=True)
        return status
    print(f"fttree guard: rank {rank} (pid {child.pid}, {argv[0]}) {how}; waiting for the other workers' outcome "
          f"(the agent keeps this node's other workers running meanwhile)", file=sys.stderr, flush=True)
    went_on = outcome.failed(lambda: bool(asked))
    if went_on is None:  # stopped by the agent while waiting, or the store is gone
        return status
    if went_on:
        print(f"fttree guard: rank {rank}: another worker finished well, the group went on without this one; "
              f"telling torchrun this worker succeeded", file=sys.stderr, flush=True)
        return 0
    print(f"fttree guard: rank {rank}: every one of the job's {outcome.world} workers failed", file=sys.stderr,
          flush=True)
    return status


class _GuardOutcome:
    """The job's outcome as the guards agree on it in torchrun's agent store: a worker that
    finished well sets it to "went-on"; the last of `world` failures sets it to "all-failed"
    (both cannot happen: with one success there are fewer than `world` failures)."""

    def __init__(self, store: Store, prefix: str, world: int) -> None:
        self.store, self.prefix, self.world = store, prefix, world

    @classmethod
    def from_env(cls) -> _GuardOutcome | None:
        if _env("TORCHELASTIC_USE_AGENT_STORE") != "True" or not _env("WORLD_SIZE").isdigit():
            return None
        world = int(_env("WORLD_SIZE"))
        try:
            store = store_from_env(-1, world, 30.0)  # the agent hosts it: never the master here
        except Exception:
            return None
        run = _env("TORCHELASTIC_RUN_ID") or "none"
        return cls(store, f"fttree/{run}/{_env('TORCHELASTIC_RESTART_COUNT') or '0'}/guard", world)

    def finished_well(self) -> None:
        with contextlib.suppress(Exception):
            self.store.set(f"{self.prefix}/outcome", "went-on")

    def failed(self, stop: Callable[[], bool]) -> bool | None:
        """Count this failure, then wait for the outcome: True (the group went on), False
        (every worker failed), None (`stop()` became true, or the store went away)."""
        key = f"{self.prefix}/outcome"
        try:
            if self.store.add(f"{self.prefix}/failed", 1) >= self.world:
                self.store.compare_set(key, "", "all-failed")  # unless a success came first
            while not stop():
                if self.store.check([key]):  # raises once the store is gone
                    return self.store.get(key).decode() == "went-on"
                time.sleep(GUARD_POLL_S)  # a store wait cannot be interrupted by the agent's SIGTERM
        except Exception:
            return None
        return None


if __name__ == "__main__":
    sys.exit(guard(sys.argv[1:]))
