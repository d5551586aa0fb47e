"""The status port under a slowloris from another process: bounded descriptors, slow connections
closed within seconds, /status still answering (issue 41)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from fttree import FTTreeAllreduce
from fttree.status.control import BODY_TIMEOUT_S, IDLE_TIMEOUT_S, MAX_CONNECTIONS

from .conftest import cluster
from .rawpeer import connect, handshake

SLOW = Path(__file__).resolve().parent / "slow_http.py"


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def status_code(address: str, path: str = "/status") -> int:
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=5) as resp:
            json.loads(resp.read())
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return err.code


def attack(address: str, *args: str) -> subprocess.Popen[str]:
    attacker = subprocess.Popen([sys.executable, str(SLOW), "--target", address, *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    assert attacker.stdout is not None
    assert attacker.stdout.readline().strip() == "sent"
    return attacker


def report_of(attacker: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = attacker.communicate(timeout=30)
    assert attacker.returncode == 0, err
    report = json.loads(out)
    assert isinstance(report, dict)
    return report


def back_to(baseline: int) -> None:
    """The worker's descriptors return to `baseline` (give or take two) within 10 s."""
    deadline = time.monotonic() + 10
    while open_fds() > baseline + 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert open_fds() <= baseline + 2, (baseline, open_fds())


def data_port_answers(h: FTTreeAllreduce) -> bool:
    """A new connection to the worker's data port gets its handshake answered (as a rank the job
    does not have, which the sender rules then ignore)."""
    me = h.peers[h.rank]
    with connect(me.host, me.port, timeout_s=5) as sock:
        return handshake(sock, 1000, dst=h.rank, world=2000)


def test_a_slowloris_on_the_status_port_is_capped_and_timed_out() -> None:
    """400 connections that send part of a request's headers and then a line every half second,
    held for 10 s by another process, while this process (two workers) may open only 200 files
    more than it has. Before: the worker accepted and kept every one, ran out of descriptors,
    and neither its status port nor its data port could take a connection (at the usual 1,024
    open files, 2,000 of them do the same). Now the status port holds at most MAX_CONNECTIONS,
    each slow one is closed IDLE_TIMEOUT_S after it connected, and during the attack a GET
    /status answers, a new connection to the data port is answered and steps run."""
    with cluster(2, http_port=0) as hs:
        address = hs[0].http_address
        assert address is not None
        assert status_code(address) == 200
        baseline = open_fds()
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (baseline + 200, hard))
        try:
            attacker = attack(address, "--count", "400", "--hold", "10")
            peak, answered, step = baseline, 0, 0
            while attacker.poll() is None:
                peak = max(peak, open_fds())
                assert status_code(address) == 200  # a legitimate reader gets in while the attack holds
                assert data_port_answers(hs[0])
                futures = [h.allreduce_async(np.full(4, float(h.rank + step))) for h in hs]
                assert all(np.array_equal(f.result(timeout=10), np.full(4, 1.0 + 2 * step)) for f in futures)
                answered, step = answered + 1, step + 1
                time.sleep(0.25)
            report = report_of(attacker)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        print("slowloris:", report, "readers answered", answered, "fds", baseline, "->", peak)
        assert report["connected"] >= 300, report  # the attack did reach the port
        assert answered >= 5
        assert peak - baseline <= MAX_CONNECTIONS + 16, (baseline, peak, report)
        assert report["still_open"] == 0, report
        assert report["longest_s"] <= IDLE_TIMEOUT_S + 2, report
        served = hs[0].control
        assert served is not None
        assert served.shed > 0
        back_to(baseline)
        assert status_code(address) == 200


def test_request_bodies_sent_a_byte_at_a_time_are_cut() -> None:
    """100 POST /faults (admin is open on loopback without a token) whose headers arrive whole and
    whose 1,000-byte body comes a byte each half second. Before: each waited for its body as long
    as the attacker liked. Now each one let in is answered 408 BODY_TIMEOUT_S after its headers;
    while every slot is serving such a request, a new connection (the attacker's or a reader's)
    gets a 503 at once rather than being kept waiting, and once they are cut /status answers
    again; no fault was applied."""
    with cluster(1, http_port=0) as hs:
        address = hs[0].http_address
        assert address is not None
        baseline = open_fds()
        attacker = attack(address, "--count", "100", "--hold", "10", "--body")
        peak, codes = baseline, []
        while attacker.poll() is None:
            peak = max(peak, open_fds())
            codes.append(status_code(address))  # 200, or 503 while every slot serves a slow body
            time.sleep(0.25)
        report = report_of(attacker)
        print("slow bodies:", report, "readers got", sorted(set(codes)), "fds", baseline, "->", peak)
        assert report["connected"] >= 90, report
        assert report["still_open"] == 0, report
        assert report["longest_s"] <= BODY_TIMEOUT_S + 2, report
        assert set(report["answers"]) <= {"408", "503"}, report  # never a 200: no body was whole
        assert MAX_CONNECTIONS // 2 <= report["answers"]["408"] <= MAX_CONNECTIONS, report  # those let in
        assert set(codes) <= {200, 503}, codes
        assert 503 in codes, codes
        assert peak - baseline <= MAX_CONNECTIONS + 16, (baseline, peak)
        back_to(baseline)
        assert status_code(address) == 200
        assert status_code(address, "/faults") == 200
        control = hs[0].control
        assert control is not None
        assert control.faults.schedule.rules == []
