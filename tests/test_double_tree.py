"""The double binary tree (Config.trees="double"): chunk c of a step of two or more chunks runs on
tree c mod 2, tree 1 being the heap over the reversed slot order, so every rank is interior in at
most one tree and sends about 2N bytes per allreduce instead of 3N.

On the simulator (deterministic, fake clock): the trees' shape, bytes per rank, exact sums and
identical bits on every rank under every single link cut in each tree, two parallel and two
serial cuts, a crash of a rank interior in tree 1, bf16 compression, link memory per tree and
the tree id on the wire. Then 7 workers over real TCP. The rotated family, the default, has its
own tests (test_rotated_trees.py).
"""

from __future__ import annotations

from typing import Any

import click
import numpy as np
import pytest

from fttree import StepAborted, StepResult
from fttree.core import topology as topo
from fttree.core.config import Config
from fttree.core.messages import Kind, Message, decode, encode
from fttree.core.protocol import Cause, NoteKind, TreeMachine
from fttree.core.view import View
from fttree.errors import ConfigError, FrameError
from fttree.status.cli import render as render_status
from fttree.status.metrics import render as render_metrics
from fttree.status.monitor import Monitor
from fttree.testing.sim import SimNetwork

from .conftest import cluster
from .test_compression import run_one_step as one_step
from .test_node_failures import Run, survivors_finished
from .test_realnet import assert_cut_was_real, netns, run_real  # noqa: F401 (netns is a fixture)

Link = tuple[int, int]
CHUNK = 64  # bytes: 8 int64 per chunk, so SIZE elements make 4 chunks (2 on each tree)
SIZE = 32


def interior(view: View) -> set[int]:
    return {r for r in view.members if view.neighbours(r).children}


def tree_links(view: View) -> list[Link]:
    """Every link (primary and backup) of the heap over `view`, as sorted rank pairs."""
    at = view.members
    out = {(min(at[c], at[p]), max(at[c], at[p])) for c, p in topo.tree_links(view.size)}
    out |= {(min(at[a], at[b]), max(at[a], at[b])) for a, b in topo.backup_links(view.size)}
    return sorted(out)


def bridgeable(view: View, failed: set[Link]) -> bool:
    """Every failed primary link of this tree has a live one-hop detour (brother or uncle)."""
    cut = {frozenset(link) for link in failed}

    def alive(a: int, b: int) -> bool:
        return frozenset((a, b)) not in cut

    for child in view.members[1:]:
        n = view.neighbours(child)
        assert n.parent is not None
        if not alive(child, n.parent) and not any(
                k is not None and alive(child, k) and alive(k, n.parent) for k in (n.brother, n.uncle)):
            return False
    return True


def data_for(world: int, size: int = SIZE) -> list[np.ndarray]:
    return [np.arange(size, dtype=np.int64) * (r + 1) + 1000 * (r + 1) for r in range(world)]


def run_step(world: int, cuts: set[Link] = frozenset(), *, size: int = SIZE,  # type: ignore[assignment]
             **kw: Any) -> tuple[SimNetwork, list[np.ndarray]]:
    kw.setdefault("timeout_policy", "static")
    kw.setdefault("step_timeout_s", 10.0)
    kw.setdefault("chunk_bytes", CHUNK)
    kw.setdefault("trees", "double")
    net = SimNetwork(world, **kw)
    for a, b in cuts:
        net.cut(a, b)
    data = data_for(world, size)
    net.submit_all(0, data)
    net.run()
    return net, data


def check_exact(net: SimNetwork, world: int, data: list[np.ndarray], step: int = 0) -> None:
    """Every rank completed with the exact sum of all contributions, each rank once, and all
    ranks hold the same bits."""
    want = sum(data)
    bits = set()
    for r in range(world):
        out = net.outcome(r, step)
        assert isinstance(out, StepResult), f"rank {r}: {out!r}"
        assert out.contributors == tuple(range(world)), f"rank {r} misses contributors: {out.contributors}"
        assert np.array_equal(out.data, want), f"rank {r} got a wrong sum"
        bits.add(out.data.tobytes())
    assert len(bits) == 1


