"""The fttree backend against torch.distributed's contract: every collective gloo offers on
CPU, for every dtype and for contiguous, transposed and strided-slice tensors, run under both
backends at 3 and 4 ranks. fttree must give the exact value (what gloo gives, except where
gloo is wrong: it writes a strided slice contiguously over its base tensor), or raise at once
the error docs/pytorch.md lists for it.

Each run starts the ranks as processes (this file, run as a script); each records every op's
outcome, and the parent compares them with values it computes itself."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8,
          torch.bool)
LAYOUTS = ("contiguous", "transposed", "strided")
REDUCE_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")
SHAPE = (2, 3)


def name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def values(rank: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Rank `rank`'s contribution: small integers (exact in every dtype, products included)
    with negatives, signed zeros and both bool values."""
    raw = (torch.arange(6, dtype=torch.int64) * 7 + rank * 3 + salt) % 5  # 0..4
    if dtype == torch.bool:
        return (raw % 2 == 0).reshape(SHAPE)
    if dtype.is_floating_point:
        out = (raw - 2).to(torch.float64).reshape(SHAPE)
        out[0, 0] = -0.0 if rank % 2 else 0.0
        return out.to(dtype)
    return (raw + 1).reshape(SHAPE).to(dtype)


def placed(rank: int, dtype: torch.dtype, layout: str, salt: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(tensor, its base) holding values(rank) in the given layout; the base's other elements
    are 99 (True for bool) and must stay so."""
    v = values(rank, dtype, salt)
    if layout == "contiguous":
        t = v.clone()
        return t, t
    if layout == "transposed":
        base = v.t().contiguous()  # (3, 2); base.t() is v, not contiguous
        return base.t(), base
    base = torch.full((12,), 99, dtype=dtype) if dtype != torch.bool else torch.ones(12, dtype=torch.bool)
    view = base[::2].view(SHAPE)  # strides (6, 2): every other element of the base
    view.copy_(v)
    return view, base


def combine(op: str, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The exact result of `op` over `parts`, in `dtype`."""
    if dtype == torch.bool:
        stack = torch.stack(parts)
        any_, all_ = stack.any(0), stack.all(0)
        return {"SUM": any_, "MAX": any_, "BOR": any_, "PRODUCT": all_, "MIN": all_, "BAND": all_,
                "BXOR": stack.sum(0) % 2 == 1}[op]
    wide = torch.stack([p.to(torch.float64 if dtype.is_floating_point else torch.int64) for p in parts])
    if op == "SUM":
        out = wide.sum(0)
    elif op == "AVG":
        out = wide.sum(0) / len(parts)
    elif op == "PRODUCT":
        out = wide.prod(0)
    elif op == "MIN":
        out = wide.min(0).values
    elif op == "MAX":
        out = wide.max(0).values
    else:
        fold = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]
        out = wide[0]
        for w in wide[1:]:
            out = fold(out, w)
    if op in ("MIN", "MAX"):  # signed zeros: pick the bits as the op on the originals does
        picked = torch.stack(parts).to(torch.float64 if dtype.is_floating_point else torch.int64)
        return (picked.max(0).values if op == "MAX" else picked.min(0).values).to(dtype)
    return out.to(dtype)


# ---- worker side (run as a script) --------------------------------------------------------


def record(out: dict[str, Any], key: str, fn: Callable[[], Any]) -> None:
    started = time.monotonic()
    try:
        out[key] = ("ok", fn())
    except Exception as exc:
        out[key] = ("error", type(exc).__name__, str(exc).splitlines()[0][:300], time.monotonic() - started)


