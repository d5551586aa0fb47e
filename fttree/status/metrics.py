"""Prometheus text exposition (format 0.0.4) of a worker's snapshot, written by hand.

No prometheus_client at run time: the worker already holds every number in its snapshot, and
rendering a few dozen lines is cheaper than keeping a second registry in step with it.
Per-link series are labelled by `peer` (the other rank); the worker's own rank and world are in
`fttree_info`, to be joined on the scrape target like any other info metric.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .monitor import Snapshot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

STEP_BUCKETS_S: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                                     10.0, 30.0, 60.0)
LINK_STATES = ("up", "suspect", "failed", "probing")
MEMBER_STATES = ("active", "changing", "minority", "evicted")
UPLINK_STATES = ("up", "failed", "probing")  # link memory about a link to a parent (monitor.TreeView)
PUNCH_STATES = ("trying", "connected", "failed", "lost")  # hole punching to a peer (monitor.PunchView)


@dataclass(frozen=True, slots=True)
class HistogramView:
    bounds: tuple[float, ...]
    counts: tuple[int, ...]  # per bucket, not cumulative; one more than bounds (+Inf)
    total: float
    count: int


class Histogram:
    """A fixed-bucket histogram of step durations (observed on the node's loop)."""

    def __init__(self, bounds: Sequence[float] = STEP_BUCKETS_S) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def view(self) -> HistogramView:
        return HistogramView(self.bounds, tuple(self.counts), self.total, self.count)


def _value(v: float | int) -> str:
    if type(v) is int:
        return str(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def _escape(text: str) -> str:
    if "\\" not in text and "\n" not in text and '"' not in text:
        return text
    return text.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


@functools.lru_cache(maxsize=4096)
def _labels(labels: tuple[tuple[str, object], ...]) -> str:
    """`{k="v",...}`; the same few label sets come back on every scrape, so they are cached."""
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels) + "}"


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str,
               samples: Iterable[tuple[dict[str, object], float | int]]) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            self.lines.append(f"{name}{_labels(tuple(labels.items()))} {_value(value)}")

    def histogram(self, name: str, help_text: str, h: HistogramView) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} histogram")
        running = 0
        for bound, n in zip((*h.bounds, math.inf), h.counts, strict=True):
            running += n
            self.lines.append(f'{name}_bucket{{le="{_value(float(bound))}"}} {running}')
        self.lines.append(f"{name}_sum {_value(float(h.total))}")
        self.lines.append(f"{name}_count {h.count}")


