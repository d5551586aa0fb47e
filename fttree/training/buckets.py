"""Gradient buckets: which parameters travel together, where each one sits in the flat buffer,
and the signature that makes two workers with different models disagree loudly.

A bucket is one allreduce step. Its flat buffer holds the gradients of its parameters back to
back, then one "present" flag per parameter (1 if this worker produced that gradient, else 0),
so after the sum every worker knows how many workers used each parameter: a parameter that no
worker used keeps `grad is None`, exactly as in single-process training. Under int8 wire
compression (a scale per block of values) a gap of zeros keeps the gradients, the flags and
the count that follows them out of each other's blocks, so small counts stay exact.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..core.dtypes import step_dtype
from ..core.reduce_ops import fill_identity
from ..errors import ConfigError

DEFAULT_BUCKET_MB = 25.0

def blank(size: int, dtype: np.dtype) -> np.ndarray:
    """What a rank that sends nothing contributes to a broadcast or a gather: -0.0 for floats
    (x + -0.0 is x to the bit, -0.0 and +0.0 included; with +0.0 a broadcast -0.0 arrived as
    +0.0), 0 for integers: the sum's identity (core/reduce_ops.py)."""
    out = np.empty(size, dtype=dtype)
    fill_identity(out, "sum")
    return out


def wire_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype a tensor of `dtype` travels as (core/dtypes.py: floats as themselves,
    bfloat16 as float32, bool and other integers as int64)."""
    return step_dtype(str(dtype).removeprefix("torch."))


def copy_divided(dst: torch.Tensor, src: torch.Tensor, divisor: int) -> None:
    """dst = src / divisor without writing to src, rounding once into dst's dtype."""
    if divisor == 1:
        dst.copy_(src)
    elif dst.dtype == src.dtype and dst.device == src.device:
        torch.div(src, divisor, out=dst)  # one pass, not a copy and then a division in place
    elif dst.dtype == src.dtype:  # to a GPU: the copy crosses devices, the division runs there
        dst.copy_(src).div_(divisor)
    else:  # e.g. bfloat16 from a float32 sum: divide in float32 first
        dst.copy_(src / divisor)


def digest(items: Iterable[object]) -> str:
    """A short stable hash of a layout description, shown in signatures and errors."""
    h = hashlib.blake2b(digest_size=6)
    for item in items:
        h.update(repr(item).encode())
        h.update(b"\0")
    return h.hexdigest()


def describe(shape: Sequence[int], dtype: torch.dtype) -> str:
    return f"{str(dtype).removeprefix('torch.')}{list(shape)}"


@dataclass(frozen=True, slots=True)
class Slot:
    """One parameter's place in a bucket."""

    param: int  # index into the GradientSync's parameter list
    name: str
    offset: int  # first element in the bucket's flat buffer
    numel: int
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BucketSpec:
    index: int
    count: int  # buckets in the plan
    dtype: np.dtype  # wire dtype of the flat buffer
    slots: tuple[Slot, ...]
    numel: int  # gradient elements; the present flags follow them
    layout: str  # digest of the slot shapes and dtype
    gap: int = 0  # zeros after the gradients and after the flags (int8 compression: a block less one)

    @property
    def flags_at(self) -> int:
        """Where the present flags begin."""
        return self.numel + self.gap

    @property
    def size(self) -> int:
        """Elements in the flat buffer: gradients, then one present flag per slot (each part
        followed by `gap` zeros); the worker count after them is not included."""
        return self.numel + self.gap + len(self.slots) + self.gap

    @property
    def signature(self) -> str:
        return f"grad bucket {self.index}/{self.count} {self.dtype.name}[{self.size}] #{self.layout}"

    def names(self, limit: int = 4) -> str:
        names = [s.name for s in self.slots]
        more = f", ... {len(names) - limit} more" if len(names) > limit else ""
        return ", ".join(names[:limit]) + more


def plan_buckets(named_params: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int, *,
                 gap: int = 0) -> list[BucketSpec]:
    """Split parameters into buckets of at most `bucket_bytes` (a parameter larger than that
    gets a bucket of its own), one wire dtype per bucket; `gap`: see BucketSpec.gap.

    Parameters are taken in reverse order, as DistributedDataParallel does: backward produces
    the gradients of the last layers first, so the first bucket fills first and its allreduce
    overlaps the rest of backward."""
    if bucket_bytes <= 0:
        raise ConfigError(f"bucket size must be positive, got {bucket_bytes} bytes")
    open_: dict[np.dtype, list[tuple[int, str, torch.Tensor]]] = {}
    closed: list[tuple[np.dtype, list[tuple[int, str, torch.Tensor]]]] = []
    for index in reversed(range(len(named_params))):
        name, param = named_params[index]
        dtype = wire_dtype(param.dtype)
        members = open_.setdefault(dtype, [])
        used = sum(p.numel() for _, _, p in members) * dtype.itemsize
        if members and used + param.numel() * dtype.itemsize > bucket_bytes:
            closed.append((dtype, members))
            members = open_[dtype] = []
        members.append((index, name, param))
    closed.extend((dtype, members) for dtype, members in open_.items() if members)
    specs = []
    for b, (dtype, members) in enumerate(closed):
        slots, offset = [], 0
        for index, name, param in members:
            slots.append(Slot(param=index, name=name, offset=offset, numel=param.numel(), shape=tuple(param.shape)))
            offset += param.numel()
        layout = digest([dtype.str, *((s.shape, str(named_params[s.param][1].dtype)) for s in slots)])
        specs.append(BucketSpec(index=b, count=len(closed), dtype=dtype, slots=tuple(slots), numel=offset,
                                layout=layout, gap=gap if dtype == np.float32 else 0))
    return specs