def empty_ops(out: dict[str, Any], rank: int, world: int, dtype: torch.dtype) -> None:
    """Every op on zero-element tensors (a frozen layer's bucket, an empty shard)."""
    import torch.distributed as dist

    def empty() -> torch.Tensor:
        return torch.empty((0, 3), dtype=dtype)

    def reduce_with(op: str) -> Callable[[], Any]:
        def run() -> Any:
            t = empty()
            dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
            return t
        return run

    def into(collective: Callable[[torch.Tensor], Any]) -> Callable[[], Any]:
        def run() -> Any:
            t = empty()
            collective(t)
            return t
        return run

    def into_list(collective: Callable[[list[torch.Tensor] | None], Any], at: int | None = None) -> Callable[[], Any]:
        def run() -> Any:
            outs = [empty() for _ in range(world)] if at is None or rank == at else None
            collective(outs)
            return outs
        return run

    ops: dict[str, Callable[[], Any]] = {f"all_reduce {op}": reduce_with(op) for op in ("SUM", "MAX", "MIN", "PRODUCT")}
    ops["broadcast"] = into(lambda t: dist.broadcast(t, src=0))
    ops["all_gather_into_tensor"] = into(lambda t: dist.all_gather_into_tensor(t, empty()))
    ops["reduce_scatter_tensor"] = into(lambda t: dist.reduce_scatter_tensor(t, empty()))
    ops["all_to_all_single"] = into(lambda t: dist.all_to_all_single(t, empty()))
    ops["scatter"] = into(lambda t: dist.scatter(t, [empty()] * world if rank == 0 else None, src=0))
    ops["all_gather"] = into_list(lambda outs: dist.all_gather(outs, empty()))
    ops["gather"] = into_list(lambda outs: dist.gather(empty(), outs, dst=1), at=1)
    for op_name, run in ops.items():
        record(out, f"empty {op_name} {name(dtype)}", run)


def run_ops(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    out: dict[str, Any] = {}
    for dtype in DTYPES:
        for op in REDUCE_OPS:
            for layout in LAYOUTS:
                def allreduce(op: str = op, dtype: torch.dtype = dtype, layout: str = layout) -> Any:
                    t, base = placed(rank, dtype, layout)
                    dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
                    return t.clone(), base.clone()
                record(out, f"all_reduce {op} {name(dtype)} {layout}", allreduce)
        for layout in LAYOUTS:
            def broadcast(dtype: torch.dtype = dtype, layout: str = layout) -> Any:
                t, base = placed(rank, dtype, layout)
                dist.broadcast(t, src=world - 1)
                return t.clone(), base.clone()
            record(out, f"broadcast {name(dtype)} {layout}", broadcast)

        def all_gather(dtype: torch.dtype = dtype) -> Any:
            outs = [torch.zeros(SHAPE, dtype=dtype) for _ in range(world)]
            dist.all_gather(outs, values(rank, dtype))
            return torch.stack(outs)
        record(out, f"all_gather {name(dtype)}", all_gather)

        def all_gather_into_tensor(dtype: torch.dtype = dtype) -> Any:
            dst = torch.zeros((world, *SHAPE), dtype=dtype)
            dist.all_gather_into_tensor(dst, values(rank, dtype))
            return dst
        record(out, f"all_gather_into_tensor {name(dtype)}", all_gather_into_tensor)

        def gather(dtype: torch.dtype = dtype) -> Any:
            outs = [torch.zeros(SHAPE, dtype=dtype) for _ in range(world)] if rank == 1 else None
            dist.gather(values(rank, dtype), outs, dst=1)
            return torch.stack(outs) if outs is not None else None
        record(out, f"gather {name(dtype)}", gather)

        def scatter(dtype: torch.dtype = dtype) -> Any:
            dst = torch.zeros(SHAPE, dtype=dtype)
            dist.scatter(dst, [values(r, dtype, salt=1) for r in range(world)] if rank == 0 else None, src=0)
            return dst
        record(out, f"scatter {name(dtype)}", scatter)

        for op in ("SUM", "MAX"):
            def reduce(op: str = op, dtype: torch.dtype = dtype) -> Any:
                t = values(rank, dtype)
                dist.reduce(t, dst=2, op=getattr(dist.ReduceOp, op))
                return t if rank == 2 else None
            record(out, f"reduce {op} {name(dtype)}", reduce)

            def reduce_scatter(op: str = op, dtype: torch.dtype = dtype) -> Any:
                dst = torch.zeros(SHAPE, dtype=dtype)
                dist.reduce_scatter_tensor(dst, torch.cat([values(rank, dtype, salt=r) for r in range(world)]),
                                           op=getattr(dist.ReduceOp, op))
                return dst
            record(out, f"reduce_scatter_tensor {op} {name(dtype)}", reduce_scatter)

        def all_to_all_single(dtype: torch.dtype = dtype) -> Any:
            dst = torch.zeros((world, *SHAPE), dtype=dtype)
            dist.all_to_all_single(dst, torch.stack([values(rank, dtype, salt=r) for r in range(world)]))
            return dst
        record(out, f"all_to_all_single {name(dtype)}", all_to_all_single)

        def all_to_all(dtype: torch.dtype = dtype) -> Any:
            outs = [torch.zeros(SHAPE, dtype=dtype) for _ in range(world)]
            dist.all_to_all(outs, [values(rank, dtype, salt=r) for r in range(world)])
            return torch.stack(outs)
        record(out, f"all_to_all {name(dtype)}", all_to_all)

    for dtype in (torch.float32, torch.int64):
        empty_ops(out, rank, world, dtype)

    def asynchronous() -> Any:
        a, b = values(rank, torch.float32), values(rank, torch.int64)
        wa = dist.all_reduce(a, async_op=True)
        wb = dist.all_reduce(b, op=dist.ReduceOp.MAX, async_op=True)
        assert wa is not None
        assert wb is not None
        fut = wb.get_future()
        wa.wait()
        fut.wait()
        return a, b
    record(out, "async_op", asynchronous)
    record(out, "barrier", lambda: dist.barrier())

    def subgroup() -> Any:
        members = [0, world - 1]
        group = dist.new_group(members)
        t = values(rank, torch.float32)
        if rank in members:
            dist.all_reduce(t, group=group)
        return t
    record(out, "new_group all_reduce", subgroup)

    def objects() -> Any:
        items = [{"rank": rank, "tag": "x" * rank}, rank * 1.5] if rank == 1 else [None, None]
        dist.broadcast_object_list(items, src=1)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, ("from", rank))
        return items, gathered
    record(out, "objects", objects)

    def point_to_point() -> Any:
        t = values(rank, torch.float32)
        if rank == 0:
            dist.send(t, dst=1)
        elif rank == 1:
            dist.recv(t, src=0)
        return t
    record(out, "send/recv", point_to_point)
    dist.barrier()  # the ranks that raised at once wait here for the rest
    return out