def assert_later_step_detours_without_a_timeout(net: SimNetwork, world: int, data: list[np.ndarray],
                                                link: Link) -> None:
    """Link memory after step 0 cut `link` (marked failed once, by its child): step 1 is exact,
    pays no timeout, and goes around that link, and only that one."""
    marked = [(r, n.link) for r, n in net.notes if n.cause is Cause.LINK_MARKED_FAILED]
    assert marked == [(link[0], link)]
    first = len(net.notes)
    net.submit_all(1, data)
    net.run_until_finished(1)
    check_exact(net, world, data, step=1)
    later = [n for _, n in net.notes[first:] if n.step == 1]
    assert not [n for n in later if n.kind is NoteKind.TIMEOUT], "step 1 paid a timeout"
    detours = [n for n in later if n.kind is NoteKind.DETOUR]
    assert detours
    assert all(n.link == link for n in detours)


def sent_bytes(net: SimNetwork) -> list[int]:
    return [sum(link.bytes_sent for link in node.transport.status().links) for node in net.nodes]


# ---- the two trees -------------------------------------------------------------------------------


@pytest.mark.parametrize("world", range(1, 41))
def test_every_rank_is_interior_in_at_most_one_tree(world: int) -> None:
    shuffled = View(3, tuple(np.random.default_rng(world).permutation(world * 2)[:world].tolist()))
    for view in (View.initial(world), shuffled):
        a, b = view.tree(0, "double"), view.tree(1, "double")
        assert a is view
        assert b.members == tuple(reversed(view.members))
        assert b.epoch == view.epoch
        assert b.root == view.members[-1]
        assert not interior(a) & interior(b), f"world {world}: interior in both: {interior(a) & interior(b)}"
        for tree in (a, b):  # each is a whole tree over every member
            assert set(tree.subtree(tree.root)) == set(view.members)
    with pytest.raises(ConfigError, match="tree 2 does not exist"):
        View.initial(3).tree(2, "double")


def test_chunks_alternate_and_a_one_chunk_step_stays_on_tree_0() -> None:
    view = View.initial(7)
    on = TreeMachine(0, view, Config(trees="double"))
    off = TreeMachine(0, view, Config(trees="single"))
    assert [on.tree_of(c, 5) for c in range(5)] == [0, 1, 0, 1, 0]
    assert [off.tree_of(c, 5) for c in range(5)] == [0] * 5
    assert on.tree_of(0, 1) == 0
    assert on.peers == tuple(sorted(set(view.neighbours(0).all) | set(view.tree(1, "double").neighbours(0).all)))
    assert off.peers == view.neighbours(0).all
    with pytest.raises(ConfigError, match="trees must be one of 'single', 'double', 'rotated', got 'triple'"):
        Config.build(trees="triple")


@pytest.mark.parametrize("cuts", [set(), {(0, 1)}], ids=["no-fault", "cut"])
def test_a_one_chunk_step_costs_exactly_what_the_single_tree_costs(cuts: set[Link]) -> None:
    single, data = run_step(7, cuts, size=6, chunk_bytes=4096, trees="single")
    double, _ = run_step(7, cuts, size=6, chunk_bytes=4096, trees="double")
    check_exact(double, 7, data)
    assert sent_bytes(double) == sent_bytes(single)
    assert [(r, n.text) for r, n in double.notes] == [(r, n.text) for r, n in single.notes]
    assert double.finished_at == single.finished_at