def render(snap: Snapshot) -> str:
    """The /metrics body for one snapshot."""
    w = _Writer()
    w.family("fttree_info", "gauge", "This worker: rank, world size and listen address.",
             [({"rank": snap.rank, "world": snap.world, "address": snap.address}, 1)])
    w.family("fttree_steps_total", "counter", "Allreduce steps finished on this worker, by outcome.",
             [({"outcome": "ok"}, snap.steps_ok), ({"outcome": "failed"}, snap.steps_failed)])
    w.histogram("fttree_step_duration_seconds", "Duration of successful allreduce steps on this worker.",
                snap.histogram)
    w.family("fttree_current_step", "gauge", "The newest step in flight, else the last finished one (-1: none).",
             [({}, -1 if snap.step is None else snap.step)])
    w.family("fttree_steps_in_flight", "gauge", "Allreduce steps submitted here and not finished yet.",
             [({}, len(snap.in_flight))])
    w.family("fttree_timeouts_total", "counter", "Backup-link watches that expired (a primary link looked broken).",
             [({}, snap.timeouts)])
    w.family("fttree_recoveries_total", "counter", "Data that went around a link that lost it, seen by this worker.",
             [({}, snap.recoveries)])
    w.family("fttree_detours_total", "counter",
             "Data that went the planned way around a link that link memory holds failed, seen by this worker.",
             [({}, snap.detours)])
    w.family("fttree_view_epoch", "gauge", "The membership view this worker is in (0: the first).",
             [({}, snap.epoch)])
    w.family("fttree_view_members", "gauge", "Workers in this worker's view.", [({}, len(snap.members))])
    w.family("fttree_member_state", "gauge", "This worker's membership state, one series per state: 1 for the current.",
             [({"state": st}, int(snap.member_state == st)) for st in MEMBER_STATES])
    w.family("fttree_evictions_total", "counter", "Workers left out of a view since this worker started.",
             [({}, snap.evicted_total)])
    w.family("fttree_suspicions_total", "counter", "Neighbours this worker suspected dead (refuted or not).",
             [({}, snap.suspicions_total)])
    w.family("fttree_self_checks_total", "counter",
             "Times this worker found it had not run for half a node deadline and asked its neighbours "
             "whether it is still a member before handing out results.", [({}, snap.self_checks)])
    w.family("fttree_self_check_stops_total", "counter",
             "Of those, the checks no neighbour confirmed within two node deadlines: the worker stopped.",
             [({}, snap.self_check_stops)])
    w.family("fttree_suspects", "gauge", "Workers suspected dead right now (not yet confirmed).",
             [({}, len(snap.suspects))])
    if snap.evictions:
        w.family("fttree_detection_seconds", "gauge",
                 "From the first suspicion of the newest evicted worker to the view that left it out.",
                 [({"rank": snap.evictions[-1].rank}, snap.evictions[-1].detected_after_s)])
    w.family("fttree_step_reruns_total", "counter", "Steps run again on a new view after a worker failed.",
             [({}, snap.reruns)])
    w.family("fttree_node_deadline_seconds", "gauge", "Silence that makes this worker suspect a neighbour now.",
             [({}, snap.node_deadline_s)])
    w.family("fttree_retransmissions_total", "counter",
             "Data this worker sent a second time over a backup link (relays and direct result pushes).",
             [({}, snap.retransmissions)])
    w.family("fttree_duplicates_dropped_total", "counter", "Second copies dropped by the exactly-once check.",
             [({}, snap.duplicates)])
    w.family("fttree_frame_errors_total", "counter", "Undecodable frames received (their connections were closed).",
             [({}, snap.frame_errors)])
    w.family("fttree_foreign_frames_total", "counter",
             "Frames dropped because their sender may not send them (not a member, for a member's message).",
             [({}, snap.foreign_frames)])
    w.family("fttree_empty_sums_total", "counter",
             "Subtree sums that named no contributor: taken as their sender's arrival, nothing of them added.",
             [({}, snap.empty_sums)])
    w.family("fttree_early_frames_dropped_total", "counter",
             "Data frames for steps not submitted here yet, dropped because the bytes held for such steps "
             "were at their bound (a sender far ahead, or a key holder's flood).",
             [({}, snap.early_dropped)])
    w.family("fttree_early_bytes_dropped_total", "counter", "The payload bytes of those frames.",
             [({}, snap.early_dropped_bytes)])
    w.family("fttree_ops_refused_total", "counter",
             "Step frames dropped because the ops their sender made here, for steps not submitted here yet, "
             "were at its share of max_live_ops (a key holder's flood of chunks no step has), its frames of views "
             "not installed here at its share of max_ops_ahead, or they cut a submitted step otherwise.",
             [({}, snap.ops_refused)])
    w.family("fttree_late_steps_total", "counter",
             "Steps that closed without a member's contribution, that member being late (a straggler).",
             [({"rank": r}, n) for r, n in sorted(snap.late_total.items())])
    w.family("fttree_late_steps_in_a_row", "gauge",
             "Steps in a row, up to the newest, that closed without this member (0 once it contributes).",
             [({"rank": r}, n) for r, n in sorted(snap.late_streak.items())])
    w.family("fttree_steps_waited_on_computing_total", "counter",
             "Steps whose deadline was put off because a member said it was still computing them.",
             [({}, snap.computing_waits)])
    w.family("fttree_refused_connections_total", "counter",
             "Connections refused at the handshake: another job, no proof of the job's key, a wrong rank.",
             [({}, snap.refusals)])
    w.family("fttree_tree_uplink_state", "gauge",
             "This worker's link to its parent in each tree (Config.trees; tree 0 carries small steps), one "
             "series per state: 1 for the current one.",
             [({"tree": t.tree, "parent": t.parent, "state": st}, int(t.uplink == st))
              for t in snap.trees if t.parent is not None for st in UPLINK_STATES])
    links = snap.links
    w.family("fttree_link_bytes_sent_total", "counter", "Bytes written to each neighbour.",
             [({"peer": lk.peer}, lk.bytes_sent) for lk in links])
    w.family("fttree_link_bytes_received_total", "counter", "Payload and prefix bytes read from each neighbour.",
             [({"peer": lk.peer}, lk.bytes_received) for lk in links])
    w.family("fttree_link_frames_sent_total", "counter", "Frames written to each neighbour.",
             [({"peer": lk.peer}, lk.frames_sent) for lk in links])
    w.family("fttree_link_frames_received_total", "counter", "Frames read from each neighbour.",
             [({"peer": lk.peer}, lk.frames_received) for lk in links])
    w.family("fttree_link_injected_drops_total", "counter", "Frames dropped by in-process fault injection.",
             [({"peer": lk.peer}, lk.injected_drops) for lk in links])
    w.family("fttree_link_errors_total", "counter", "Connections to each neighbour that broke and were redialled.",
             [({"peer": lk.peer}, lk.errors) for lk in links])
    w.family("fttree_link_state", "gauge", "Link state, one series per state: 1 for the current one.",
             [({"peer": lk.peer, "role": lk.role, "state": st}, int(lk.state == st))
              for lk in links for st in LINK_STATES])
    w.family("fttree_link_rtt_seconds", "gauge", "Kernel smoothed TCP round-trip time to each neighbour.",
             [({"peer": lk.peer}, lk.rtt_s) for lk in links if lk.rtt_s is not None])
    punches = snap.punches
    w.family("fttree_hole_punch_state", "gauge",
             "Hole punching to each peer reached only through a relay, one series per state: 1 for the current "
             "one (connected: its frames go direct; failed or lost: they take the relay).",
             [({"peer": p.peer, "state": st}, int(p.state == st)) for p in punches for st in PUNCH_STATES])
    w.family("fttree_hole_punch_tries_total", "counter", "Hole punches tried to each such peer.",
             [({"peer": p.peer}, p.tries) for p in punches])
    w.family("fttree_hole_punch_connected_total", "counter", "Hole punches to each such peer that connected.",
             [({"peer": p.peer}, p.connected) for p in punches])
    return "\n".join(w.lines) + "\n"
