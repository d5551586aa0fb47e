"""fttree as a torch.distributed backend, so unmodified DistributedDataParallel code runs on it.

    import fttree.training.backend  # registers the "fttree" backend
    dist.init_process_group("fttree")  # under torchrun, or with an explicit store/rank/world_size

Each rank picks an address (FTTREE_HOST or the interface that reaches MASTER_ADDR, port
FTTREE_PORT + LOCAL_RANK or a free one), publishes it once in the store torch hands the
backend, reads everyone else's, and starts an FTTreeAllreduce. From then on the store is not
used: every collective is one fttree step, submitted in call order (which torch.distributed
requires to be the same on every rank anyway).

Every collective is one fttree step, so it has the tree's exactly-once and contributor rules:
allreduce and reduce (SUM, AVG, PRODUCT, MIN, MAX; BAND/BOR/BXOR on integers), broadcast (the
root contributes its tensor, the others -0.0, and x + -0.0 is x to the bit), allgather, gather
and all_to_all (each rank fills its own slot of a buffer of -0.0), scatter (a broadcast of the
root's list), reduce_scatter (a full allreduce, each rank keeps its part) and barrier (a
one-element step). send and recv raise NotImplementedError at once: a rank is linked to its
tree neighbours only. docs/pytorch.md has the table of ops, dtypes and results.

Settings come from the environment so that torchrun scripts need no change: every Config
field by its own variable (FTTREE_ and its name in capitals, without the `_s` of seconds:
FTTREE_TIMEOUT, FTTREE_STEP_TIMEOUT, FTTREE_CHUNK_BYTES, FTTREE_NONFINITE, FTTREE_TLS_DIR, ...;
docs/configuration.md lists them), FTTREE_FAULTS (in-process fault schedule), FTTREE_HOST,
FTTREE_PORT, and FTTREE_AUTH_KEY_FILE (the job's key; by default rank 0 puts a fresh one in the
store, which is torchrun's trust boundary already).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Store

from ..api import FTTreeAllreduce
from ..core.config import Config
from ..core.reduce_ops import BITWISE
from ..errors import ConfigError
from ..net.node import StepResult
from ..net.rendezvous import exchange, job_key, local_host, pick_port
from .buckets import blank, copy_divided, digest, wire_dtype
from .ddp import pending_future

log = logging.getLogger("fttree.training.backend")

__all__ = ["BACKEND", "FTTreeProcessGroup", "FTTreeWork", "allreduce_of", "register"]

BACKEND = "fttree"


class FTTreeWork(dist.Work):
    """A collective in flight. `wait()` raises the fttree error itself (StepAborted,
    TensorMismatch, ...); C++ callers such as DDP's reducer see it through `get_future()`."""

    def __init__(self, inner: torch.futures.Future[Any], outer: torch.futures.Future[Any],
                 outputs: list[torch.Tensor]) -> None:
        super().__init__()
        self._inner, self._outer, self._outputs = inner, outer, outputs

    def wait(self, timeout: timedelta | None = None) -> bool:
        value = self._inner.wait()
        if isinstance(value, BaseException):
            raise value
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        return self._outer

    def is_completed(self) -> bool:
        return self._inner.done()

    def is_success(self) -> bool:
        return self._inner.done() and not isinstance(self._inner.value(), BaseException)

    def exception(self) -> BaseException | None:
        value = self._inner.value() if self._inner.done() else None
        return value if isinstance(value, BaseException) else None

    def result(self) -> list[torch.Tensor]:
        return self._outputs


def _pack(tensors: Sequence[torch.Tensor], what: str) -> tuple[np.ndarray, str]:
    """Copy tensors into one flat host array of their wire dtype; the signature names the
    collective and the shapes so ranks that disagree fail the step with TensorMismatch."""
    dtypes = {wire_dtype(t.dtype) for t in tensors}
    if len(dtypes) != 1:
        raise TypeError(f"fttree backend: {what} needs tensors of one dtype, got {[str(t.dtype) for t in tensors]}")
    dtype = dtypes.pop()
    flat = np.empty(sum(t.numel() for t in tensors), dtype=dtype)
    view, offset = torch.from_numpy(flat), 0
    for t in tensors:
        view[offset:offset + t.numel()].copy_(t.detach().reshape(-1))
        offset += t.numel()
    return flat, f"{what} {dtype.name}[{flat.size}] #{digest(tuple(t.shape) for t in tensors)}"


