"""Elastic membership with real workers over TCP (threads of one process): a killed rank is
restarted and takes its state from a live peer, ending bit for bit where the others are; a new
rank grows the group; a graceful leave costs no timeout; a donor that dies mid-transfer is
replaced by another."""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

import fttree
from fttree.core.messages import State
from fttree.errors import GroupLeft
from fttree.training import elastic, optim
from fttree.training.state import Extra, TrainingState, capture, encode
from tests.conftest import local_peers, run_threads
from tests.procs import Output

MAX_STEPS = 400
SETTINGS = dict(timeout_s=0.2, step_timeout_s=10.0)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 24), torch.nn.ReLU(), torch.nn.Linear(24, 4))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank * 100_003 + step)
    return torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)


def fingerprint(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.blake2b(digest_size=16)
    for t in model.state_dict().values():
        h.update(t.numpy().tobytes())
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                h.update(v.numpy().tobytes())
    h.update(str([g["lr"] for g in opt.param_groups]).encode())
    return h.hexdigest()


@dataclass
class Run:
    """What one worker saw, per training step: a fingerprint of its state after the step,
    the contributors common to the step's buckets, and whether it was still syncing."""

    prints: dict[int, str] = field(default_factory=dict)
    contributors: dict[int, tuple[int, ...]] = field(default_factory=dict)
    synced_from: int | None = None
    error: BaseException | None = None
    transfer: object = None
    steps_run: int = 0


def train(rank: int, peers: list[str] | dict[int, str], run: Run, *, crash_at: int | None = None,
          join: bool | str = False,
          on_step: Callable[[int], None] | None = None, leave_at: int | None = None,
          transfer_wait_s: float | None = None, joiners: int = 1,
          setup: Callable[[fttree.FTTreeAllreduce, fttree.DistributedOptimizer], None] | None = None) -> None:
    ar = fttree.FTTreeAllreduce(rank, peers, join=join, **SETTINGS).start()  # type: ignore[arg-type]
    try:
        model = make_model()
        inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        opt = fttree.DistributedOptimizer(inner, model, allreduce=ar)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.9)
        opt.register_scheduler(sched)
        if transfer_wait_s is not None:
            opt.transfer.wait_s = transfer_wait_s
        if setup is not None:
            setup(ar, opt)
        step = opt.sync.next_round()  # a joiner is admitted here
        synced_for = 0
        while step < MAX_STEPS:
            if crash_at is not None and step == crash_at:
                ar.crash(f"test: rank {rank} killed at training step {step}")
            if leave_at is not None and step == leave_at:
                ar.leave()
                return
            x, y = batch(rank, step)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            sched.step()
            run.steps_run += 1
            if not opt.syncing:
                if run.synced_from is None:
                    run.synced_from = step
                    run.transfer = opt.transfer.record
                run.prints[step] = fingerprint(model, opt)
            assert ar.last is not None
            run.contributors[step] = ar.last.contributors
            # every worker learns the same count of synced joiners, so all stop at the same step
            flag = torch.tensor([1.0 if (ar.joined_at is not None and not opt.syncing) else 0.0])
            synced_for = synced_for + 1 if float(ar.allreduce(flag)[0]) >= joiners else 0
            if on_step is not None:
                on_step(step)
            step += 1
            if synced_for >= 8:
                break
    except GroupLeft as exc:
        if crash_at is None and setup is None:
            run.error = exc
    except BaseException as exc:  # reported by the test
        run.error = exc
    finally:
        ar.close()