def worker(backend: str, rank: int, world: int, port: int, outdir: Path) -> None:
    import torch.distributed as dist

    if backend == "fttree":
        import fttree.training.backend  # noqa: F401 - registers the backend

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    torch.save(run_ops(rank, world), outdir / f"rank{rank}.pt")
    if store.add("done", 1) == world:
        store.set("all_done", "1")
    store.wait(["all_done"], timedelta(seconds=60))
    sys.stdout.flush()
    os._exit(0)  # the store's host may be gone before a teardown could finish


# ---- parent side --------------------------------------------------------------------------


def run(backend: str, world: int, tmp: Path) -> list[dict[str, Any]]:
    from .conftest import free_port
    from .procs import run_all

    outdir = tmp / f"{backend}{world}"
    outdir.mkdir()
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "FTTREE_STEP_TIMEOUT": "60"}
    logs = run_all([[sys.executable, __file__, backend, str(rank), str(world), str(port), str(outdir)]
                    for rank in range(world)], env, deadline_s=240,
                   preload=("torch", "torch.distributed", "fttree"))  # torch imported once, the ranks forked
    results = []
    for rank in range(world):
        path = outdir / f"rank{rank}.pt"
        assert path.exists(), f"{backend} rank {rank} of {world} wrote no result:\n{logs[rank][-3000:]}"
        results.append(torch.load(path))
    return results


