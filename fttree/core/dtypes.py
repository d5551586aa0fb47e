"""Which element types a step carries, and what every other type travels as: the one table
behind the API (numpy arrays and torch tensors), the torch layer's buckets and the backend.

A step carries float16, float32, float64, int32 and int64 (messages.WIRE_ITEMSIZE adds "bf16"
and "int8", float32 compressed on the wire). bfloat16 travels as float32, which holds every bfloat16
exactly; bool and the other integer types as int64, which holds all their values, and are cast
back. Complex, float8 and uint64 have no wire type: a TypeError says so before any step starts.
"""

from __future__ import annotations

import numpy as np

from .messages import BF16, INT8, WIRE_ITEMSIZE

STEP_DTYPES = frozenset(np.dtype(code) for code in WIRE_ITEMSIZE if code not in (BF16, INT8))
_FLOAT32, _INT32, _INT64 = np.dtype("<f4"), np.dtype("<i4"), np.dtype("<i8")


def step_dtype(name: str) -> np.dtype:
    """The little-endian dtype data of element type `name` travels as: a numpy dtype name, or a
    torch one without its "torch." ("bfloat16", "bool", "uint8", ...)."""
    if name == "bfloat16":
        return _FLOAT32
    try:
        dtype = np.dtype(name)
    except TypeError:
        dtype = None
    if dtype is not None:
        native = dtype.newbyteorder("<")
        if native in STEP_DTYPES:
            return native
        if dtype.kind == "b" or (dtype.kind in "iu" and dtype.itemsize < 8) or native == _INT64:
            return _INT32 if native == _INT32 else _INT64
    raise TypeError(f"fttree cannot carry {name} data: it sends float16, bfloat16 (as float32), float32, float64, "
                    f"and bool or integers up to int64 (as int32 or int64)")
