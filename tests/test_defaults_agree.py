"""Limits with one meaning have one default: the transport, the frame decoder and Config
agreed on nothing before (the transport took 1 GiB payloads where Config said 256 MiB)."""

from __future__ import annotations

import inspect

from fttree.core import messages
from fttree.core.config import Config
from fttree.net.tcp import TcpTransport


def test_the_payload_limit_has_one_default() -> None:
    want = Config().max_payload_bytes
    assert inspect.signature(TcpTransport.__init__).parameters["max_payload_bytes"].default == want
    assert inspect.signature(messages.decode).parameters["max_payload_bytes"].default == want
    assert inspect.signature(messages.decode_prefix).parameters["max_payload_bytes"].default == want
