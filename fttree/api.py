"""FTTreeAllreduce: the user-facing handle. Runs one rank's Node on a background asyncio loop
(uvloop when available) and turns tensors into steps and steps back into tensors.

    with FTTreeAllreduce(rank=r, peers=[...], timeout_s=0.5) as ar:
        out = ar.allreduce(tensor)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import logging
import os
import socket
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import uvloop

from .core.buffers import BufferPool
from .core.config import COMPRESSIONS, NONFINITE_POLICIES, Config
from .core.dtypes import STEP_DTYPES, step_dtype
from .core.faults import FaultKind, FaultSchedule
from .core.reach import Reach
from .core.reduce_ops import check_reduce, fill_identity
from .core.timeouts import SLACK
from .core.topology import check_rank
from .core.view import View
from .errors import ConfigError, FTTreeError, PeerError, StepAborted
from .net.address import Address, parse_address, parse_peers, reach_classes
from .net.credentials import Credentials, Tls, check_exposure, http_token
from .net.faulty import FaultyTransport, StepMarks
from .net.node import Node, StepResult
from .net.node_status import NodeStatus
from .net.scheduler import AsyncioScheduler
from .net.session import Session
from .net.tcp import TcpTransport
from .status import listener
from .status.monitor import Monitor

if TYPE_CHECKING:
    from .status.control import ControlServer

# Staging buffers tracked for reuse: a step's while it runs, the newest result (`last`) and the
# result the caller still holds. Few: each is as large as a submitted tensor, and one nobody
# holds stays allocated until the pool drops it.
STAGING_BUFFERS = 4

log = logging.getLogger("fttree.api")


def _private_copy(array: np.ndarray, staging: BufferPool, dtype: np.dtype | None = None) -> np.ndarray:
    """`array` as a flat little-endian copy of our own (converted to `dtype`, if given), in a
    staging buffer the last steps' callers have let go of where there is one (a fresh 100 MB
    array costs its pages' zeroing)."""
    flat = staging.array(array.size, dtype if dtype is not None else array.dtype.newbyteorder("<"))
    np.copyto(flat.reshape(array.shape), array, casting="unsafe")
    return flat


def _as_flat_array(tensor: Any, staging: BufferPool) -> tuple[np.ndarray, str, Any]:
    """A private flat copy in a wire dtype, the signature workers compare, and how to convert
    the result back. torch is imported only when a torch tensor is passed."""
    if isinstance(tensor, np.ndarray):
        wire = step_dtype(tensor.dtype.name)  # the one table (core/dtypes.py): bool and small ints as int64
        return _private_copy(tensor, staging, wire), f"{tensor.dtype.name}{list(tensor.shape)}", \
            ("numpy", tensor.shape, tensor.dtype)
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"allreduce takes a torch.Tensor or numpy.ndarray, not {type(tensor).__name__}")
    src = tensor.detach()
    wire = step_dtype(str(src.dtype).removeprefix("torch."))
    host = src.to("cpu", torch.from_numpy(np.empty(0, wire)).dtype).contiguous()
    flat = host.numpy().reshape(-1)
    if host.data_ptr() == src.data_ptr():  # no conversion made a copy: make our own
        flat = _private_copy(flat, staging)
    sig = f"{str(src.dtype).removeprefix('torch.')}{list(src.shape)}"
    return flat, sig, ("torch", src.shape, src.dtype, src.device)


def check_flat(flat: Any) -> None:
    """Raise TypeError/ValueError unless `flat` is what a step can carry: a 1-D, C-contiguous,
    little-endian numpy array of a wire dtype."""
    if not isinstance(flat, np.ndarray):
        raise TypeError(f"submit_array takes a numpy array, not {type(flat).__name__} (allreduce() takes tensors)")
    if flat.ndim != 1:
        raise ValueError(f"submit_array takes a 1-D array, got shape {flat.shape}: pass array.reshape(-1)")
    if flat.dtype.newbyteorder("<") not in STEP_DTYPES or flat.dtype.byteorder == ">":
        raise TypeError(f"submit_array supports little-endian float16/32/64 and int32/64, not {flat.dtype} "
                        f"(allreduce() converts other types: core/dtypes.py)")
    if not flat.flags.c_contiguous:
        raise ValueError("submit_array needs a contiguous array: pass np.ascontiguousarray(array)")