def _unpack(flat: np.ndarray, tensors: Sequence[torch.Tensor], divisor: int = 1) -> None:
    """Copy (and divide) a result into the tensors; `flat` is only read: at the root it is
    also the payload of the result still queued for the children."""
    src, offset = torch.from_numpy(flat), 0
    with torch.no_grad():
        for t in tensors:
            copy_divided(t, src[offset:offset + t.numel()].view(t.shape), divisor)
            offset += t.numel()


def _op_name(op: Any) -> str:
    return str(getattr(op, "op", op)).rpartition(".")[2]


_REDUCE = {"SUM": "sum", "AVG": "sum", "PRODUCT": "product", "MIN": "min", "MAX": "max",
           "BAND": "band", "BOR": "bor", "BXOR": "bxor"}


def _reduce_of(name: str, what: str, tensors: Sequence[torch.Tensor]) -> str:
    """The fttree reduction for torch's ReduceOp `name`, or an error naming the op at once."""
    reduce = _REDUCE.get(name)
    if reduce is None:
        raise NotImplementedError(f"fttree backend: {what} does not support ReduceOp.{name} (supported: "
                                  f"{', '.join(_REDUCE)}); for PREMUL_SUM scale the tensor, then use SUM")
    dtypes = [str(t.dtype) for t in tensors]
    if name == "AVG" and not all(t.is_floating_point() for t in tensors):
        raise TypeError(f"fttree backend: ReduceOp.AVG needs floating-point tensors, got {dtypes}")
    if reduce in BITWISE and any(t.is_floating_point() or t.is_complex() for t in tensors):
        raise TypeError(f"fttree backend: ReduceOp.{name} needs integer or bool tensors, got {dtypes}")
    return reduce