# ---- bytes per rank --------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [7, 15])
def test_interior_ranks_send_about_2n_instead_of_3n(world: int) -> None:
    chunk = 64 * 1024
    size = 8 * chunk // 8  # 8 chunks of int64: N = 512 KiB
    n = size * 8
    single, _ = run_step(world, size=size, chunk_bytes=chunk, trees="single")
    double, data = run_step(world, size=size, chunk_bytes=chunk, trees="double")
    check_exact(double, world, data)
    s, d = sent_bytes(single), sent_bytes(double)
    interior_a = interior(View.initial(world))
    for r in range(world):  # headers and metadata frames are well under 2% of N here
        if r in interior_a and r != 0:
            assert 2.98 * n <= s[r] <= 3.05 * n, f"single tree, rank {r}: {s[r] / n:.3f} N"
    assert max(s) >= 2.98 * n
    assert 1.98 * n <= max(d) <= 2.05 * n, f"double tree busiest rank {max(d) / n:.3f} N"
    assert sum(d) <= sum(s) * 1.01  # the same total moves, spread over more uplinks
    bound = 2 * n * (world - 1) / world
    print(f"\n{world} workers: busiest rank single {max(s) / bound:.3f}, double {max(d) / bound:.3f} x 2N(p-1)/p")


# ---- exact sums under link faults, in each tree -------------------------------------------------


@pytest.mark.parametrize("tree", [0, 1])
@pytest.mark.parametrize("world", [4, 7, 15])
def test_every_single_link_cut_in_each_tree_completes_exactly(world: int, tree: int) -> None:
    for link in tree_links(View.initial(world).tree(tree, "double")):
        net, data = run_step(world, {link})
        check_exact(net, world, data)


def _slot_links(view: View, pairs: list[Link]) -> set[Link]:
    """Links given as (child slot, parent slot) of `view`'s heap, as rank pairs."""
    return {(view.members[a], view.members[b]) for a, b in pairs}


@pytest.mark.parametrize("tree", [0, 1])
@pytest.mark.parametrize("world", [7, 15])
@pytest.mark.parametrize("pairs", [[(3, 1), (5, 2)], [(3, 1), (1, 0)]], ids=["parallel", "serial"])
def test_two_cuts_in_each_tree_complete_exactly(world: int, tree: int, pairs: list[Link]) -> None:
    view = View.initial(world)
    cuts = _slot_links(view.tree(tree, "double"), pairs)
    assert bridgeable(view, cuts)
    assert bridgeable(view.tree(1, "double"), cuts)
    net, data = run_step(world, cuts)
    check_exact(net, world, data)
    recovered = {n.link for _, n in net.notes if n.kind is NoteKind.RECOVERY}
    assert {tuple(link) for link in cuts} & recovered or {(b, a) for a, b in cuts} & recovered


@pytest.mark.parametrize("world", [4, 7, 15])
@pytest.mark.parametrize("compression", ["bf16", None])
def test_float_data_gives_the_same_bits_everywhere(world: int, compression: str | None) -> None:
    rng = np.random.default_rng(world)
    data = [(rng.standard_normal(3000) * rng.uniform(0.1, 10)).astype(np.float32) for _ in range(world)]
    view = View.initial(world)
    cut = _slot_links(view.tree(1, "double"), [(1, 0)])  # tree 1's first primary link
    for cuts in (set(), cut):
        net, outs = one_step(world, data, cuts=tuple(cuts), chunk_bytes=4096, compression=compression,
                             trees="double")
        first = outs[0].data.view(np.uint32)
        exact = np.sum(np.array(data, dtype=np.float64), axis=0)
        magnitude = np.sum(np.abs(np.array(data, dtype=np.float64)), axis=0)
        u = 2.0**-8 if compression else 2.0**-24
        depth = max(0, world.bit_length() - 1)
        for o in outs:
            assert isinstance(o, StepResult)
            assert np.array_equal(o.data.view(np.uint32), first), "ranks disagree on the bits"
            assert o.contributors == tuple(range(world))
            assert np.all(np.abs(o.data - exact) <= ((depth + 2) * u + world * 2.0**-24) * magnitude + 1e-30)
        if compression:  # half the data bytes on the wire
            assert net.stats.data_bytes < 0.55 * 3000 * 4 * 2 * (world - 1) * 1.1


# ---- node failures ---------------------------------------------------------------------------------


