"""The small error tree users catch. Failures inside the protocol are data (reasons in events
and actions); these exceptions are raised only at the API boundary, each naming the peer and
the step it concerns."""

from __future__ import annotations


class FTTreeError(Exception):
    """Base of every fttree error."""


class ConfigError(FTTreeError, ValueError):
    """Bad user input: rank, peers list, fault schedule, flags."""


class ProtocolError(FTTreeError):
    """A message broke the protocol (bad frame, unknown kind, mismatched tensor)."""

    def __init__(self, reason: str, *, peer: int | None = None, remote: bool = False) -> None:
        where = "" if peer is None else (f" from rank {peer}" if not remote else f" reported by rank {peer}")
        super().__init__(f"{reason}{where}")
        self.reason = reason
        self.peer = peer
        self.remote = remote


class FrameError(ProtocolError):
    """A frame on the wire could not be decoded; the connection that sent it is closed."""


class PeerError(FTTreeError):
    """A peer could not be reached in time."""

    def __init__(self, reason: str, *, peers: tuple[int, ...] = ()) -> None:
        super().__init__(reason)
        self.reason = reason
        self.peers = peers


class StepAborted(FTTreeError):
    """An allreduce step ended without a result on this worker; `reason` says why and `peers`
    names the ranks whose contributions or links were missing."""

    def __init__(self, step: int, reason: str, *, peers: tuple[int, ...] = ()) -> None:
        super().__init__(f"step {step} aborted: {reason}")
        self.step = step
        self.reason = reason
        self.peers = peers


class TensorMismatch(StepAborted):
    """Workers submitted tensors of different shapes or dtypes for the same step."""


class StepRetry(StepAborted):
    """The group lost a worker during this step and, under on_node_failure="rollback", voided the
    step everywhere: run it again (recompute it, or submit the same contribution) on the new
    view. `epoch` and `members` name that view. DistributedOptimizer does it by itself."""

    def __init__(self, step: int, reason: str, *, peers: tuple[int, ...] = (), epoch: int = 0,
                 members: tuple[int, ...] = ()) -> None:
        super().__init__(step, reason, peers=peers)
        self.epoch = epoch
        self.members = members


class GroupLeft(StepAborted):
    """This worker can produce no more results: it is on the minority side of a partition, or the
    group went on without it. `reason` says which, naming the view."""