def test_a_killed_worker_restarts_takes_its_state_from_a_peer_and_matches_bit_for_bit() -> None:
    peers = local_peers(4)
    runs = {r: Run() for r in range(4)}
    rejoined = Run()
    restart = threading.Event()

    def watch(step: int) -> None:
        if step == 15:
            restart.set()

    def restarted() -> None:
        assert restart.wait(60), "rank 0 never reached step 15"
        train(2, peers, rejoined, join=False)

    run_threads([lambda: train(0, peers, runs[0], on_step=watch), lambda: train(1, peers, runs[1]),
                 lambda: train(2, peers, runs[2], crash_at=10), lambda: train(3, peers, runs[3]), restarted])
    for r in (0, 1, 3):
        assert runs[r].error is None, f"rank {r}: {runs[r].error!r}"
    assert rejoined.error is None, repr(rejoined.error)
    assert rejoined.synced_from is not None
    assert rejoined.synced_from >= 15
    # from its catch-up on, the restarted worker holds the others' parameters and optimizer state bit for bit
    for step, fp in rejoined.prints.items():
        for r in (0, 1, 3):
            assert runs[r].prints[step] == fp, f"rank 2 differs from rank {r} after step {step}"
    after = [s for s in rejoined.prints if s > rejoined.synced_from]
    assert after, "the run ended before the restarted worker contributed"
    for step in after:
        assert 2 in runs[0].contributors[step], f"rank 2 is not among the contributors of step {step}"
    for step in range(10, 15):
        assert 2 not in runs[0].contributors[step]
    record = rejoined.transfer
    assert isinstance(record, elastic.TransferRecord)
    assert record.nbytes > 0


