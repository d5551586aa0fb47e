"""Forged training states (issue 41): decode checks every declared tensor against the bytes
present before it makes any, and names what is wrong with a StateError."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

from fttree.training.state import MAGIC, VERSION, StateError, capture, decode, encode, snapshot

ROOT = Path(__file__).resolve().parent.parent
HEAD = struct.Struct("<4sBQ")  # the format's magic, version, header length (training/state.py)
Edit = Callable[[dict[str, Any], bytes], bytes]


def named() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(4, dtype=torch.float32), "b": torch.ones(2, dtype=torch.float64)}


def forge(edit: Edit, data: bytes | None = None) -> bytes:
    """A state whose outer header (tensor table, packed body) `edit` changed in place; `edit`
    returns the bytes to put after the header (the tensors' bytes, or others)."""
    data = data if data is not None else snapshot(named()).data
    _, _, hlen = HEAD.unpack_from(data)
    outer = msgpack.unpackb(data[HEAD.size:HEAD.size + hlen], raw=False, strict_map_key=False)
    payload = edit(outer, data[HEAD.size + hlen:])
    header = msgpack.packb(outer, use_bin_type=True)
    return HEAD.pack(MAGIC, VERSION, len(header)) + header + payload


def entry(i: int, field: int, value: Any) -> Edit:
    """Set one field (0 dtype, 1 shape, 2 offset, 3 bytes) of table entry i."""
    def edit(outer: dict[str, Any], payload: bytes) -> bytes:
        outer["table"][i][field] = value
        return payload
    return edit


def test_an_untouched_forge_decodes() -> None:
    """The forging helper itself changes nothing unless told to."""
    state = decode(forge(lambda outer, payload: payload))
    assert torch.equal(state.model["w"], named()["w"])
    assert torch.equal(state.model["b"], named()["b"])


def huge_without_bytes(outer: dict[str, Any], payload: bytes) -> bytes:
    """w declared as 2^27 float32 elements (512 MiB) of 0 bytes, and none present."""
    w, b = outer["table"]
    w[1], w[3], b[2] = [1 << 27], 0, 0
    return payload[16:]


def test_a_shape_that_does_not_fit_its_bytes_is_a_state_error_naming_the_tensor() -> None:
    """Before: a bare RuntimeError from torch's reshape ("shape '[3]' is invalid for input of size 4")."""
    with pytest.raises(StateError, match=r"model w: shape \[3\] of float32 is 3 elements, 12 bytes; its table "
                                         r"entry says 16 bytes"):
        decode(forge(entry(0, 1, [3])))


def drop_b(outer: dict[str, Any], payload: bytes) -> bytes:
    return payload[:16]  # w's 16 bytes; b's 16 are gone


def declare_more(outer: dict[str, Any], payload: bytes) -> bytes:
    outer["table"][1][1] = [1 << 20]
    outer["table"][1][3] = 8 << 20
    return payload


def swap_offsets(outer: dict[str, Any], payload: bytes) -> bytes:
    outer["table"][0][2], outer["table"][1][2] = 16, 0
    return payload


def trailing(outer: dict[str, Any], payload: bytes) -> bytes:
    return payload + b"x" * 8


def body_with(change: Callable[[dict[str, Any]], None]) -> Edit:
    """Change the packed body (tensor references as msgpack ext values)."""
    def edit(outer: dict[str, Any], payload: bytes) -> bytes:
        body = msgpack.unpackb(outer["body"], raw=False, strict_map_key=False)
        change(body)
        outer["body"] = msgpack.packb(body, use_bin_type=True)
        return payload
    return edit


def w_twice(body: dict[str, Any]) -> None:
    body["model"][1][1] = body["model"][0][1]  # b names w's table entry too


def dangling(body: dict[str, Any]) -> None:
    body["model"][1][1] = msgpack.ExtType(1, struct.pack("<I", 9))


@pytest.mark.parametrize(("edit", "message"), [
    (drop_b, r"model b: 16 bytes at 16 declared, the state holds 0 bytes from there"),
    (declare_more, r"model b: 8388608 bytes at 16 declared, the state holds 16 bytes from there"),
    (entry(0, 3, 12), r"model w: shape \[4\] of float32 is 4 elements, 16 bytes; its table entry says 12 bytes"),
    (entry(0, 0, "os"), r"model w: unknown dtype 'os'"),
    (entry(0, 0, "Tensor"), r"model w: unknown dtype 'Tensor'"),
    (entry(0, 0, "np:O"), r"model w: unknown dtype 'np:O'"),
    (entry(0, 1, [-1]), r"model w: shape \[-1\] is not a list of at most 64 sizes >= 0"),
    (entry(0, 1, [4.0]), r"model w: shape \[4.0\] is not a list"),
    (entry(0, 1, [0, 1 << 40, 1 << 40]), r"model w: shape \[0, 1099511627776, 1099511627776\] is too large"),
    (swap_offsets, r"model w: its bytes are said to start at 16, the previous tensor's end at 0"),
    (trailing, r"the table accounts for 32 bytes of tensors, the state holds 40"),
    (body_with(w_twice), r"table entry 0 is referenced twice"),
    (body_with(dangling), r"model b: table entry 9 of 2"),
], ids=["bytes-missing", "more-declared-than-present", "bytes-not-shape", "dtype-os", "dtype-not-a-dtype",
        "dtype-numpy-object", "negative-size", "float-size", "size-overflow", "out-of-order", "trailing-bytes",
        "referenced-twice", "no-such-entry"])
def test_forged_tables_are_state_errors_that_name_the_tensor(edit: Edit, message: str) -> None:
    with pytest.raises(StateError, match=message):
        decode(forge(edit))


def test_a_header_longer_than_the_state_is_a_state_error() -> None:
    data = snapshot(named()).data
    with pytest.raises(StateError, match=r"header is said to be \d+ bytes, \d+ follow"):
        decode(HEAD.pack(MAGIC, VERSION, len(data)) + data[HEAD.size:])


def test_optimizer_state_and_numpy_arrays_are_checked_and_named() -> None:
    """A tensor deep in the optimizer's state and an array in the extra state are named by
    where they sit; a round trip of the same state still decodes bit for bit."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    rng = np.random.default_rng(0).integers(0, 9, size=5)
    state = capture(model, opt, extra={"rng": (lambda: rng, lambda _: None)})
    data = encode(state).data
    back = decode(data)
    assert np.array_equal(back.extra["rng"], rng)
    assert torch.equal(back.optimizer["state"][0]["momentum_buffer"], state.optimizer["state"][0]["momentum_buffer"])
    table = msgpack.unpackb(data[HEAD.size:HEAD.size + HEAD.unpack_from(data)[2]], raw=False)["table"]
    momentum = next(i for i, e in enumerate(table) if e[1] == [2, 3] and i >= 2)  # after the model's weight, bias
    with pytest.raises(StateError, match=r"optimizer\.state\.0\.momentum_buffer: shape \[3, 3\] of float32 is "
                                         r"9 elements"):
        decode(forge(entry(momentum, 1, [3, 3]), data))
    with pytest.raises(StateError, match=r"extra\.rng: shape \[6\] of np:<i8 is 6 elements, 48 bytes; its table "
                                         r"entry says 40 bytes"):
        decode(forge(entry(len(table) - 1, 1, [6]), data))


PEAK = textwrap.dedent("""
    import json, resource, sys
    sys.path.insert(0, sys.argv[1])
    import torch
    from tests.test_state_forged import entry, forge, huge_without_bytes
    from fttree.training.state import StateError, decode

    def peaks():
        vm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmPeak"))
        return vm // 1024, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024

    decode(forge(lambda outer, payload: payload))  # torch and the decoder warmed up
    huge = forge(entry(0, 1, [1 << 27]))  # w declared 2^27 float32 elements (512 MiB); its entry says 16 bytes
    nothing = forge(huge_without_bytes)  # and 0 bytes, none present: was a torch.empty of 512 MiB
    before = peaks()
    errors = []
    for data in (huge, nothing):
        try:
            state = decode(data)
            errors.append(f"decoded: w of shape {list(state.model['w'].shape)}")
        except StateError as exc:
            errors.append(f"StateError: {exc}")
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    after = peaks()
    print(json.dumps({"errors": errors, "vm_peak_mb": [before[0], after[0]], "max_rss_mb": [before[1], after[1]]}))
""")


def test_a_declared_512_mib_tensor_with_no_bytes_fails_before_anything_is_allocated() -> None:
    """In a process of its own (a clean peak): a state whose tensor declares 2^27 float32
    elements, with a 16-byte entry or with no bytes at all. Before: the no-bytes one decoded, as
    a 512 MiB torch.empty (VmPeak +512 MiB; the pages untouched, so RSS did not show it). Now
    both are StateErrors and neither the peak address space nor the peak RSS moves."""
    proc = subprocess.run([sys.executable, "-c", PEAK, str(ROOT)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    print(report)
    for error in report["errors"]:
        assert error.startswith("StateError: model w: shape [134217728] of float32 is 134217728 elements, "
                                "536870912 bytes; its table entry says"), report
    vm, rss = report["vm_peak_mb"], report["max_rss_mb"]
    assert vm[1] - vm[0] < 64, report
    assert rss[1] - rss[0] < 64, report
