"""Run inside a network namespace of its own (test_nat_netns.py): three in-process workers,
rank 2 listed as `-`, so rank 0 sends to it on the connections rank 2 dialled. After a few
steps the firewall silently drops everything on those connections (both ways, by their port):
rank 0's stall detection must give up on them, the backup links carry the steps meanwhile, and
rank 2 dials again, its new connections carrying rank 0's frames. Prints one JSON line."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time

import numpy as np

from fttree import FTTreeAllreduce


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def steps(handles: list[FTTreeAllreduce], first: int, count: int, size: int = 407_050) -> list[str]:
    """`count` steps; what was wrong with any, per rank (empty: every one exact)."""
    wrong = []
    for step in range(first, first + count):
        data = [np.full(size, float(step + r), np.float32) for r in range(len(handles))]
        futures = [h.allreduce_async(d) for h, d in zip(handles, data, strict=True)]
        for h, fut in zip(handles, futures, strict=True):
            out = fut.result(timeout=60)
            last = h.last
            if not np.array_equal(out, sum(data)) or last is None or last.contributors != (0, 1, 2) or last.epoch:
                wrong.append(f"rank {h.rank} step {step}: contributors {last and last.contributors}, "
                             f"epoch {last and last.epoch}")
    return wrong


def link(h: FTTreeAllreduce, peer: int) -> dict[str, int]:
    assert h.transport is not None
    s = h.status().transport.link(peer)
    return {"connects": s.connects, "adopted": s.adopted, "errors": s.errors}


def main() -> None:
    port = free_port()
    peers = [f"127.0.0.1:{port}", f"127.0.0.2:{port}", "-"]
    handles = [FTTreeAllreduce(r, peers, auth_key=b"k" * 32, stall_timeout_s=1.0, timeout_s=0.3,
                               step_timeout_s=60, timeout_policy="static") for r in range(3)]
    threads = [threading.Thread(target=h.start) for h in handles]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    report: dict[str, object] = {}
    rules: list[list[str]] = []
    try:
        wrong = steps(handles, 0, 3)
        tcp = handles[0].transport.inner  # type: ignore[union-attr]
        ports = [ch.writer.get_extra_info("peername")[1] for ch in tcp._out[2].channels if ch.writer is not None]
        report["cut_ports"] = ports
        report["before"] = link(handles[0], 2)
        for p in ports:
            for side in ("--sport", "--dport"):
                rule = ["INPUT", "-p", "tcp", side, str(p), "-m", "comment", "--comment", "fttree nat-stall",
                        "-j", "DROP"]
                subprocess.run(["iptables", "-w", "5", "-I", *rule], check=True)
                rules.append(rule)
        began = time.monotonic()
        wrong += steps(handles, 3, 8)
        deadline = time.monotonic() + 20
        while link(handles[0], 2)["adopted"] < report["before"]["adopted"] + 1:  # type: ignore[index]
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        report["cut_steps_s"] = round(time.monotonic() - began, 2)
        wrong += steps(handles, 11, 3)
        report["after"] = link(handles[0], 2)
        report["wrong"] = wrong
    finally:
        for rule in rules:
            subprocess.run(["iptables", "-w", "5", "-D", *rule], check=False)
        closers = [threading.Thread(target=h.close) for h in handles]
        for t in closers:
            t.start()
        for t in closers:
            t.join(30)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