def test_a_joiner_loads_exactly_the_state_its_giver_captured(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole training state, in fttree.training.state's one format, as the donor captured
    it at the step boundary it served, is what the restarted worker holds right after loading:
    model, optimizer (momentum buffers, lr, initial_lr), scheduler, step count and the state
    registered with register_state."""
    peers = local_peers(3)
    runs = {r: Run() for r in range(3)}
    rejoined = Run()
    restart = threading.Event()
    captured: dict[int, tuple[int, str]] = {}  # donor rank -> (step served, digest of what it captured)
    loaded: list[str] = []
    lock = threading.Lock()

    def register_config(opt: fttree.DistributedOptimizer, config: dict[str, object]) -> None:
        opt.register_state("config", lambda: dict(config), config.update)

    def member(ar: fttree.FTTreeAllreduce, opt: fttree.DistributedOptimizer) -> None:
        register_config(opt, {"run": "run-7", "seed": torch.arange(4)})
        transfer, serve = opt.transfer, opt.transfer.serve

        def recording_serve(user_step: int) -> None:
            capture = transfer.capture

            def recording_capture() -> TrainingState:
                state = capture()
                with lock:
                    captured[ar.rank] = (user_step, encode(state).hexdigest)
                return state

            transfer.capture = recording_capture  # type: ignore[method-assign]
            try:
                serve(user_step)
            finally:
                transfer.capture = capture  # type: ignore[method-assign]

        transfer.serve = recording_serve  # type: ignore[method-assign]

    def joiner(ar: fttree.FTTreeAllreduce, opt: fttree.DistributedOptimizer) -> None:
        register_config(opt, {"run": None, "seed": torch.zeros(4, dtype=torch.int64)})

        def recording_load(state: TrainingState, model: object, optimizer: fttree.DistributedOptimizer,
                           scheduler: object, extras: Extra) -> None:
            real_load(state, model, optimizer, scheduler, extras)  # type: ignore[arg-type]
            loaded.append(encode(capture(model, optimizer, scheduler, extras)).hexdigest)  # type: ignore[arg-type]

        monkeypatch.setattr(optim, "load", recording_load)

    real_load = optim.load

    def watch(step: int) -> None:
        if step == 12:
            restart.set()

    def restarted() -> None:
        assert restart.wait(60), "rank 0 never reached step 12"
        train(2, peers, rejoined, setup=joiner)

    run_threads([lambda: train(0, peers, runs[0], on_step=watch, setup=member),
                 lambda: train(1, peers, runs[1], setup=member),
                 lambda: train(2, peers, runs[2], crash_at=6, setup=member), restarted])
    for r in (0, 1):
        assert runs[r].error is None, f"rank {r}: {runs[r].error!r}"
    assert rejoined.error is None, repr(rejoined.error)
    record = rejoined.transfer
    assert isinstance(record, elastic.TransferRecord)
    assert len(loaded) == 1
    assert captured[record.donor] == (record.user_step, loaded[0])
    last = max(rejoined.prints)
    assert rejoined.prints[last] == runs[0].prints[last] == runs[1].prints[last]


def test_a_new_rank_grows_the_group() -> None:
    grow_the_group()


def test_a_new_rank_grows_a_tls_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under mutual TLS, the joiners hold certificates the job's CA signed after the start."""
    from fttree.net import certs

    certs.make(tmp_path, range(4))
    certs.make(tmp_path, [4, 5], add=True)
    monkeypatch.setitem(SETTINGS, "tls_dir", str(tmp_path))
    grow_the_group()


def grow_the_group() -> None:
    peers = local_peers(6)
    runs = {r: Run() for r in range(6)}
    grow = threading.Event()

    def watch(step: int) -> None:
        if step == 5:
            grow.set()

    def joiner(r: int) -> Callable[[], None]:
        def go() -> None:
            assert grow.wait(60), "rank 0 never reached step 5"
            if r == 4:  # knows every address
                train(r, peers, runs[r], join=True, joiners=2)
            else:  # knows only itself and one member: join="HOST:PORT"
                train(r, {r: peers[r]}, runs[r], join=peers[1], joiners=2)
        return go

    first = peers[:4]
    run_threads([lambda: train(0, first, runs[0], on_step=watch, joiners=2),
                 lambda: train(1, first, runs[1], joiners=2), lambda: train(2, first, runs[2], joiners=2),
                 lambda: train(3, first, runs[3], joiners=2), joiner(4), joiner(5)])
    for r, run in runs.items():
        assert run.error is None, f"rank {r}: {run.error!r}"
    last = max(runs[0].prints)
    assert set(runs[0].contributors[last]) == set(range(6))
    for r in (4, 5):
        assert runs[r].prints[last] == runs[0].prints[last]


def test_a_graceful_leave_costs_no_timeout() -> None:
    peers = local_peers(4)
    runs = {r: Run() for r in range(4)}
    stop_after = 30

    def capped(r: int, **kw: object) -> Callable[[], None]:
        def go() -> None:
            train(r, peers, runs[r], **kw)  # type: ignore[arg-type]
        return go

    global MAX_STEPS
    saved, MAX_STEPS = MAX_STEPS, stop_after
    try:
        run_threads([capped(0), capped(1), capped(2, leave_at=12), capped(3)])
    finally:
        MAX_STEPS = saved
    for r in (0, 1, 3):
        assert runs[r].error is None, f"rank {r}: {runs[r].error!r}"
        assert runs[r].steps_run == stop_after
        assert all(2 not in c for s, c in runs[r].contributors.items() if s >= 12)
    assert runs[2].error is None


def die_mid_transfer(ar: fttree.FTTreeAllreduce, opt: fttree.DistributedOptimizer) -> None:
    """Make this worker a donor that sends two pieces and then dies (off the loop thread, which
    the crash needs), answering nothing more."""
    transfer = opt.transfer
    send = transfer._send_piece
    dying = threading.Event()

    def send_then_die(msg: State) -> None:
        if dying.is_set():
            return
        if transfer.pieces_sent >= 2:
            dying.set()
            threading.Thread(target=ar.crash, args=(f"test: donor rank {ar.rank} killed mid-transfer",),
                             daemon=True).start()
            return
        send(msg)

    transfer._send_piece = send_then_die  # type: ignore[method-assign]


def test_a_donor_that_dies_mid_transfer_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(elastic, "CHUNK_BYTES", 256)  # the state (8 kB) in many pieces
    peers = local_peers(4)
    runs = {r: Run() for r in range(4)}
    rejoined = Run()
    restart = threading.Event()

    def watch(step: int) -> None:
        if step == 8:
            restart.set()

    def restarted() -> None:
        assert restart.wait(60), "rank 1 never reached step 8"
        train(3, peers, rejoined)

    run_threads([lambda: train(0, peers, runs[0], setup=die_mid_transfer),
                 lambda: train(1, peers, runs[1], on_step=watch),
                 lambda: train(2, peers, runs[2]), lambda: train(3, peers, runs[3], crash_at=5), restarted])
    for r in (1, 2):
        assert runs[r].error is None, f"rank {r}: {runs[r].error!r}"
    assert rejoined.error is None, repr(rejoined.error)
    record = rejoined.transfer
    assert isinstance(record, elastic.TransferRecord)
    assert record.donors_asked[0] == 0
    assert record.pieces.get(0, 0) <= 2
    assert record.refetched >= 1, record  # rank 0 died owing pieces: they came from the others
    last = max(rejoined.prints)
    assert rejoined.prints[last] == runs[1].prints[last] == runs[2].prints[last]
    assert 0 not in runs[1].contributors[last]
    assert 3 in runs[1].contributors[last]


@pytest.fixture(autouse=True)
def _quiet_numpy() -> None:
    np.seterr(all="ignore")


def test_a_joiner_configuration_that_cannot_work_is_named() -> None:
    with pytest.raises(fttree.ConfigError, match="rank 3 has no address"):
        fttree.FTTreeAllreduce(3, {1: "127.0.0.2:29500"}, join="127.0.0.1:29500")
    with pytest.raises(fttree.ConfigError, match=r"every rank 0\.\.2 needs an address"):
        fttree.FTTreeAllreduce(2, {2: "127.0.0.3:29500"})
    with pytest.raises(fttree.ConfigError, match="expected host:port"):
        fttree.FTTreeAllreduce(2, {2: "127.0.0.3:29500"}, join="no-port-here")


def test_a_joiner_names_a_contact_that_refuses_at_once() -> None:
    """Nobody listens at the contact's address: the joiner says so after its dials, naming the
    address and the refusal, not at the 60 s admission deadline with "asked ranks []"."""
    me, nobody = local_peers(4)[3], local_peers(1)[0]  # two free ports: nothing listens at `nobody`
    ar = fttree.FTTreeAllreduce(3, {3: me}, join=nobody, startup_timeout_s=60).start()
    try:
        with pytest.raises(fttree.PeerError, match=rf"cannot reach its contact {nobody} within 5 s: .*refused"):
            ar.allreduce(np.ones(4, np.float32))
    finally:
        ar.close()


def _worker(rank: int, peers_file: str, *extra: str) -> subprocess.Popen[str]:
    """`fttree worker` with more steps than any test waits for: a test ends it, so how long
    the group lasts never depends on how fast a process starts."""
    return subprocess.Popen([sys.executable, "-m", "fttree", "worker", "--rank", str(rank), "--peers", peers_file,
                             "--steps", "1000000", "--size", "64", "--timeout", "0.2", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_the_worker_command_joins_with_join_and_leaves_on_sigterm(tmp_path: Path) -> None:
    peers = local_peers(4)
    first, grown = tmp_path / "first.txt", tmp_path / "grown.txt"
    first.write_text("\n".join(peers[:3]) + "\n")
    grown.write_text("\n".join(peers) + "\n")
    procs = [_worker(r, str(first)) for r in range(3)]
    outs = [Output(p) for p in procs]
    try:
        outs[0].wait_for("step  10 ")
        procs.append(_worker(3, str(grown), "--join", peers[0]))
        outs.append(Output(procs[3]))
        outs[3].wait_for(" exact", count=10)  # admitted: it runs steps of the group with the group's sums
        procs[1].send_signal(signal.SIGTERM)  # leaves after its step in flight; nobody waits for it
        assert procs[1].wait(timeout=120) == 0, outs[1].text()[-2000:]
        for r in (0, 2, 3):  # the others go on without a timeout
            outs[r].wait_for(" exact", count=outs[r].text_now().count(" exact") + 20)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, out in enumerate(outs):
        assert "FAILED" not in out.text(), f"rank {r}: {out.text()[-2000:]}"
    assert "rank 1 left the group after step" in outs[1].text()