def expected(key: str, rank: int, world: int) -> Any:
    """The exact outcome of `key` at `rank` (what a correct backend returns)."""
    words = key.split()
    kind = words[0]
    dtype = getattr(torch, words[-1]) if words[-1] in map(name, DTYPES) else None
    if kind == "empty":  # every op on zero elements: empty results of the input's shape
        empty = torch.empty((0, 3), dtype=dtype)
        if words[1] in ("all_gather", "gather"):
            return None if words[1] == "gather" and rank != 1 else [empty] * world
        return empty
    if kind == "all_reduce":
        op, dtype, layout = words[1], getattr(torch, words[2]), words[3]
        want = combine(op, [values(r, dtype) for r in range(world)], dtype)
        t, base = placed(rank, dtype, layout)
        t.copy_(want)
        return t, base
    if kind == "broadcast":
        dtype, layout = getattr(torch, words[1]), words[2]
        t, base = placed(rank, dtype, layout)
        t.copy_(values(world - 1, dtype))
        return t, base
    assert dtype is not None or kind in ("async_op", "barrier", "new_group", "objects", "send/recv"), key
    assert dtype is not None or kind != "empty", key
    if kind in ("all_gather", "all_gather_into_tensor"):
        return torch.stack([values(r, dtype) for r in range(world)])
    if kind == "gather":
        return torch.stack([values(r, dtype) for r in range(world)]) if rank == 1 else None
    if kind == "scatter":
        return values(rank, dtype, salt=1)
    if kind == "reduce":
        return combine(words[1], [values(r, dtype) for r in range(world)], dtype) if rank == 2 else None
    if kind == "reduce_scatter_tensor":
        return combine(words[1], [values(r, dtype, salt=rank) for r in range(world)], dtype)
    if kind in ("all_to_all_single", "all_to_all"):
        return torch.stack([values(r, dtype, salt=rank) for r in range(world)])
    if kind == "async_op":
        return (combine("SUM", [values(r, torch.float32) for r in range(world)], torch.float32),
                combine("MAX", [values(r, torch.int64) for r in range(world)], torch.int64))
    if kind == "barrier":
        return None
    if kind == "new_group":
        members = [0, world - 1]
        own = values(rank, torch.float32)
        return combine("SUM", [values(r, torch.float32) for r in members], torch.float32) if rank in members else own
    if kind == "objects":
        return [{"rank": 1, "tag": "x"}, 1.5], [("from", r) for r in range(world)]
    assert kind == "send/recv", key
    return values(0, torch.float32) if rank == 1 else values(rank, torch.float32)


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same(got: Any, want: Any, *, how: str = "bits") -> bool:
    """`got` is `want`: to the bit ("bits": signed zeros count), by value ("value": a max of
    -0.0 and +0.0 may be either), or within float16 rounding ("close": an average)."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or got.shape != want.shape:
            return False
        if how == "close":
            return bool(torch.allclose(got.double(), want.double(), rtol=1e-3))
        if how == "bits" and want.is_floating_point():
            bits = _BITS[want.element_size()]
            return bool(torch.equal(got.contiguous().view(bits), want.contiguous().view(bits)))
        return bool(torch.equal(got, want))
    if isinstance(want, (tuple, list)):
        return isinstance(got, (tuple, list)) and len(got) == len(want) and all(
            same(g, w, how=how) for g, w in zip(got, want, strict=True))
    return bool(got == want)


def comparison(key: str) -> str:
    """How `key`'s result is compared (see same)."""
    words = key.split()
    if "AVG" in words:
        return "close"
    return "value" if "MIN" in words or "MAX" in words else "bits"


# The errors fttree raises at once instead of a result, and on which ranks (docs/pytorch.md).
FTTREE_REFUSES = {
    "send/recv": ("NotImplementedError", (0, 1)),
}
# Where a reduction does not apply to a dtype both backends refuse (torch's own rules).
NOT_DEFINED = {("BAND", "float"), ("BOR", "float"), ("BXOR", "float"), ("AVG", "int")}


def refusal(key: str, rank: int) -> str | None:
    """The error type fttree answers `key` with at `rank`, or None where it must give a value."""
    words = key.split()
    if key in FTTREE_REFUSES:
        error, ranks = FTTREE_REFUSES[key]
        return error if rank in ranks else None
    if words[0] == "all_reduce":
        dtype = getattr(torch, words[2])
        family = "float" if dtype.is_floating_point else "int"
        if (words[1], family) in NOT_DEFINED:
            return "TypeError"
    return None


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("conformance")
    return {(backend, world): run(backend, world, tmp) for world in (3, 4) for backend in ("fttree", "gloo")}