class FTTreeProcessGroup(dist.ProcessGroup):
    """A ProcessGroup whose collectives run as fttree steps (see the module docstring)."""

    def __init__(self, store: Store | None, rank: int, world_size: int, timeout: timedelta | None = None, *,
                 allreduce: FTTreeAllreduce | None = None) -> None:
        super().__init__(rank, world_size)  # type: ignore[call-arg]
        if allreduce is None:
            if store is None:
                raise ConfigError("the fttree backend needs a store to exchange addresses (or an allreduce handle)")
            allreduce = _connect(store, rank, world_size, timeout)
        if (allreduce.rank, allreduce.world) != (rank, world_size):
            raise ConfigError(f"allreduce handle is rank {allreduce.rank} of {allreduce.world}, "
                              f"the group wants rank {rank} of {world_size}")
        self.allreduce_handle = allreduce
        # float SUM reductions whose result lacked some ranks (a rank died or was left out): code
        # that divides a sum by the world size for a mean (DDP's default reducer, Lightning's
        # sync_dist) then gets too small a one
        self.partial_sums = 0
        self._count_lock = threading.Lock()

    def _partial_sum(self, what: str, contributors: Sequence[int]) -> None:
        """Count a SUM that holds fewer ranks than the group's; warn once, naming the remedy."""
        with self._count_lock:
            self.partial_sums += 1
            first = self.partial_sums == 1
        if first:
            missing = sorted(set(range(self.size())) - set(contributors))
            log.warning("fttree rank %d: %s held %d of %d ranks (ranks %s missing). Code that divides a sum "
                        "by the world size %d for a mean gets too small a one: DDP's default reducer (register "
                        "fttree.comm_hook, which divides by the contributors: ddp.register_comm_hook(None, "
                        "fttree.comm_hook); in Lightning fttree.training.lightning.FTTreeStrategy()), a metric's "
                        "mean (use ReduceOp.AVG). Counted in the "
                        "process group's partial_sums; further ones are not logged", self.rank(), what,
                        len(contributors), self.size(), missing, self.size())

    def getBackendName(self) -> str:
        return BACKEND

    def __repr__(self) -> str:
        return f"FTTreeProcessGroup(rank={self.rank()}, world={self.size()})"

    # ---- plumbing --------------------------------------------------------------------

    def _run(self, what: str, flat: np.ndarray, signature: str, outputs: list[torch.Tensor],
             finish: Callable[[StepResult], None], *, moves_values: bool = False, reduce: str = "sum") -> FTTreeWork:
        """Submit one step; `finish` (on the loop thread) writes the result into `outputs`.
        `moves_values`: a broadcast or a gather, whose NaN and Inf are data, not a bad gradient
        (Config.nonfinite applies to sums)."""
        inner, outer = pending_future()
        work = FTTreeWork(inner, outer, outputs)
        where = f"fttree rank {self.rank()}: {what}"

        def fail(exc: BaseException) -> None:
            exc.add_note(where)
            inner.set_result(exc)

        try:
            submitted = self.allreduce_handle.submit_array(flat, signature, reduce=reduce,
                                                           nonfinite="allow" if moves_values else None)
        except Exception as exc:
            fail(exc)
            return work

        def done(f: Any) -> None:
            try:
                finish(f.result())
            except BaseException as exc:
                fail(exc)
                return
            inner.set_result(outputs)

        submitted.add_done_callback(done)
        return work

    def _sum(self, what: str, tensors: list[torch.Tensor], op: Any) -> FTTreeWork:
        """A reduction of `tensors` in place (every ReduceOp but PREMUL_SUM; AVG divides the
        sum by the number of contributors)."""
        name = _op_name(op)
        reduce = _reduce_of(name, what, tensors)
        flat, sig = _pack(tensors, what)

        def finish(res: StepResult) -> None:
            _unpack(res.data, tensors, len(res.contributors) if name == "AVG" else 1)
            if name == "SUM" and what != "barrier" and len(res.contributors) < self.size() \
                    and all(t.is_floating_point() for t in tensors):
                self._partial_sum(f"{what} (SUM)", res.contributors)

        return self._run(f"{what} ({name}) of {flat.size} x {flat.dtype}", flat, sig, tensors, finish, reduce=reduce)

    # ---- collectives -------------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> FTTreeWork:  # type: ignore[override]
        return self._sum("allreduce", tensors, opts.reduceOp if opts is not None else dist.ReduceOp.SUM)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> FTTreeWork:
        return self._sum("allreduce", tensors, opts.reduceOp if opts is not None else dist.ReduceOp.SUM)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> FTTreeWork:  # type: ignore[override]
        root = opts.rootRank if opts is not None else 0
        if self.rank() == root:
            return self._sum(f"reduce to rank {root}", tensors, opts.reduceOp if opts is not None else "SUM")
        copies = [t.detach().clone() for t in tensors]  # non-root inputs stay as they were
        return self._sum(f"reduce to rank {root}", copies, opts.reduceOp if opts is not None else "SUM")

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> FTTreeWork:  # type: ignore[override]
        root = opts.rootRank if opts is not None else 0
        what = f"broadcast from rank {root}"
        flat, sig = _pack(tensors, what)
        if self.rank() != root:
            flat[:] = blank(flat.size, flat.dtype)
        is_root = self.rank() == root

        def finish(res: StepResult) -> None:
            if not is_root:
                _unpack(res.data, tensors)

        return self._run(f"{what} of {flat.size} x {flat.dtype}", flat, sig, tensors, finish, moves_values=True)

    def _gather_into(self, what: str, inputs: list[torch.Tensor], slots: list[list[torch.Tensor]]) -> FTTreeWork:
        """Every rank's `inputs` into slots[r] (empty list: not wanted here)."""
        own, flat, sig = self._gather_buffer(what, inputs)

        def finish(res: StepResult) -> None:
            for r, outs in enumerate(slots):
                if outs:
                    _unpack(res.data[r * own.size:(r + 1) * own.size], outs)

        outputs = [t for outs in slots for t in outs]
        return self._run(f"{what} of {self.size()} x {own.size} x {own.dtype}", flat, sig, outputs, finish,
                         moves_values=True)

    def _gather_buffer(self, what: str, inputs: list[torch.Tensor]) -> tuple[np.ndarray, np.ndarray, str]:
        """(this rank's inputs packed, a buffer of world such slots holding them in this rank's
        slot and -0.0 elsewhere, the signature): what a gather or an all_to_all submits."""
        own, sig = _pack(inputs, what)
        world, rank = self.size(), self.rank()
        flat = blank(own.size * world, own.dtype)
        flat[rank * own.size:(rank + 1) * own.size] = own
        return own, flat, sig.replace(f"[{own.size}]", f"[{world}x{own.size}]", 1)

    def allgather(self, output_tensors: list[list[torch.Tensor]],  # type: ignore[override]
                  input_tensors: list[torch.Tensor], opts: Any = None) -> FTTreeWork:
        if len(input_tensors) != 1 or len(output_tensors) != 1 or len(output_tensors[0]) != self.size():
            raise ValueError(f"fttree backend: allgather takes one input tensor and {self.size()} outputs")
        return self._gather_into("allgather", input_tensors, [[t] for t in output_tensors[0]])

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> FTTreeWork:
        if output.numel() != input.numel() * self.size():
            raise ValueError(f"fttree backend: all_gather_single output needs {self.size()} x {input.numel()} "
                             f"elements, has {output.numel()}")
        return self._gather_into("allgather", [input], [[part] for part in output.view(self.size(), -1)])

    _allgather_base = all_gather_single

    def gather(self, output_tensors: list[list[torch.Tensor]],  # type: ignore[override]
               input_tensors: list[torch.Tensor], opts: Any = None) -> FTTreeWork:
        root = opts.rootRank if opts is not None else 0
        wanted = output_tensors[0] if self.rank() == root else []
        slots = [[t] for t in wanted] if wanted else [[] for _ in range(self.size())]
        return self._gather_into(f"gather to rank {root}", input_tensors, slots)

    def _reduce_scatter(self, output: torch.Tensor, inputs: list[torch.Tensor], opts: Any) -> FTTreeWork:
        """A full allreduce of every rank's list; each rank keeps its own part (simple, not
        bandwidth-optimal: the tree has no scatter phase)."""
        if len(inputs) != self.size():
            raise ValueError(f"fttree backend: reduce_scatter needs {self.size()} inputs, got {len(inputs)}")
        name = _op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        reduce = _reduce_of(name, "reduce_scatter", inputs)
        flat, sig = _pack(inputs, "reduce_scatter")
        start = sum(t.numel() for t in inputs[:self.rank()])
        end = start + inputs[self.rank()].numel()

        def finish(res: StepResult) -> None:
            _unpack(res.data[start:end], [output], len(res.contributors) if name == "AVG" else 1)

        return self._run(f"reduce_scatter ({name}) of {flat.size} x {flat.dtype}", flat, sig, [output], finish,
                         reduce=reduce)

    def reduce_scatter(self, output_tensors: list[torch.Tensor],  # type: ignore[override]
                       input_tensors: list[list[torch.Tensor]], opts: Any = None) -> FTTreeWork:
        if len(output_tensors) != 1 or len(input_tensors) != 1:
            raise ValueError("fttree backend: reduce_scatter takes one output tensor and one list of inputs")
        return self._reduce_scatter(output_tensors[0], input_tensors[0], opts)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> FTTreeWork:
        return self._reduce_scatter(output, list(input.reshape(self.size(), -1)), opts)

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def barrier(self, opts: Any = None) -> FTTreeWork:
        return self._sum("barrier", [torch.zeros(1)], dist.ReduceOp.SUM)

    def scatter(self, output_tensors: list[torch.Tensor],  # type: ignore[override]
                input_tensors: list[list[torch.Tensor]], opts: Any = None) -> FTTreeWork:
        """A broadcast of the root's whole list; each rank keeps its part (every rank receives
        world times its share: fine for the small tensors scatter is used for)."""
        root = opts.rootRank if opts is not None else 0
        if len(output_tensors) != 1:
            raise ValueError("fttree backend: scatter takes one output tensor")
        out, world, rank = output_tensors[0], self.size(), self.rank()
        what = f"scatter from rank {root}"
        if rank == root:
            parts = input_tensors[0] if input_tensors else []
            if len(parts) != world or any(p.numel() != out.numel() for p in parts):
                raise ValueError(f"fttree backend: {what} needs {world} inputs of {out.numel()} elements at the root")
            flat, sig = _pack(parts, what)
        else:
            flat, sig = _pack([out] * world, what)
            flat[:] = blank(flat.size, flat.dtype)
        start = rank * out.numel()

        def finish(res: StepResult) -> None:
            _unpack(res.data[start:start + out.numel()], [out])

        return self._run(f"{what} of {world} x {out.numel()} x {flat.dtype}", flat, sig, [out], finish,
                         moves_values=True)

    def _all_to_all(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> FTTreeWork:
        """Equal parts only: a gather of every rank's whole input to every rank, each keeping
        the parts addressed to it (world times the bytes a direct exchange would move; fttree
        has no links between every pair of ranks)."""
        world, rank = self.size(), self.rank()
        sizes = {t.numel() for t in (*outputs, *inputs)}
        if len(inputs) != world or len(outputs) != world or len(sizes) != 1:
            raise NotImplementedError(f"fttree backend: all_to_all supports {world} equal parts only (got input "
                                      f"sizes {[t.numel() for t in inputs]}, outputs {[t.numel() for t in outputs]}); "
                                      f"for uneven parts pad them to one size")
        part = sizes.pop()
        own, flat, sig = self._gather_buffer("all_to_all", inputs)

        def finish(res: StepResult) -> None:
            for src, out in enumerate(outputs):
                at = src * own.size + rank * part
                _unpack(res.data[at:at + part], [out])

        return self._run(f"all_to_all of {world} x {world} x {part} x {own.dtype}", flat, sig, outputs, finish,
                         moves_values=True)

    def alltoall(self, output_tensors: list[torch.Tensor],
                 input_tensors: list[torch.Tensor], opts: Any = None) -> FTTreeWork:
        return self._all_to_all(output_tensors, input_tensors)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: list[int], input_split_sizes: list[int], opts: Any = None) -> FTTreeWork:
        world = self.size()
        if output_split_sizes or input_split_sizes or input.numel() % world or output.numel() != input.numel():
            raise NotImplementedError(f"fttree backend: all_to_all_single supports equal splits only (input of "
                                      f"{input.numel()} elements into {world} parts, splits {input_split_sizes}, "
                                      f"output splits {output_split_sizes}); for uneven parts pad them to one size")
        return self._all_to_all(list(output.view(world, -1)), list(input.reshape(world, -1)))

    def _point_to_point(self, name: str) -> FTTreeWork:
        raise NotImplementedError(
            f"fttree backend: {name} is not supported: fttree connects a rank to its tree neighbours only and "
            f"makes collectives survive failures as whole steps, which a lone send or recv cannot; use broadcast, "
            f"scatter or all_gather (or a gloo group from dist.new_group(backend='gloo') for point-to-point)")

    def send(self, *args: Any, **kwargs: Any) -> FTTreeWork:
        return self._point_to_point("send")

    def recv(self, *args: Any, **kwargs: Any) -> FTTreeWork:
        return self._point_to_point("recv")

    def recvAnysource(self, *args: Any, **kwargs: Any) -> FTTreeWork:
        return self._point_to_point("recv from any source")

    def shutdown(self) -> None:
        self.allreduce_handle.close()  # waits (bounded) for peers that may still need this rank

    def abort(self) -> None:
        self.allreduce_handle.close()