@pytest.mark.parametrize("at", [0.0002, 0.0015, 0.003], ids=["start", "sent-up", "mid"])
@pytest.mark.parametrize("victim", [5, 6], ids=["interior-in-1", "root-of-1"])
def test_a_crash_of_a_rank_interior_in_tree_1_leaves_the_survivors_with_one_result(victim: int, at: float) -> None:
    view = View.initial(7)
    assert victim in interior(view.tree(1, "double"))
    assert victim not in interior(view)
    net = SimNetwork(7, chunk_bytes=16, trees="double")  # 6 int64: 3 chunks, trees 0, 1, 0
    run = Run(net)
    run.steps(1)
    out = run.step(1, [(at, lambda: net.crash(victim))])
    contributors = survivors_finished(out, {victim})
    assert contributors in (tuple(range(7)), tuple(r for r in range(7) if r != victim))
    for s in (2, 3):  # both trees rebuilt over the survivors' view
        assert victim not in survivors_finished(run.step(s), {victim})
    views = {net.nodes[r].view for r in range(7) if r != victim}
    assert len(views) == 1
    new = views.pop()
    assert victim not in new.members
    for r in new.members:
        machine = net.nodes[r].machine
        assert machine.trees[1].view.members == tuple(reversed(new.members))
        assert not machine.trees[0].up.failed
        assert not machine.trees[1].up.failed


