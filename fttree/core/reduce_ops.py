"""How contributions meet at each hop of the tree: a sum by default, or another elementwise,
associative and commutative operation (max, min, product, bitwise and/or/xor on integers).

Every op keeps the sum's exactly-once and contributor rules: a subtree's value is folded in
once, and a result lists the ranks it holds. A rank that takes part without contributing (a
joiner awaiting its state, a skipped non-finite contribution) sends the op's identity, which
changes nothing: 0 for a sum, -inf (or the type's least value) for max, 1 for a product.
"""

from __future__ import annotations

import numpy as np

REDUCE_OPS: dict[str, np.ufunc] = {
    "sum": np.add, "max": np.maximum, "min": np.minimum, "product": np.multiply,
    "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor,
}
BITWISE = frozenset({"band", "bor", "bxor"})


def check_reduce(reduce: str, dtype: np.dtype) -> None:
    """Raise ValueError/TypeError unless `reduce` is an op and applies to `dtype`."""
    if reduce not in REDUCE_OPS:
        raise ValueError(f"reduce must be one of {', '.join(REDUCE_OPS)}, got {reduce!r}")
    if reduce in BITWISE and dtype.kind not in "iub":
        raise TypeError(f"reduce={reduce!r} needs integer data, not {dtype}")


def identity(reduce: str, dtype: np.dtype) -> int | float:
    """The value a rank that contributes nothing sends for `reduce`."""
    if reduce == "max":
        return -np.inf if dtype.kind == "f" else int(np.iinfo(dtype).min)
    if reduce == "min":
        return np.inf if dtype.kind == "f" else int(np.iinfo(dtype).max)
    if reduce == "product":
        return 1
    if reduce == "band":
        return -1 if dtype.kind == "i" else int(np.iinfo(dtype).max)
    return 0


def fill_identity(array: np.ndarray, reduce: str) -> None:
    """Overwrite `array` with the identity of `reduce` (-0.0 for a float sum: x + -0.0 is x to
    the bit, signed zeros included)."""
    if reduce == "sum":
        array[:] = -0.0 if array.dtype.kind == "f" else 0
    else:
        array[:] = identity(reduce, array.dtype)