# ---- setup --------------------------------------------------------------------------------


def _connect(store: Store, rank: int, world: int, timeout: timedelta | None) -> FTTreeAllreduce:
    host = local_host()
    startup = timeout.total_seconds() if timeout is not None else 300.0
    # A group made again on the same store (destroy_process_group, then init_process_group:
    # torch names it as before) must not read the addresses of the one before.
    prefix = f"fttree/{store.add(f'fttree/generation/{rank}', 1)}/peer"
    peers = exchange(store, rank, world, f"{host}:{pick_port(host)}", max(1.0, min(startup, 600.0)), prefix=prefix)
    key = job_key(store, prefix)  # rank 0 put one in the store, unless FTTREE_AUTH_KEY_FILE names one
    settings: dict[str, Any] = {"startup_timeout_s": max(1.0, min(startup, 600.0))}
    if key is None:
        settings["auth_key_file"] = os.environ["FTTREE_AUTH_KEY_FILE"]
    else:
        settings["auth_key"] = key
    settings.update(Config.from_env(os.environ))  # any setting by its FTTREE_ variable (Config.env_name)
    return FTTreeAllreduce(rank, peers, faults=os.environ.get("FTTREE_FAULTS") or None, **settings).start()


def _create(store: Store, rank: int, world_size: int, timeout: timedelta) -> FTTreeProcessGroup:
    return FTTreeProcessGroup(store, rank, world_size, timeout)


def register() -> None:
    """Make `dist.init_process_group("fttree")` work (idempotent; done on import)."""
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])


def allreduce_of(group: dist.ProcessGroup | None = None) -> FTTreeAllreduce:
    """The FTTreeAllreduce under an fttree process group (default: the world), for its
    statistics and notes."""
    pg = group if group is not None else dist.group.WORLD
    if not isinstance(pg, FTTreeProcessGroup):
        raise ConfigError(f"{pg!r} is not an fttree process group")
    return pg.allreduce_handle


register()
