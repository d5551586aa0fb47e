"""The control plane against real nodes over real HTTP: /status, /metrics, /healthz, /faults."""

from __future__ import annotations

import io
import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fttree import FTTreeAllreduce, logs
from fttree.core.messages import Kind, Message
from fttree.status.control import ControlServer, is_loopback
from fttree.tools.demo import contribution, expected_sum

from .conftest import cluster, free_port

SIZE = 5_000


def run_step(handles: list[FTTreeAllreduce], step: int) -> None:
    """One allreduce step on every handle; each result must be the exact sum."""
    futures = [h.allreduce_async(contribution(h.rank, step, SIZE)) for h in handles]
    for h, fut in zip(handles, futures, strict=True):
        assert np.array_equal(fut.result(timeout=30), expected_sum(len(handles), step, SIZE)), f"rank {h.rank}"


def steps_until(handles: list[FTTreeAllreduce], step: int, done: Callable[[], bool], deadline_s: float = 20.0) -> int:
    """Run exact steps from `step` on until `done()` (a link that healed may be trusted again only
    after answering probes for a while); returns the next step number."""
    end = time.monotonic() + deadline_s
    while True:
        run_step(handles, step)
        step += 1
        if done():
            return step
        assert time.monotonic() < end, f"condition still false after step {step - 1}"
        time.sleep(0.02)