def finite(flat: np.ndarray) -> bool:
    """No NaN or Inf in a float array (integers always are). Checked in the caller's thread,
    where the contribution enters, before anything is sent."""
    return flat.dtype.kind != "f" or bool(np.isfinite(flat).all())


def _restore(data: np.ndarray, how: Any) -> Any:
    if how[0] == "numpy":
        return data.reshape(how[1]).astype(how[2], copy=False)
    import torch

    _, shape, dtype, device = how
    return torch.from_numpy(data).reshape(shape).to(device=device, dtype=dtype)


class FTTreeAllreduce:
    """Fault-tolerant tree allreduce for one rank.

    `peers` lists every rank's "host:port" (index = rank; "-" for a rank nobody can dial, behind a
    NAT: docs/nat.md). Settings are the fields of
    `fttree.Config` (durations in seconds, named `*_s`), given as keywords or as `config`:
    `timeout_s` is the backup-link watch (the first guess of the adaptive policy),
    `step_timeout_s` bounds a whole step, after which it raises StepAborted naming what it
    waited for (put off by up to `submit_wait_s` while a member says it is still computing).
    `faults` is an in-process fault schedule (see fttree.core.faults).
    `http_port` (0: any free port) serves /status, /metrics and /faults (see fttree.status.control).
    `join=True` asks the running group named by `peers` to admit this rank (a restarted worker
    finds the group by itself); `join="HOST:PORT"` asks through that member, and then `peers`
    needs only this rank's own address, as `{rank: "host:port"}` (docs/failures.md, "Elastic jobs").
    """

    def __init__(self, rank: int, peers: Sequence[str | Address] | Mapping[int, str | Address], *,
                 config: Config | None = None,
                 faults: str | FaultSchedule | None = None, http_port: int | None = None,
                 http_host: str | None = None, http_token: str | None = None, join: bool | str = False,
                 auth_key: bytes | None = None, **settings: Any) -> None:
        table = dict(peers.items()) if isinstance(peers, Mapping) else dict(enumerate(peers))
        if not table:
            raise ConfigError("peers is empty: list one host:port per rank")
        known = {r: p if isinstance(p, Address) else parse_address(p) for r, p in table.items()}
        parse_peers([str(a) for a in known.values()])  # duplicate check
        if rank not in known:
            if isinstance(peers, Mapping):
                raise ConfigError(f"rank {rank} has no address in peers (ranks {sorted(known)})")
            try:  # a list: the rank is past its end
                check_rank(rank, len(known))
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        self.contact = parse_address(join) if isinstance(join, str) else None
        if self.contact is not None and not known[rank].dialable_from(self.contact):
            raise ConfigError(f"rank {rank} is listed as {known[rank]}: the member at {self.contact} could not send "
                              f"to it through a contact yet. Behind a NAT, join with every rank's address (the "
                              f"peers file and join=True): it then dials each member, which answers on that "
                              f"connection (docs/nat.md)")
        addresses = [known.get(r, known[rank]) for r in range(max(known) + 1)]
        if len(known) != len(addresses) and self.contact is None:
            raise ConfigError(f"peers names ranks {sorted(known)}: every rank 0..{max(known)} needs an address "
                              f"(a mapping of some ranks only is for join='HOST:PORT')")
        try:
            check_rank(rank, len(addresses))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.config = Config.build(config, **settings)
        self.credentials = (Credentials.from_key(auth_key) if auth_key is not None else
                            Credentials.from_key_file(self.config.auth_key_file))
        cfg = self.config
        if cfg.tls_dir is not None:
            self.credentials = self.credentials.with_tls(Tls.from_dir(cfg.tls_dir, rank))
        elif cfg.tls_cert_file is not None and cfg.tls_key_file is not None and cfg.tls_ca_file is not None:
            self.credentials = self.credentials.with_tls(Tls.from_files(cfg.tls_cert_file, cfg.tls_key_file,
                                                                        cfg.tls_ca_file))
        check_exposure(self.credentials, known.values(), self.config.insecure)
        if not isinstance(faults, FaultSchedule):
            faults = FaultSchedule(faults, world=len(addresses), seed=rank)
        hangs = [str(r) for r in faults.node_faults() if r.kind is FaultKind.HANG]
        if hangs:
            raise ConfigError(f"{'; '.join(hangs)}: a hang is carried out by `fttree launch` (SIGSTOP, then SIGCONT) "
                              f"and the simulator; a worker cannot stop and resume itself in-process")
        self.rank, self.world = rank, len(addresses)
        self.peers = addresses
        self.faults = faults
        self.transport: FaultyTransport | None = None
        self.node: Node | None = None
        self.session: Session | None = None  # the node's asyncio waits (start, admit, leave, close)
        self.last: StepResult | None = None  # the newest completed step, whatever submitted it
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._next_step = 0
        self._marks = StepMarks()  # user steps (training steps) for fault windows
        # private copies of submitted tensors, in buffers used again once their results are let go
        self.staging = BufferPool(keep=STAGING_BUFFERS, lock=threading.Lock())  # callers may use threads
        self._lock = threading.Lock()
        self.http_port, self.http_host, self.http_token = http_port, http_host, http_token
        self.monitor: Monitor | None = None
        self.control: ControlServer | None = None  # serving once aiohttp is imported (_serve_control)
        self._http_sock: socket.socket | None = None  # its listening socket, bound by start()
        self.join = bool(join)
        self.crashed: str | None = None  # why crash() stopped this rank (fault injection), if it did
        self._known = known

    # ---- lifecycle ---------------------------------------------------------------------

    @classmethod
    def from_env(cls, **kwargs: Any) -> FTTreeAllreduce:
        """Build from FTTREE_RANK/FTTREE_PEERS, or torchrun's RANK/WORLD_SIZE; every setting
        from its own variable (Config.env_name: FTTREE_STEP_TIMEOUT, FTTREE_TLS_DIR, ...).

        FTTREE_PEERS is a comma-separated host:port list or a file with one per line. Without
        it, under torchrun (WORLD_SIZE, MASTER_ADDR, MASTER_PORT) each rank publishes its own
        address in the rendezvous store and reads everyone's (fttree.net.rendezvous), so
        jobs span hosts; with WORLD_SIZE alone, the workers are on this machine at 127.0.0.1
        and ports FTTREE_BASE_PORT + rank.
        """
        env = os.environ
        kwargs = {**Config.from_env(env), **kwargs}  # any setting by its FTTREE_ variable; arguments win
        rank_text = env.get("FTTREE_RANK", env.get("RANK"))
        if rank_text is None or not rank_text.strip().lstrip("-").isdigit():
            raise ConfigError(f"set FTTREE_RANK (or torchrun's RANK) to this worker's rank, got {rank_text!r}")
        peers_text = env.get("FTTREE_PEERS", "")
        if peers_text:
            path = Path(peers_text)
            lines = path.read_text().splitlines() if "," not in peers_text and path.is_file() else peers_text.split(",")
            peers = parse_peers(lines)
        elif env.get("WORLD_SIZE", "").isdigit() and env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
            from .net.rendezvous import rendezvous_from_env_store

            given = {k: v for k, v in kwargs.items() if k == "startup_timeout_s"}
            wait = Config.build(kwargs.get("config"), **given).startup_timeout_s
            peers, key = rendezvous_from_env_store(int(rank_text), int(env["WORLD_SIZE"]), wait)
            if key is not None:
                kwargs.setdefault("auth_key", key)
        elif env.get("WORLD_SIZE", "").isdigit():
            base = int(env.get("FTTREE_BASE_PORT", "29600"))
            peers = [Address("127.0.0.1", base + r) for r in range(int(env["WORLD_SIZE"]))]
        else:
            raise ConfigError("set FTTREE_PEERS (host:port list or file) or WORLD_SIZE")
        return cls(int(rank_text), peers, **kwargs)

    def start(self) -> FTTreeAllreduce:
        if self._thread is not None:
            return self
        ready: Future[None] = Future()
        self._thread = threading.Thread(target=self._run_loop, args=(ready,), name=f"fttree-rank{self.rank}",
                                        daemon=True)
        self._thread.start()
        try:
            ready.result(timeout=self.config.startup_timeout_s + 10)
        except BaseException:
            self._join()
            raise
        return self

    def _run_loop(self, ready: Future[None]) -> None:
        loop = uvloop.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        scheduler = AsyncioScheduler(loop)
        cfg = self.config
        tcp = TcpTransport(self.rank, self._known, connect_timeout_s=cfg.connect_timeout_s,
                           stall_timeout_s=cfg.stall_timeout_s, max_payload_bytes=cfg.max_payload_bytes,
                           credentials=self.credentials, handshake_timeout_s=cfg.handshake_timeout_s,
                           max_pending_handshakes=cfg.max_pending_handshakes,
                           receive_pool_bytes=cfg.receive_pool_bytes, hole_punch=cfg.hole_punch)
        self.transport = FaultyTransport(tcp, self.faults, scheduler, self._marks)
        reach = Reach.of(reach_classes(self._known))  # the trees place ranks behind NATs as leaves (core/reach.py)
        self.node = Node(self.rank, View.initial(self.world, reach), cfg, self.transport, scheduler, join=self.join,
                         contact=self.contact)
        self.session = session = Session(self.node)
        self.monitor = Monitor(self.node, world=self.world)
        serving: asyncio.Task[None] | None = None
        try:
            loop.run_until_complete(session.start())
            if self.http_port is not None:  # bound now (a port in use fails the start), served soon
                host = self.http_host or listener.default_http_host(self.peers[self.rank].host)
                self._http_sock = listener.bind(self.rank, host, self.http_port)
                serving = loop.create_task(self._serve_control(self._http_sock, host))
        except BaseException as exc:
            self.monitor.close()
            loop.run_until_complete(self.node.close())
            loop.close()
            ready.set_exception(exc if isinstance(exc, FTTreeError) else PeerError(f"rank {self.rank}: {exc}"))
            return
        ready.set_result(None)
        try:
            loop.run_forever()
        finally:
            if serving is not None and not serving.done():
                serving.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    loop.run_until_complete(serving)
            if self.control is not None:
                loop.run_until_complete(self.control.close())
            if self._http_sock is not None:
                self._http_sock.close()
            self.monitor.close()
            loop.run_until_complete(self.node.close())
            loop.close()

    async def _serve_control(self, sock: socket.socket, host: str) -> None:
        """Serve /status, /metrics and /faults on the bound `sock`. aiohttp takes a second to
        import on a loaded machine, so it is imported on a thread of its own and nothing waits
        for it: not the start, not a restarted worker's join (issue 40: its heal in steps)."""
        loop = asyncio.get_running_loop()
        try:
            module = await loop.run_in_executor(None, importlib.import_module, "fttree.status.control")
            assert self.node is not None
            assert self.monitor is not None
            assert self.transport is not None
            token = self.http_token or http_token(self.credentials.key)
            control = module.ControlServer(self.node, self.monitor, self.transport, world=self.world, host=host,
                                           port=sock.getsockname()[1], token=token, sock=sock)
            await control.start()
            self.control = control
        except (OSError, FTTreeError, ImportError) as exc:
            log.error("rank %d: the control server on %s did not start: %s", self.rank, listener.address_of(sock), exc)

    @property
    def http_address(self) -> str | None:
        """host:port of the control server (bound by start(); None without one)."""
        return None if self._http_sock is None else listener.address_of(self._http_sock)

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def close(self) -> None:
        """Stop this rank. It first tells the group it is done and stays until every member is
        (or has left the view; at most `step_timeout_s`), then while a peer may still need its
        relay or result for a finished step (up to the protocol's linger time, at most 10 s),
        then until what it sent is acknowledged."""
        loop, node, session = self._loop, self.node, self.session
        if loop is not None and not loop.is_closed() and node is not None and session is not None and node.started:
            finish = self.config.step_timeout_s
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(session.finish(finish), loop).result(finish + 2)
            limit = min(self.config.linger_s, 10.0)
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(session.quiesce(limit), loop).result(limit + 2)
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(loop.stop)
        self._join()
        self._loop = None

    def __enter__(self) -> FTTreeAllreduce:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- allreduce ---------------------------------------------------------------------

    def submit_array(self, flat: np.ndarray, signature: str, *, contribute: bool = True,
                     nonfinite: str | None = None, reduce: str = "sum",
                     compression: str | None = None, closable: bool = False) -> Future[StepResult]:
        """Low-level: start a step on a flat array the caller hands over (not copied).
        `contribute=False`: take part with the op's identity (zeros for a sum), not counted
        among the contributors (a joiner still receiving its state does). `nonfinite` overrides
        Config.nonfinite for this step ("allow" for a broadcast or a gather, which move values,
        not sum gradients; the default for every `reduce` but "sum"). `reduce`: how the
        contributions meet, "sum" or one of core/reduce_ops.REDUCE_OPS (max, min, product,
        band, bor, bxor); every rank must pass the same, or the step fails as a mismatch.
        `compression`: this step's float32 data travels as "bf16", "fp16" or "int8" (None:
        Config.compression); ranks may differ. `closable`: under straggler_policy="deadline" the
        step may close without late members (their contributions are left out and the result
        names them in `late`): for averaged gradients, whose result says whom it holds; every
        other step waits for every member."""
        if self._loop is None or self.node is None:
            raise FTTreeError("FTTreeAllreduce is not started: use it as a context manager or call start()")
        if nonfinite is not None and nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {', '.join(NONFINITE_POLICIES)}, got {nonfinite!r}")
        check_flat(flat)  # before a step number is used: peers would wait for it
        check_reduce(reduce, flat.dtype)
        if compression is not None and (compression not in COMPRESSIONS or flat.dtype != np.float32):
            raise ValueError(f"compression must be one of {', '.join(c for c in COMPRESSIONS if c)} and the data "
                             f"float32, got {compression!r} for {flat.dtype} data")
        if reduce != "sum":
            signature = f"{reduce} of {signature}"  # a rank that reduces otherwise fails the step as a mismatch
            nonfinite = nonfinite or "allow"
        if flat.size == 0:
            return self._empty_step(flat, signature, contribute, nonfinite, reduce)
        self.admit()  # a joiner's first step: now it takes part
        future: Future[StepResult] = Future()
        future.add_done_callback(self._remember)  # first, so `last` is set before any user callback runs
        with self._lock:
            step = self._next_step
            self._next_step += 1
            self._marks.next_step = self._next_step
        crash = self._crash_rule(step)
        if crash is not None:
            self.crash(f"rank {self.rank} crashed at step {self._marks.user_step(step)} "
                       f"(fault injection: {crash})")
        node = self.node
        policy = nonfinite or self.config.nonfinite
        if contribute and policy != "allow" and not finite(flat):
            if policy == "skip":  # as a mixed-precision optimizer skips a step
                fill_identity(flat, reduce)
                self._loop.call_soon_threadsafe(lambda: node.submit(step, flat, signature, future, contribute=False,
                                                                    reduce=reduce, compression=compression,
                                                                    closable=closable))
                self._loop.call_soon_threadsafe(node.skipped_nonfinite, step)
                return future
            reason = f"rank {self.rank}'s contribution to step {step} holds NaN or Inf (nonfinite='abort')"
            self._loop.call_soon_threadsafe(lambda: node.submit(step, flat, signature, future, abort=reason,
                                                                reduce=reduce, compression=compression))
            return future
        if not contribute:
            fill_identity(flat, reduce)
        self._loop.call_soon_threadsafe(lambda: node.submit(step, flat, signature, future, contribute=contribute,
                                                            reduce=reduce, compression=compression,
                                                            closable=closable))
        return future

    def _empty_step(self, flat: np.ndarray, signature: str, contribute: bool,
                    nonfinite: str | None, reduce: str) -> Future[StepResult]:
        """A zero-element step (a frozen layer's bucket, a rank with no samples of a class):
        nothing to add, but every rank still takes part, so steps stay numbered alike, a rank
        that passes a non-empty array there is named, and the result says who contributed. It
        runs as one zero element; the caller gets its empty array back."""
        one = np.zeros(1, flat.dtype)
        fill_identity(one, reduce)
        carried = self.submit_array(one, f"{signature} (empty)", contribute=contribute, nonfinite=nonfinite,
                                    reduce=reduce)
        outer: Future[StepResult] = Future()

        def done(inner: Future[StepResult]) -> None:
            exc = inner.exception()
            if exc is not None:
                outer.set_exception(exc)
            else:
                outer.set_result(dataclasses.replace(inner.result(), data=flat))

        carried.add_done_callback(done)
        return outer

    def _crash_rule(self, step: int) -> str | None:
        """The `crash` rule for this rank that strikes when it reaches allreduce `step`, if any."""
        user = self._marks.user_step(step)
        for rule in self.faults.node_faults(self.rank):
            if rule.kind is FaultKind.CRASH and user is not None and rule.first_step == user:
                return str(rule)
        return None

    def crash(self, reason: str) -> None:
        """Die as a killed process would (fault injection, tests): every connection of this rank
        is reset and its listener closed at once; this and every later step fails with GroupLeft
        naming `reason`. The handle stays usable for close()."""
        self.crashed = reason
        loop, node = self._loop, self.node
        if loop is None or node is None or loop.is_closed():
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(node.crash(reason), loop).result(timeout=10)

    def status(self, timeout_s: float = 10.0) -> NodeStatus:
        """This rank's status (what /status serves), taken on the node's event loop: the node
        changes its state only there, so a read from this thread could see a dict mid-change."""
        loop, node = self._loop, self.node
        if loop is None or node is None or loop.is_closed():
            raise FTTreeError(f"rank {self.rank}: no status, the node is not running")

        async def take() -> NodeStatus:
            return node.status()

        try:
            return asyncio.run_coroutine_threadsafe(take(), loop).result(timeout=timeout_s)
        except FutureTimeout:
            raise PeerError(f"rank {self.rank}: its event loop did not answer a status request "
                            f"within {timeout_s:g} s") from None

    @property
    def view(self) -> View:
        """The membership view this rank is in now (epoch, ranks in tree slots)."""
        return self.node.view if self.node is not None else View.initial(self.world)

    @property
    def left_group(self) -> str | None:
        """Why this rank is no longer in the group (the group went on without it, or its side
        of a partition has no majority), or None while it is a member. A rank left out during
        its last step may have delivered a result of that step that the group did not settle
        on: check this after `close()`."""
        return None if self.node is None else self.node.stopped

    @property
    def joined_at(self) -> tuple[int, int] | None:
        """For a worker that joined a running group: (its first allreduce step, its first
        training step); None for a worker of the first start."""
        return None if self.node is None else self.node.joined_at

    def send_frame(self, dst: int, msg: Any) -> None:
        """Queue a frame (fttree.core.messages.Frame) for rank `dst` from any thread: the
        training layer's state transfer uses the node's links."""
        loop, node = self._loop, self.node
        if loop is not None and node is not None and not loop.is_closed():
            loop.call_soon_threadsafe(node.transport.send, dst, msg)

    def leave(self) -> None:
        """Leave the group for good after the steps submitted so far: the others drop this rank
        from their next view at once, without detecting a failure or paying a timeout. Later
        steps here raise GroupLeft; close() afterwards."""
        loop, node, session = self._loop, self.node, self.session
        if loop is None or node is None or session is None or loop.is_closed():
            return
        limit = max(3 * node.membership.node_deadline_s, 2.0) + 5
        asyncio.run_coroutine_threadsafe(session.leave(), loop).result(timeout=limit)

    @property
    def step(self) -> int:
        """The number the next allreduce step submitted here will have."""
        return self._next_step

    @property
    def late_steps_ahead(self) -> int:
        """Allreduce steps, from the next one submitted here, that the group already closed
        without this rank (Config.straggler_policy="deadline": it was late). Their results are
        here or on their way; submitting them returns at once and adds nothing. A training loop
        that skips them (DistributedOptimizer.steps_behind) catches up with the group."""
        return 0 if self.node is None else self.node.machine.closed_run(self._next_step)

    @property
    def joining(self) -> bool:
        """True for a worker that joins a running group (restarted, or new with join=...): it is
        admitted at its first step (or at admit()), and skips the setup the group did long ago."""
        return self.node is not None and self.node.joining

    def admit(self) -> None:
        """A joiner: be admitted into the running group now (its first step does this by itself).
        Afterwards `joined_at` and `step` say where in the group's steps this worker starts."""
        loop, node, session = self._loop, self.node, self.session
        if loop is None or node is None or session is None or not node.joining or node.joined_at is not None:
            return
        limit = self.config.startup_timeout_s + 10
        try:
            asyncio.run_coroutine_threadsafe(session.admit(), loop).result(timeout=limit)
        except FutureTimeout:
            raise PeerError(f"rank {self.rank}: not admitted within {limit:g} s (event loop stuck?)") from None
        assert node.joined_at is not None
        with self._lock:  # the group's step numbers from here on
            self._next_step = self._marks.next_step = node.joined_at[0]

    def mark_step(self, user_step: int | None) -> None:
        """Allreduce steps submitted from now on belong to `user_step` (a training step; None:
        setup, which no fault window hits), so that fault windows (`faults=`, POST /faults)
        count the steps the user sees, not the setup collectives or the several gradient buckets
        of one training step. DistributedOptimizer marks its steps itself; a plain torch loop
        over the backend calls this once per iteration. Without marks, windows count allreduce
        steps."""
        self.admit()  # a joiner's first step: now it takes part
        with self._lock:
            self._marks.mark(self._next_step, user_step)
            first = self._next_step
        if self._loop is not None and self.node is not None:
            # in order with the submits that follow: a join decided for this step takes effect here
            self._loop.call_soon_threadsafe(self.node.boundary, user_step, first)

    def _remember(self, done: Future[StepResult]) -> None:
        """Keep the newest completed step in `last`, whichever path submitted it."""
        if done.cancelled() or done.exception() is not None:
            return
        res = done.result()
        with self._lock:
            if self.last is None or res.step > self.last.step:
                self.last = res

    def allreduce_async(self, tensor: Any, *, average: bool = False, reduce: str = "sum",
                        compression: str | None = None, closable: bool = False) -> Future[Any]:
        """Start an allreduce; the Future gives the summed (or averaged) tensor, or with
        `reduce` its elementwise max, min, product, band, bor or bxor over the contributors.
        `compression`: a float32 tensor travels as "bf16", "fp16" or "int8" (None:
        Config.compression). `closable`: a sum that may close without late members
        (submit_array); `last` then says whom it holds."""
        flat, signature, how = _as_flat_array(tensor, self.staging)
        if average and (flat.dtype.kind != "f" or reduce != "sum"):
            raise TypeError(f"average=True needs a floating-point tensor and reduce='sum' (got {flat.dtype}, "
                            f"{reduce!r})")
        inner = self.submit_array(flat, signature, reduce=reduce, compression=compression, closable=closable)
        outer: Future[Any] = Future()

        def finish(done: Future[StepResult]) -> None:
            try:
                res = done.result()
            except BaseException as exc:
                outer.set_exception(exc)
                return
            data = res.data / len(res.contributors) if average else res.data
            try:
                outer.set_result(_restore(np.asarray(data, dtype=res.data.dtype), how))
            except BaseException as exc:  # conversion back failed: report it, never hang
                outer.set_exception(exc)

        inner.add_done_callback(finish)
        return outer

    def outcome_limit_s(self, nbytes: int) -> float:
        """How long a blocking call waits for a step's outcome before it calls the event loop
        stuck. The node fails a step itself, at a deadline that allows three times the step's
        bytes at the slowest rate it knows (TreeMachine._extended, core/tree_deadlines.py); this
        backstop allows twice that at the slowest rate known here (the view's pace, the declared
        uplinks), so a healthy 100 MB step behind 10 Mbit/s (80 s and more) is not cut short,
        and the node's wait for a member still computing (submit_wait_s)."""
        cfg = self.config
        rate = min(self.view.pace or cfg.uplink_bytes_per_s, cfg.slowest_declared)
        return cfg.step_timeout_s + cfg.submit_wait_s + 10 + 2 * SLACK * 3 * nbytes / rate

    def allreduce(self, tensor: Any, *, average: bool = False, reduce: str = "sum",
                  compression: str | None = None, closable: bool = False) -> Any:
        """Blocking allreduce. Raises StepAborted (naming peers) if the step cannot finish."""
        future = self.allreduce_async(tensor, average=average, reduce=reduce, compression=compression,
                                      closable=closable)
        limit = self.outcome_limit_s(int(getattr(tensor, "nbytes", 0)))
        try:
            return future.result(timeout=limit)
        except FutureTimeout:
            raise StepAborted(self._next_step - 1, f"no outcome within {limit:g} s (event loop stuck?)") from None
