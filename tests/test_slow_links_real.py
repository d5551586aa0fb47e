"""Slow is not broken, with real processes: `fttree launch` at its defaults behind real per-rank
uplinks (netem/uplink.sh, an htb class per rank in a network namespace), and far links to the
job's last step. Nothing is broken, so every step must be exact with everyone in it, and the
fault machinery must do nothing: no relay, detour or expired watch, no member change.

The uplink tests need root, ip, tc and namespaces (marked realnet; skipped with the reason
otherwise); the far-link test runs anywhere.
"""

from __future__ import annotations

import pytest

from fttree.tools.demo import StepRecord
from fttree.tools.launch import LaunchResult, Shortfall, launch

from .conftest import free_port
from .test_realnet import netem, netns  # noqa: F401 (netns is a fixture)
from .test_uplink import tc_missing

WORLD = 7
EVERYONE = list(range(WORLD))


def assert_healthy(result: LaunchResult, lines: list[str]) -> None:
    """Every step exact on every rank, all of them in every sum and every view, and no event
    of the fault machinery (pace agreements change the epoch, never the members)."""
    text = "\n".join(lines)
    assert result.ok, text
    assert sorted(result.records) == list(range(result.steps)), text
    for step, recs in sorted(result.records.items()):
        assert sorted(recs) == EVERYONE, f"step {step}\n{text}"
        for rec in recs.values():
            assert rec.exact, f"step {step} rank {rec.rank}: {rec.error}\n{text}"
            assert rec.ranks == EVERYONE, f"step {step} rank {rec.rank}: sum of {rec.ranks}\n{text}"
            assert sorted(rec.members) == EVERYONE, f"step {step} rank {rec.rank}: view {rec.members}\n{text}"
            assert not rec.events, f"step {step} rank {rec.rank}: {rec.events}\n{text}"
        assert len({rec.digest for rec in recs.values()}) == 1, f"step {step}: results differ\n{text}"


@pytest.mark.realnet
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("rate", "size", "steps"), [("10mbit", 407_050, 5), ("100mbit", 4_194_304, 5)],
                         ids=["10mbit-1.63MB", "100mbit-16MB"])
def test_launch_at_defaults_behind_real_slow_uplinks(netns: str, rate: str, size: int, steps: int) -> None:  # noqa: F811
    """Before: healthy ranks evicted from step 0 or 1 on at 10 Mbit/s, views split, results
    differed; at 100 Mbit/s two ranks left at the last step. Nothing is set but the size."""
    missing = tc_missing()
    if missing:
        pytest.skip(missing)
    netem("uplink.sh", "--netns", netns, "--ranks", str(WORLD), rate)
    lines: list[str] = []
    result = launch(WORLD, ["--steps", str(steps), "--size", str(size), "--no-http"], steps=steps,
                    prefix=["ip", "netns", "exec", netns], deadline_s=240, echo=lines.append)
    assert_healthy(result, lines)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_far_links_stay_exact_to_the_last_step() -> None:
    """50 ms one-way on every link (the in-process delay fault). Before, the first workers to
    finish exited while frames to them were still held back, the others took them for dead
    one after another, and six ranks delivered six results for the last step."""
    delays = "; ".join(f"delay {a}-{b} 50ms" for a in range(WORLD) for b in range(a + 1, WORLD))
    steps = 8
    lines: list[str] = []
    result = launch(WORLD, ["--steps", str(steps), "--faults", delays, "--no-http"], steps=steps,
                    port=free_port(), deadline_s=200, echo=lines.append)
    assert_healthy(result, lines)


# ---- the launch's verdict: one result per step, for every member of the view that settled it ---


def _record(rank: int, step: int, digest: str, ranks: list[int], epoch: int, members: list[int]) -> StepRecord:
    return StepRecord(rank=rank, step=step, duration_s=0.1, exact=True, contributors=len(ranks), ranks=ranks,
                      epoch=epoch, members=members, digest=digest)


def test_the_verdict_compares_the_members_that_settled_each_step() -> None:
    """The issue's case: at the last step two healthy ranks were left out after they had the
    7-contributor result, while the five others settled on a 5-contributor one. The five agree
    (the guarantee holds), but two ranks left the group with no fault to explain it: the run
    fails, naming them. A member of the settling view with another result breaks the
    guarantee itself."""
    five, seven = [0, 1, 2, 3, 4], list(range(7))
    result = LaunchResult(world=7, steps=2)
    for r in seven:
        result.records[0][r] = _record(r, 0, "a", seven, 0, seven)
        result.records[1][r] = (_record(r, 1, "b", seven, 0, seven) if r in (5, 6)
                                else _record(r, 1, "c", five, 1, five))
    assert result.all_exact()
    assert result.deciding_members(1) == set(five)
    assert result.agree()
    assert result.departures() == [(5, 1), (6, 1)]
    assert not result.ok
    result.records[1][4] = _record(4, 1, "d", five, 1, five)  # a member of the settling view differs
    assert not result.agree()
    clean = LaunchResult(world=7, steps=1)
    for r in seven:
        clean.records[0][r] = _record(r, 0, "a", seven, 2, seven)  # a pace change: same members
    assert clean.agree()
    assert clean.departures() == []
    assert clean.ok


def test_shortfalls_name_each_rank_and_step_that_was_not_clean() -> None:
    """A clean run has none; a missing report, a wrong sum, a sum without everybody and a view
    change each come back as one entry naming the step, the rank and what, and the view
    check can be left out (a pace agreement changes the view, not the members)."""
    three = [0, 1, 2]
    result = LaunchResult(world=3, steps=2)
    for step in range(2):
        for r in three:
            result.records[step][r] = _record(r, step, "a", three, 0, three)
    assert result.shortfalls() == []
    del result.records[1][2]
    result.records[0][1] = StepRecord(rank=1, step=0, duration_s=0.1, exact=False, contributors=3, ranks=three,
                                      error="timed out")
    result.records[1][0] = _record(0, 1, "b", [0, 1], 0, three)
    result.records[1][1] = _record(1, 1, "a", three, 1, three)
    assert result.shortfalls() == [
        Shortfall(0, 1, "not exact", "timed out"),
        Shortfall(1, 0, "not everybody in the sum", "sum of [0, 1]"),
        Shortfall(1, 1, "another view", "view 1: [0, 1, 2]"),
        Shortfall(1, 2, "no report"),
    ]
    assert [(s.step, s.rank, s.what) for s in result.shortfalls(view=None)] == [
        (0, 1, "not exact"), (1, 0, "not everybody in the sum"), (1, 2, "no report")]
