"""simulate() with training state: a joiner takes the model and optimizer state from its donors.

In simulate() a process's training is only its contribution. Here every process also holds a
small model and optimizer that each step's allreduce result updates (as DistributedOptimizer
applies the averaged gradients), and the StateTransfer of fttree.training.elastic, wired to its
simulated node: frames go over the in-memory network, its clock is the fake one, and encoding
and checking a state run as events on that clock instead of on threads. A process admitted into
the running group (`join R @S`, `restart R @S`) asks donors for the state, keeps each step's
result meanwhile, and once the state is checked loads it and replays the kept steps, as
DistributedOptimizer does: from then on it holds the bytes every member holds, which is what a
test checks (`SimTrainer.state_bytes`). Everything stays seeded and on the fake clock.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..core.config import Config
from ..core.view import View
from ..errors import FTTreeError
from ..net.node import Node
from ..training.elastic import StateTransfer
from ..training.state import TrainingState, capture, encode, load
from .sim import Outcome
from .simulate import Simulation, counted, drive, start


class NodeLink:
    """A simulated node as the state transfer's GroupLink (fttree.training.elastic): frames
    leave through the node's transport as events on its clock, as FTTreeAllreduce queues them
    on the node's loop, so a crashed or replaced process sends nothing more."""

    def __init__(self, node: Node) -> None:
        self._node = node

    @property
    def rank(self) -> int:
        return self._node.rank

    @property
    def view(self) -> View:
        return self._node.view

    @property
    def config(self) -> Config:
        return self._node.cfg

    @property
    def joining(self) -> bool:
        return self._node.joining

    @property
    def node(self) -> Node:
        return self._node

    def send_frame(self, dst: int, msg: Any) -> None:
        node = self._node
        node.scheduler.call_later(0.0, lambda: node.transport.send(dst, msg))


class SimTrainer:
    """One process's training: a linear layer of `width` (its parameters are the allreduce's
    `width * (width + 1)` numbers) and SGD with momentum, updated from each step's result; and
    its side of the state transfer. A joiner (`joined_step` set) keeps the results until the
    state is in, then loads it and replays them."""

    LR = 1e-3
    SCALE = 1e-4  # results are sums of counted() contributions (thousands): gradients of about 1

    def __init__(self, node: Node, width: int, seed: int, *, joined_step: int | None = None,
                 offset: int = 0, **transfer: Any) -> None:
        self.model = torch.nn.Linear(width, width)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=self.LR, momentum=0.9)
        self.step_count = 0
        self.offset = offset  # allreduce step = training step + offset
        self.joined_step = joined_step
        self.syncing = joined_step is not None
        self.kept: dict[int, np.ndarray] = {}
        self.failed: dict[int, BaseException] = {}  # training step -> the error its allreduce gave
        clock = node.scheduler

        def on_clock(_name: str, work: Callable[[], None]) -> None:
            """Encoding and checking as events of this process: none once it died, later while it hangs."""
            clock.call_later(0.0, work)

        self.transfer = StateTransfer(NodeLink(node), self.capture, now=clock.monotonic, background=on_clock,
                                      **transfer)
        if joined_step is not None:
            self.transfer.request(joined_step)

    def capture(self) -> TrainingState:
        return capture(self.model, self.optimizer, step_count=self.step_count)

    def state_bytes(self) -> bytes:
        """The training state as the transfer encodes it: equal bytes, equal training."""
        return encode(self.capture()).data

    def _apply(self, result: np.ndarray) -> None:
        grads = torch.from_numpy(result.astype(np.float32)) * self.SCALE
        at = 0
        for p in self.model.parameters():
            p.grad = grads[at:at + p.numel()].reshape(p.shape).clone()
            at += p.numel()
        self.optimizer.step()
        self.step_count += 1

    def outcome(self, user_step: int, outcome: Outcome) -> None:
        """Training step `user_step`'s allreduce gave `outcome`: a member offers the state as
        of this step to joiners that ask, then updates; a joiner keeps it, and catches up once
        its state is checked."""
        if isinstance(outcome, BaseException):
            self.failed[user_step] = outcome
            return
        if not self.syncing:
            self.transfer.serve(user_step)
            self._apply(outcome.data)
            return
        assert self.joined_step is not None
        self.kept[user_step] = np.array(outcome.data, copy=True)
        got = self.transfer.poll(self.joined_step)
        if got is None:
            return
        first, state = got
        if first not in self.kept:
            raise FTTreeError(f"rank {self.transfer.ar.rank}: the training state is as of step {first}, but "
                              f"it kept the results of steps {sorted(self.kept)}")
        load(state, self.model, self.optimizer)
        self.step_count = state.step_count
        for t in sorted(t for t in self.kept if t >= first):
            self._apply(self.kept[t])
        self.kept.clear()
        self.syncing = False


def simulate_training(world: int, faults: str | None = None, steps: int = 20, *, width: int = 16,
                      seed: int = 0, limit_s: float = 600.0, transfer: dict[str, Any] | None = None,
                      before: Callable[[Simulation, dict[int, SimTrainer]], None] | None = None,
                      **settings: Any) -> tuple[Simulation, dict[int, SimTrainer]]:
    """simulate() with a SimTrainer on every process (the latest of each rank in the dict
    returned): the first ones start alike (seeded by `seed`), a joiner from other values, so
    that only the state transfer makes it hold the members' bytes. `transfer`: StateTransfer
    settings (wait_s, max_donors, window); `before(run, trainers)` runs before the first event
    (a test sets its faults or hooks there)."""
    trainers: dict[int, SimTrainer] = {}
    size = width * (width + 1)
    extra = dict(transfer or {})

    def on_outcome(run: Simulation, rank: int, step: int, outcome: Outcome) -> None:
        trainer = trainers[rank]
        trainer.outcome(step - trainer.offset, outcome)

    def on_admitted(run: Simulation, rank: int, first_step: int) -> None:
        node = run.network.nodes[rank]
        assert node.joined_at is not None
        _, first_user_step = node.joined_at
        trainers[rank] = SimTrainer(node, width, seed + 1 + rank, joined_step=first_user_step,
                                    offset=first_step - first_user_step, **extra)

    run = start(world, faults, steps, contribution=counted(size), seed=seed, on_outcome=on_outcome,
                on_admitted=on_admitted, **settings)
    for rank in range(world):  # before any view admits a joiner: every member may be its donor
        trainers[rank] = SimTrainer(run.network.nodes[rank], width, seed, **extra)
    if before is not None:
        before(run, trainers)
    drive(run, limit_s)
    return run, trainers