@pytest.mark.parametrize("world", [3, 4])
def test_fttree_gives_the_exact_value_or_its_listed_error_for_every_op(
        outcomes: dict[tuple[str, int], list[dict[str, Any]]], world: int) -> None:
    wrong = []
    for rank, got in enumerate(outcomes[("fttree", world)]):
        for key, outcome in got.items():
            refused = refusal(key, rank)
            if refused is not None:
                if outcome[0] != "error" or outcome[1] != refused:
                    wrong.append(f"rank {rank} {key}: want {refused}, got {str(outcome)[:200]}")
                elif outcome[3] > 5:
                    wrong.append(f"rank {rank} {key}: the error took {outcome[3]:.1f} s, not at once")
                continue
            if outcome[0] != "ok":
                wrong.append(f"rank {rank} {key}: {outcome[1]}: {outcome[2]}")
            elif not same(outcome[1], expected(key, rank, world), how=comparison(key)):
                wrong.append(f"rank {rank} {key}: got {outcome[1]}, want {expected(key, rank, world)}")
    assert not wrong, f"{len(wrong)} outcomes differ:\n" + "\n".join(wrong[:40])


@pytest.mark.parametrize("world", [3, 4])
def test_fttree_agrees_with_gloo_wherever_gloo_is_right(
        outcomes: dict[tuple[str, int], list[dict[str, Any]]], world: int) -> None:
    differ = []
    for rank, (ours, gloo) in enumerate(zip(outcomes[("fttree", world)], outcomes[("gloo", world)], strict=True)):
        assert ours.keys() == gloo.keys()
        for key in ours:
            if gloo[key][0] != "ok" or refusal(key, rank) is not None:
                continue
            how = comparison(key)
            gloo_right = same(gloo[key][1], expected(key, rank, world), how=how)
            if gloo_right and not (ours[key][0] == "ok" and same(ours[key][1], gloo[key][1], how=how)):
                differ.append(f"rank {rank} {key}: fttree {str(ours[key])[:150]}, gloo {str(gloo[key])[:150]}")
    assert not differ, "\n".join(differ[:40])


def conformance_table(outcomes: dict[tuple[str, int], list[dict[str, Any]]], world: int = 4) -> str:
    """docs/pytorch.md's table: per op and dtype, what each backend gives (exact value, a
    value that is wrong, or the error it raises)."""
    rows: dict[tuple[str, str], dict[str, str]] = {}
    for backend in ("fttree", "gloo"):
        for rank, got in enumerate(outcomes[(backend, world)]):
            for key, outcome in got.items():
                words = key.split()
                op = " ".join(w for w in words if w not in map(name, DTYPES) and w not in LAYOUTS)
                dtype = next((w for w in words if w in map(name, DTYPES)), "")
                if outcome[0] == "ok":
                    exact = same(outcome[1], expected(key, rank, world), how=comparison(key))
                    verdict = "exact" if exact else "wrong"
                else:
                    verdict = outcome[1]
                if verdict == "wrong" and words[-1] in LAYOUTS:
                    verdict = f"wrong ({words[-1]})"
                cell = rows.setdefault((op, dtype), {}).setdefault(backend, "exact")
                if cell == "exact":
                    rows[(op, dtype)][backend] = verdict
    merged: dict[tuple[str, str, str], list[str]] = {}
    for (op, dtype), cells in rows.items():
        merged.setdefault((op, cells.get("fttree", ""), cells.get("gloo", "")), []).append(dtype)
    lines = ["| op | dtypes | fttree | gloo |", "|---|---|---|---|"]
    for (op, ours, gloo), dtypes in sorted(merged.items(), key=lambda row: row[0][0]):  # stable: dtypes stay in order
        lines.append(f"| {op} | {', '.join(d for d in dtypes if d) or 'any'} | {ours} | {gloo} |")
    return "\n".join(lines)


def test_the_docs_table_is_what_the_runs_found(outcomes: dict[tuple[str, int], list[dict[str, Any]]]) -> None:
    doc = (Path(__file__).parent.parent / "docs" / "pytorch.md").read_text()
    table = conformance_table(outcomes)
    assert table in doc, f"docs/pytorch.md's conformance table is out of date; the runs found:\n{table}"


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]))