def call(h: FTTreeAllreduce, method: str, path: str, body: str | bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    data = body.encode() if isinstance(body, str) else body
    req = urllib.request.Request(f"http://{h.http_address}{path}", data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def get_json(h: FTTreeAllreduce, path: str) -> dict[str, Any]:
    status, _, body = call(h, "GET", path)
    assert status == 200, body
    doc = json.loads(body)
    assert isinstance(doc, dict)
    return doc


def link(doc: dict[str, Any], name: str, key: str = "links") -> dict[str, Any]:
    found = [lk for lk in doc[key] if lk["name"] == name]
    assert found, f"no link {name} in {key} of rank {doc['rank']}: {[lk['name'] for lk in doc[key]]}"
    return found[0]


def test_status_shows_the_failed_link_and_the_recovery_then_the_link_comes_back() -> None:
    with cluster(3, timeout_s=0.1, http_port=0, faults="cut 1-0 @1") as hs:
        assert get_json(hs[0], "/healthz")["ok"] is True
        run_step(hs, 0)
        assert link(get_json(hs[0], "/status"), "1-0")["state"] == "up"
        run_step(hs, 1)
        root, child, observer = (get_json(h, "/status") for h in hs)

        assert root["neighbours"] == {"parent": None, "children": [1, 2], "brother": None, "uncle": None,
                                      "nephews": []}
        assert root["step"]["current"] == 1
        assert root["step"]["phase"] == "idle"
        assert root["step"]["completed"] == 2
        assert [s["step"] for s in root["last_steps"]] == [0, 1]
        cut = link(root, "1-0")
        assert cut["state"] == "failed"
        assert cut["role"] == "child"
        assert cut["reason"] == "step 1: data 1->0 lost, forwarded by 2"
        assert cut["since_step"] == 1
        assert cut["injected_drops"] > 0
        assert link(root, "2-0")["state"] == "up"
        assert "step 1: data 1->0 lost, forwarded by 2" in [e["text"] for e in root["recent_events"]]
        assert root["counts"]["recoveries"] >= 1
        assert root["faults"] == "cut 1-0 @1"

        assert link(child, "1-0")["state"] == "failed"
        assert "step 1: result reached rank 1 through rank 2" in link(child, "1-0")["recent"]
        relay = link(observer, "1-0", "observed_links")
        assert relay["state"] == "suspect"  # an observer cannot tell which link lost the data
        assert "step 1: relayed rank 1's data to rank 0" in relay["recent"]
        assert observer["counts"]["retransmissions"] >= 2  # the relay and the direct result push
        assert observer["counts"]["timeouts"] >= 1

        steps_until(hs, 2, lambda: link(get_json(hs[0], "/status"), "1-0")["state"] == "up")
        healed = link(get_json(hs[0], "/status"), "1-0")
        assert healed["reason"].endswith("finished with no fault on this link")
        assert healed["recent"]
        assert all("data 1->0 lost, forwarded by 2" in text for text in healed["recent"])


def metrics(h: FTTreeAllreduce) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, headers, body = call(h, "GET", "/metrics")
    assert status == 200
    assert headers["Content-Type"].startswith("text/plain; version=0.0.4")
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        assert family.documentation, family.name
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_metrics_parse_and_counters_move() -> None:
    with cluster(3, timeout_s=0.1, http_port=0) as hs:
        before = metrics(hs[1])
        run_step(hs, 0)
        run_step(hs, 1)
        after = metrics(hs[1])
    assert before[("fttree_steps_total", (("outcome", "ok"),))] == 0
    assert after[("fttree_steps_total", (("outcome", "ok"),))] == 2
    assert after[("fttree_step_duration_seconds_count", ())] == 2
    assert after[("fttree_step_duration_seconds_bucket", (("le", "+Inf"),))] == 2
    assert after[("fttree_step_duration_seconds_sum", ())] > 0
    assert after[("fttree_current_step", ())] == 1
    to_parent = (("peer", "0"),)
    assert after[("fttree_link_bytes_sent_total", to_parent)] > before[("fttree_link_bytes_sent_total", to_parent)]
    assert after[("fttree_link_bytes_sent_total", to_parent)] >= 2 * SIZE * 4  # two steps of float32 sums
    assert after[("fttree_link_bytes_received_total", to_parent)] >= 2 * SIZE * 4
    assert after[("fttree_link_frames_received_total", to_parent)] > 0
    assert after[("fttree_link_state", (("peer", "0"), ("role", "parent"), ("state", "up")))] == 1
    assert after[("fttree_link_state", (("peer", "0"), ("role", "parent"), ("state", "failed")))] == 0
    assert after[("fttree_info", (("address", hs[1].peers[1].__str__()), ("rank", "1"), ("world", "3")))] == 1
    assert after[("fttree_recoveries_total", ())] == 0


def test_admin_endpoint_cuts_a_link_and_the_next_step_recovers() -> None:
    with cluster(3, timeout_s=0.1, http_port=0) as hs:
        status, _, body = call(hs[1], "POST", "/faults", "cut 1-0")
        assert status == 200, body
        doc = json.loads(body)
        assert doc["applied"] == ["cut 1-0"]
        assert get_json(hs[1], "/faults")["rules"] == ["cut 1-0"]

        run_step(hs, 0)  # exact on every rank, through the backup link
        cut = link(get_json(hs[0], "/status"), "1-0")
        assert cut["state"] == "failed"
        assert cut["reason"] == "step 0: data 1->0 lost, forwarded by 2"
        recovered = metrics(hs[0])[("fttree_recoveries_total", ())]
        assert recovered >= 1

        status, _, body = call(hs[1], "DELETE", "/faults")
        assert status == 200
        assert json.loads(body)["cleared"] == ["cut 1-0"]
        step = steps_until(hs, 1, lambda: link(get_json(hs[0], "/status"), "1-0")["state"] == "up")
        recovered = metrics(hs[0])[("fttree_recoveries_total", ())]
        run_step(hs, step)
        assert metrics(hs[0])[("fttree_recoveries_total", ())] == recovered  # the link carries data again

        status, _, body = call(hs[2], "POST", "/faults", json.dumps({"faults": "delay 2-0 1ms; cut 1-0"}),
                               {"Content-Type": "application/json"})
        assert status == 200, body
        doc = json.loads(body)
        assert doc["applied"] == ["delay 2-0 1ms"]
        assert doc["ignored"] == ["cut 1-0: does not touch rank 2's links"]
        run_step(hs, step + 1)


@pytest.mark.parametrize(("body", "content_type", "message"), [
    ("cut 1", "text/plain", "needs a link A-B"),
    ("explode 1-0", "text/plain", "unknown fault 'explode'"),
    ("cut 1-0 @9..3", "text/plain", "ends before it starts"),
    ("cut 1-7", "text/plain", "outside the world of 2"),
    ("  ", "text/plain", "empty fault schedule"),
    ("{not json", "application/json", "not valid JSON"),
    ('{"rules": "cut 1-0"}', "application/json", 'a "faults" string'),
])
def test_malformed_fault_bodies_get_400_with_a_message(body: str, content_type: str, message: str) -> None:
    with cluster(2, http_port=0) as hs:
        status, _, raw = call(hs[0], "POST", "/faults", body, {"Content-Type": content_type})
        assert status == 400
        assert message in json.loads(raw)["error"]
        assert get_json(hs[0], "/faults")["rules"] == []  # nothing half-applied


def test_token_guards_admin_endpoints_but_not_reads() -> None:
    with cluster(2, http_port=0, http_token="s3cret") as hs:
        h = hs[0]
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            status, resp_headers, raw = call(h, "POST", "/faults", "cut 1-0", headers)
            assert status == 401
            assert "token" in json.loads(raw)["error"]
            assert resp_headers["WWW-Authenticate"].startswith("Bearer")
        assert call(h, "DELETE", "/faults")[0] == 401
        assert get_json(h, "/faults")["rules"] == []
        good = {"Authorization": "Bearer s3cret"}
        assert call(h, "POST", "/faults", "cut 1", good)[0] == 400
        assert call(h, "POST", "/faults", "delay 1-0 1ms", good)[0] == 200
        assert get_json(h, "/faults")["rules"] == ["delay 1-0 1ms"]
        assert call(h, "DELETE", "/faults", headers=good)[0] == 200
        assert get_json(h, "/status")["rank"] == 0
        assert call(h, "GET", "/metrics")[0] == 200


def test_admin_is_off_on_a_non_loopback_bind_without_a_token() -> None:
    assert is_loopback("127.0.0.5")
    assert is_loopback("::1")
    assert not is_loopback("10.0.0.1")
    assert not is_loopback("0.0.0.0")
    node, monitor, faults = object(), object(), object()
    for host, token, open_ in (("0.0.0.0", None, False), ("0.0.0.0", "t", True), ("127.0.0.3", None, True)):
        server = ControlServer(node, monitor, faults, world=3, host=host, port=0, token=token)  # type: ignore[arg-type]
        assert server.admin_open is open_, (host, token)


def test_a_busy_http_port_names_the_rank_and_port() -> None:
    from fttree.errors import PeerError

    with cluster(1, http_port=0) as hs:
        host, port = str(hs[0].http_address).rsplit(":", 1)
        other = FTTreeAllreduce(0, [f"127.0.0.9:{free_port()}"], http_port=int(port), http_host=host)
        with pytest.raises(PeerError, match=f"rank 0 cannot serve HTTP on {host}:{port}"):
            other.start()


def test_log_records_carry_rank_and_step_as_json() -> None:
    stream = io.StringIO()
    logs.setup(None, json_lines=True, stream=stream)
    try:
        logs.bind_thread(4, lambda: 17)
        logging.getLogger("fttree.test").warning("link %s looks broken", "4-1")
        logs.unbind_thread()
        logging.getLogger("fttree.test").warning("no node here")
    finally:
        root = logging.getLogger()
        for handler in list(root.handlers):
            if handler.get_name() == "fttree":
                root.removeHandler(handler)
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["rank"] == 4
    assert first["step"] == 17
    assert first["msg"] == "link 4-1 looks broken"
    assert first["logger"] == "fttree.test"
    assert first["level"] == "warning"
    assert "rank" in second
    assert "step" in second


def test_a_dead_worker_shows_in_status_metrics_and_the_status_command() -> None:
    """After rank 3 dies, the survivors' /status, /metrics and `fttree status` say so as data:
    the view that left it out, the eviction with its reason and detection time."""
    from fttree.status.cli import render

    with cluster(4, timeout_s=0.1, http_port=0) as hs:
        run_step(hs, 0)
        hs[3].crash("test: rank 3 killed")
        survivors = hs[:3]
        futures = [h.allreduce_async(contribution(h.rank, 1, SIZE)) for h in survivors]
        results = [f.result(timeout=30) for f in futures]
        assert all(np.array_equal(r, results[0]) for r in results)
        docs = [get_json(h, "/status") for h in survivors]
        for doc in docs:
            assert doc["view"]["epoch"] == 1
            assert sorted(doc["view"]["members"]) == [0, 1, 2]
            member = doc["membership"]
            assert member["state"] == "active"
            assert member["evicted_total"] == 1
            (evicted,) = member["evictions"]
            assert evicted["rank"] == 3
            assert evicted["epoch"] == 1
            assert evicted["detected_after_s"] >= 0
            assert evicted["suspected_by"], evicted  # the ranks that reported it dead
            assert isinstance(member["no_change"], str), member  # why no view change now (membership's words)
        figures = metrics(hs[0])
        assert figures[("fttree_evictions_total", ())] == 1
        assert figures[("fttree_view_epoch", ())] == 1
        assert figures[("fttree_view_members", ())] == 3
        lines = [click.unstyle(line) for line in render([*docs, "connection refused"])]
    dead = [line for line in lines if line.startswith("rank 3  dead")]
    assert dead, lines
    assert "left out of view 1" in dead[0]
    assert "view 1: 3 of 4" in lines[0]


def test_a_web_page_cannot_drive_the_admin_routes() -> None:
    """What any page open on this machine can send to 127.0.0.x: a simple POST with an Origin
    and text/plain. Refused on every admin route (before: `isolate 2` was applied)."""
    with cluster(3, http_port=0) as hs:
        h = hs[0]
        page = {"Origin": "http://evil.example", "Content-Type": "text/plain"}
        status, _, raw = call(h, "POST", "/faults", "isolate 2", page)
        assert status == 403
        assert "web page" in json.loads(raw)["error"]
        assert call(h, "DELETE", "/faults", headers=page)[0] == 403
        assert call(h, "GET", "/faults", headers=page)[0] == 403
        assert get_json(h, "/faults")["rules"] == []
        assert call(h, "GET", "/status", headers=page)[0] == 200  # reads stay open, as Prometheus expects


def test_crash_and_hang_are_refused_not_acknowledged() -> None:
    with cluster(2, http_port=0) as hs:
        for rule in ("crash 1 @5", "hang 0 @3..4", "cut 1-0; crash 1 @9"):
            status, _, raw = call(hs[0], "POST", "/faults", rule)
            assert status == 400, rule
            assert "happen to a worker's process" in json.loads(raw)["error"]
        assert get_json(hs[0], "/faults")["rules"] == []


def test_a_job_key_makes_admin_requests_need_its_token(tmp_path: Path) -> None:
    from fttree.net.credentials import Credentials, http_token, write_key

    key = write_key(tmp_path / "job.key")
    token = http_token(Credentials.from_key_file(key).key)
    assert token
    with cluster(2, http_port=0, auth_key_file=str(key)) as hs:
        assert call(hs[0], "POST", "/faults", "delay 1-0 1ms")[0] == 401
        assert call(hs[0], "POST", "/faults", "delay 1-0 1ms", {"Authorization": f"Bearer {token}"})[0] == 200
        assert get_json(hs[0], "/status")["rank"] == 0


def test_early_frames_dropped_at_their_bound_show_in_status_and_metrics() -> None:
    """Forty 16 MiB subtree sums "from rank 1" for steps rank 0 has not reached (640 MiB) reach
    rank 0's node: it holds 4 (EARLY_BYTES_FLOOR), drops 36, and /status and /metrics say so
    as counters (empty sums beside them, none here)."""
    with cluster(3, timeout_s=0.1, http_port=0) as hs:
        run_step(hs, 0)
        node, loop = hs[0].node, hs[0]._loop
        assert node is not None
        assert loop is not None
        big = np.ones(4 << 20, np.float32)
        for step in range(5, 45):
            msg = Message(kind=Kind.DATA_REDUCE, src=1, step=step, chunk=0, chunks=1, tree=0, origin=1,
                          contributors=(1,), dtype="<f4", numel=int(big.size), signature=f"float32[{big.size}]",
                          payload=big.data.cast("B"), epoch=hs[0].view.epoch)
            loop.call_soon_threadsafe(node.on_message, msg)
        deadline = time.monotonic() + 30
        while get_json(hs[0], "/status")["counts"]["early_dropped"] < 36:
            assert time.monotonic() < deadline, get_json(hs[0], "/status")["counts"]
            time.sleep(0.05)
        counts = get_json(hs[0], "/status")["counts"]
        assert counts["early_dropped"] == 36
        assert counts["early_dropped_bytes"] == 36 * big.nbytes
        assert counts["empty_sums"] == 0
        figures = metrics(hs[0])
        assert figures[("fttree_early_frames_dropped_total", ())] == 36
        assert figures[("fttree_early_bytes_dropped_total", ())] == 36 * big.nbytes
        assert figures[("fttree_empty_sums_total", ())] == 0