@pytest.mark.timeout(180)
@pytest.mark.parametrize("trees", ["double", "rotated"])
@pytest.mark.parametrize("case", ["restart", "grow"])
def test_elastic_jobs_with_steps_on_several_trees(case: str, trees: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The elastic tests over TCP with 1 KiB chunks (the model's 892 parameters make 4 chunks, so
    tree 1 carries half of every step on the double tree; on the rotated trees each chunk runs on
    a tree of its own). restart: the killed rank's children in other trees probe it while it
    is dead, and those queued probes reach its restarted process, which must not answer them
    from view 0 (the answer drew the view that left it out). grow: two ranks join together and
    are linked in other trees (the last slots are tree 1's top), so a joiner learns its
    co-joiner's address from its admission."""
    from . import test_elastic

    monkeypatch.setitem(test_elastic.SETTINGS, "chunk_bytes", 1024)
    monkeypatch.setitem(test_elastic.SETTINGS, "trees", trees)
    if case == "restart":
        test_elastic.test_a_killed_worker_restarts_takes_its_state_from_a_peer_and_matches_bit_for_bit()
    else:
        test_elastic.test_a_new_rank_grows_the_group()


# ---- link memory per tree --------------------------------------------------------------------------


def test_link_memory_of_one_tree_does_not_disturb_the_other() -> None:
    # 5-6 is tree 1's primary link (6 is the root of tree 1, 5 its child) and a backup link
    # (brothers) of tree 0, whose primary links it does not touch.
    world, a, b = 7, 5, 6
    assert View.initial(world).tree(1, "double").neighbours(a).parent == b
    net = SimNetwork(world, timeout_policy="static", step_timeout_s=10.0, chunk_bytes=CHUNK, trees="double")
    net.cut(a, b)
    data = data_for(world)
    net.submit_all(0, data)
    net.run_until_finished(0)
    check_exact(net, world, data)
    machine = net.nodes[a].machine
    assert machine.trees[1].up.failed
    assert machine.trees[1].up.relays == (4,)
    assert not machine.trees[0].up.failed
    assert not machine.up.failed
    assert_later_step_detours_without_a_timeout(net, world, data, (a, b))
    net.heal(a, b)  # tree 1's probes of the uplink are answered again: back in use after the hold
    net.run(until=net.now + 3.0)
    assert not machine.trees[1].up.failed
    back = [(r, n.link, n.text) for r, n in net.notes if n.cause is Cause.LINK_BACK_IN_USE]
    assert len(back) == 1
    assert back[0][:2] == (a, (a, b))
    assert "(tree 1)" in back[0][2]


def test_a_failed_tree_1_uplink_shows_on_status_metrics_and_the_status_command() -> None:
    # 5-6 is a primary link of tree 1 only: the tree drawn from tree 0's links shows nothing of
    # it, so status must say it on its own (structured, per tree), and so must /metrics.
    world, a, b = 7, 5, 6
    net = SimNetwork(world, timeout_policy="static", step_timeout_s=10.0, chunk_bytes=CHUNK, trees="double")
    monitors = [Monitor(node) for node in net.nodes]
    net.cut(a, b)
    net.submit_all(0, data_for(world))
    net.run_until_finished(0)
    trees = net.nodes[a].status().machine.trees
    assert [t.tree for t in trees] == [0, 1]
    up = trees[1].uplink
    assert (up.failed, up.parent, up.relays) == (True, b, (4,))
    assert not trees[0].uplink.failed
    docs = [m.snapshot().to_dict() for m in monitors]
    tree1 = docs[a]["trees"][1]
    assert (tree1["parent"], tree1["uplink"], list(tree1["relays"])) == (b, "failed", [4])
    assert docs[a]["trees"][0]["uplink"] == "up"
    assert all(t["uplink"] == "up" for r, d in enumerate(docs) if r != a for t in d["trees"])
    metrics = render_metrics(monitors[a].snapshot())
    assert f'fttree_tree_uplink_state{{tree="1",parent="{b}",state="failed"}} 1' in metrics
    assert 'fttree_tree_uplink_state{tree="0",parent="2",state="up"} 1' in metrics
    lines = [click.unstyle(line) for line in render_status(docs)]
    assert f"tree 1: link {a}->{b} failed; its chunks go through rank 4" in lines
    single = SimNetwork(world, timeout_policy="static", trees="single")
    assert [t.tree for t in single.nodes[a].status().machine.trees] == [0]


def test_a_link_down_marks_the_uplink_of_the_tree_it_is_the_uplink_of() -> None:
    net = SimNetwork(7, timeout_policy="static", chunk_bytes=CHUNK, trees="double")
    net.link_down(2, 5)  # 5 is 2's child in tree 0 and its parent in tree 1
    trees = net.nodes[2].machine.trees
    assert trees[0].down_failed == {5}
    assert not trees[0].up.failed
    assert trees[1].up.failed
    assert trees[1].down_failed == set()
    net.link_down(0, 1)  # 0 is tree 0's root; 1 is no neighbour of 0 in tree 1 (a leaf there under 3)
    trees = net.nodes[0].machine.trees
    assert trees[0].down_failed == {1}
    assert not trees[1].up.failed
    data = data_for(7)
    net.submit_all(0, data)
    net.run_until_finished(0)
    check_exact(net, 7, data)


# ---- the tree id on the wire -----------------------------------------------------------------------


def test_frames_carry_the_tree_and_the_chunk_count_and_refuse_negative_ones() -> None:
    msg = Message(kind=Kind.META_REDUCE_SENT, src=1, step=3, chunk=1, tree=5, chunks=16, origin=1, target=0)
    back = decode(b"".join(bytes(b) for b in encode(msg)))
    assert (back.tree, back.chunks) == (5, 16)
    old = Message(kind=Kind.META_REDUCE_SENT, src=1, step=3, chunk=0, origin=1, target=0)
    assert b"tr" not in b"".join(bytes(b) for b in encode(old))  # tree 0 is not written: old frames decode
    assert decode(b"".join(bytes(b) for b in encode(old))).tree == 0
    assert b"nc" not in b"".join(bytes(b) for b in encode(old))  # one chunk is not written either
    assert decode(b"".join(bytes(b) for b in encode(old))).chunks == 1
    with pytest.raises(FrameError, match="tree must not be negative"):
        decode(b"".join(bytes(b) for b in encode(Message(kind=Kind.PROBE, src=1, tree=-1))))
    with pytest.raises(FrameError, match="chunk count must be at least 1"):
        decode(b"".join(bytes(b) for b in encode(Message(kind=Kind.PROBE, src=1, chunks=0))))


@pytest.mark.parametrize("theirs", ["single", "rotated"])
def test_workers_that_differ_in_trees_fail_the_step_with_a_tree_mismatch(theirs: str) -> None:
    world = 7
    net = SimNetwork(world, timeout_policy="static", step_timeout_s=5.0, chunk_bytes=CHUNK, trees="double")
    # rank 3's tree machine built with other trees, as a worker started with another setting has
    # (tampering with the replica's private part: no event of the protocol could do it)
    net.nodes[3].replica._machine = TreeMachine(3, View.initial(world), Config.build(net.config, trees=theirs))
    data = data_for(world)
    net.submit_all(0, data)
    net.run_until_finished(0)
    outs = [net.outcome(r, 0) for r in range(world)]
    assert all(isinstance(o, StepAborted) for o in outs), outs
    assert any("tree mismatch" in str(o) and "same trees setting" in str(o) for o in outs), outs
    assert net.now < 1.0  # an abort, not a deadline


# ---- real TCP ----------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
# (the cut starts at step 1: a link cut before the start makes startup wait startup_timeout_s)
@pytest.mark.parametrize("trees", ["double", "rotated"])
@pytest.mark.parametrize("faults", ["", "cut 5-6 @1.."], ids=["no-fault", "cut-in-tree-1"])
def test_seven_workers_over_tcp_get_the_exact_sum_on_several_trees(faults: str, trees: str) -> None:
    size = 40_000  # float32, 160 KB: 10 chunks of 16 KiB, spread over the trees
    with cluster(7, timeout_s=0.3, step_timeout_s=20.0, chunk_bytes=16 * 1024, faults=faults,
                 trees=trees) as handles:
        assert all(h.config.trees == trees for h in handles)
        for step in range(2):
            tensors = [np.arange(size, dtype=np.float32) % 1000 + h.rank + step for h in handles]
            futures = [h.allreduce_async(t) for h, t in zip(handles, tensors, strict=True)]
            want = np.sum(np.array(tensors, dtype=np.float64), axis=0)
            for h, fut in zip(handles, futures, strict=True):
                got = fut.result(timeout=60)
                assert np.array_equal(got, want.astype(np.float32)), f"rank {h.rank} step {step}"
                assert h.last is not None
                assert h.last.contributors == tuple(range(7))


@pytest.mark.realnet
@pytest.mark.timeout(180)
def test_launch_real_cut_of_a_tree_1_link_with_the_double_tree(netns: str) -> None:  # noqa: F811
    """7 worker processes, 5 chunks a step, the kernel's firewall cutting 5-6 (tree 1's link from
    rank 5 to its root, a backup link of tree 0) during steps 5..10: every step exact."""
    run = run_real(netns, "cut 5-6 @5..10", "--chunk-bytes", "16384", "--trees", "double")  # 5 chunks
    assert_cut_was_real(run, ["5-6"], netns)


def test_a_step_larger_than_one_chunk_is_cut_into_at_least_16() -> None:
    """Behind a slow uplink each hop carries a whole chunk, so few big chunks leave the trees'
    pipelines empty: a step over one chunk goes in 16 or more (8 per tree), never smaller than
    1 MiB nor larger than chunk_bytes; a step of one chunk is untouched (its fault costs stay)."""
    cfg = Config()
    mib = 1 << 20
    assert cfg.chunk_bytes_for(1_630_000) == cfg.chunk_bytes  # the thesis MLP: one chunk
    assert cfg.chunk_bytes_for(4 * mib) == cfg.chunk_bytes
    assert cfg.chunk_bytes_for(16 * mib) == mib  # 16 chunks, not 4
    assert cfg.chunk_bytes_for(6 * mib) == mib  # never under 1 MiB
    assert cfg.chunk_bytes_for(100_000_000) == 4 * mib  # already 24 chunks
    small = Config(chunk_bytes=4096)  # tests' tiny chunks stay as they are
    assert small.chunk_bytes_for(102_400) == 4096
    for n in (4 * mib + 1, 9_999_999, 16 * mib, 64_000_000):
        size = cfg.chunk_bytes_for(n)
        assert -(-n // size) >= 16 or size == mib
        assert mib <= size <= cfg.chunk_bytes


def test_a_step_that_would_take_long_per_hop_is_pipelined_behind_a_slow_uplink() -> None:
    """Behind 100 Mbit/s one hop of the thesis MLP's 1.63 MB takes 130 ms, and as one chunk
    every hop waits for the whole of it (3.3x gloo's ring): such a step is cut too, in chunks of
    at least 5 ms of uplink time and 32 KiB, and big steps in 48 chunks of 256 KiB or more. On
    a LAN's default pace nothing changes. The pace is the view's once the group agreed on one
    (membership.py), else the configured uplink."""
    mlp = 407_050 * 4
    assert Config().chunk_bytes_for(mlp) == Config().chunk_bytes  # the default: one chunk, as before
    assert Config(uplink_bytes_per_s=125e6).chunk_bytes_for(mlp) == Config().chunk_bytes  # 1 Gbit/s: 13 ms a hop
    slow = Config(uplink_bytes_per_s=12.5e6)  # 100 Mbit/s
    assert slow.chunk_bytes_for(1_000_000) == slow.chunk_bytes  # 80 ms a hop: one chunk
    assert slow.chunk_bytes_for(mlp) == int(12.5e6 * 0.005)  # 5 ms of uplink a chunk: 27 chunks
    assert Config(uplink_bytes_per_s=1.25e6).chunk_bytes_for(mlp) == -(-mlp // 48)  # 10 Mbit/s: 48 chunks
    assert Config(uplink_bytes_per_s=1.25e6).chunk_bytes_for(200_000) == 32 * 1024  # never under 32 KiB
    assert Config(uplink_bytes_per_s=125e3).chunk_bytes_for(4_000_000) == -(-4_000_000 // 48)  # 48 chunks
    assert Config().chunk_bytes_for(mlp, pace=1.25e6) == -(-mlp // 48)  # the view's pace decides
    mib = 1 << 20
    assert Config().chunk_bytes_for(16 * mib) == mib  # the LAN pace: 16 chunks of 1 MiB
    assert slow.chunk_bytes_for(16 * mib) == -(-16 * mib // 48)  # behind 100 Mbit/s: 48 chunks
    assert slow.chunk_bytes_for(6 * mib) == mib // 4  # ... of at least 256 KiB
    assert slow.chunk_bytes_for(100_000_000) == int(12.5e6 * 0.05)  # a hop takes at most 50 ms: 160 chunks
    assert slow.chunk_bytes_for(400 * mib) == 400 * mib // 512  # ... in at most 512 chunks
    ten = Config(uplink_bytes_per_s=1.25e6)  # 10 Mbit/s: 16 MB in 269 chunks of 62.5 KB, not 48 of 350 KB
    assert ten.chunk_bytes_for(16 * mib) == int(1.25e6 * 0.05)
    assert Config(uplink_bytes_per_s=125e3).chunk_bytes_for(16 * mib) == 32 * 1024  # 1 Mbit/s: never under 32 KiB
    world = 7
    net = SimNetwork(world, timeout_policy="static", step_timeout_s=10.0, uplink_bytes_per_s=12.5e6, trees="double")
    net.cut(5, 6)  # a primary link of tree 1 only: the MLP's chunks now use it
    data = [np.full(407_050, r + 1, dtype=np.float32) for r in range(world)]
    net.submit_all(0, data)
    net.run_until_finished(0)
    check_exact(net, world, data)
    assert net.nodes[5].status().machine.trees[1].uplink.failed  # tree 1 carried some of the chunks


def test_workers_that_cut_a_step_differently_fail_it_naming_the_settings() -> None:
    world = 7
    net = SimNetwork(world, timeout_policy="static", step_timeout_s=5.0, uplink_bytes_per_s=12.5e6)
    fast = Config.build(net.config, uplink_bytes_per_s=125e6)  # rank 3 says its uplink is 1 Gbit/s
    net.nodes[3].cfg = net.nodes[3].steps.cfg = net.nodes[3].machine.cfg = fast  # what cuts and runs its steps
    data = [np.full(407_050, r + 1, dtype=np.float32) for r in range(world)]
    net.submit_all(0, data)
    net.run_until_finished(0)
    outs = [net.outcome(r, 0) for r in range(world)]
    assert all(isinstance(o, StepAborted) for o in outs), outs
    assert any("uplink_bytes_per_s" in str(o) and "same on every worker" in str(o) for o in outs), outs

