"""The fault language: parsing, windows, and verdicts."""

import pytest

from fttree.core.faults import FaultKind, FaultSchedule, parse
from fttree.errors import ConfigError
from fttree.net.faulty import StepMarks


def test_parse_all_kinds_round_trip() -> None:
    text = "cut 1-0 @5..10; drop 3-1 20% @2..; loss 3 20% @12..15; delay 2-0 50ms; isolate 4 @7"
    rules = parse(text)
    assert [r.kind for r in rules] == [FaultKind.CUT, FaultKind.DROP, FaultKind.LOSS, FaultKind.DELAY,
                                       FaultKind.ISOLATE]
    assert (rules[0].first_step, rules[0].last_step) == (5, 10)
    assert (rules[1].first_step, rules[1].last_step, rules[1].probability) == (2, None, 0.2)
    assert rules[3].delay_s == pytest.approx(0.05)
    assert (rules[4].first_step, rules[4].last_step) == (7, 7)
    assert parse("; ".join(str(r) for r in rules)) == rules


def test_cut_is_undirected_and_windowed() -> None:
    sched = FaultSchedule("cut 1-0 @5..10")
    assert not sched.verdict(1, 0, 4).drop
    assert sched.verdict(1, 0, 5).drop
    assert sched.verdict(0, 1, 10).drop
    assert not sched.verdict(1, 0, 11).drop
    assert not sched.verdict(2, 0, 7).drop


def test_isolate_and_delay() -> None:
    sched = FaultSchedule("isolate 4; delay 2-0 0.2s")
    assert sched.verdict(4, 1, 0).drop
    assert sched.verdict(3, 4, 99).drop
    assert sched.verdict(0, 2, 0).delay_s == pytest.approx(0.2)


def test_random_drop_is_seeded() -> None:
    first, second = FaultSchedule("drop 1-0 50%", seed=3), FaultSchedule("drop 1-0 50%", seed=3)
    a = [first.verdict(1, 0, s).drop for s in range(50)]
    b = [second.verdict(1, 0, s).drop for s in range(50)]
    assert a == b
    assert 5 < sum(a) < 45


@pytest.mark.parametrize(("text", "needle"), [
    ("snip 1-0", "unknown fault 'snip'"),
    ("cut 1", "needs a link"),
    ("cut 1-1", "to itself"),
    ("drop 1-0 150%", "probability"),
    ("delay 1-0 fast", "delay like"),
    ("cut 1-0 @9..3", "ends before"),
    ("cut 1-0 @x", "bad step window"),
    ("loss 3", "wrong arguments"),
])
def test_bad_rules_say_what_is_wrong(text: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        parse(text)


def test_rank_outside_world_is_rejected() -> None:
    with pytest.raises(ConfigError, match="rank 9, outside the world of 7"):
        FaultSchedule("cut 9-0", world=7)


def test_step_marks_map_allreduce_steps_onto_the_steps_the_user_sees() -> None:
    marks = StepMarks(keep=3)
    assert marks.user_step(7) == 7  # no marks: a job's steps are its allreduce steps
    marks.mark(0, None)  # setup collectives: steps 0..2
    marks.mark(3, 0)  # training step 0: four gradient buckets, steps 3..6
    marks.mark(7, 1)
    marks.next_step = 9
    assert [marks.user_step(s) for s in range(9)] == [None, None, None, 0, 0, 0, 0, 1, 1]
    assert marks.user_step(12) == 1  # our own frames of the newest step
    assert marks.user_step(12, inbound=True) is None  # a peer's step we have not reached: its call
    marks.mark(9, 2)
    marks.mark(9, 3)  # re-marked before any step of it was submitted: the newest mark wins
    assert marks.user_step(9) == 3
    assert marks.user_step(0) is None  # only the newest `keep` marks are kept


def test_partition_crash_and_hang_parse_and_say_what_they_touch() -> None:
    schedule = FaultSchedule("partition 4,1,3 @8..12; crash 4 @12; hang 2 @5..6", world=7)
    part, crash, hang = schedule.rules
    assert str(part) == "partition 1,3,4 @8..12"
    assert part.touches(1, 0)
    assert part.touches(0, 4)
    assert not part.touches(1, 3)
    assert not part.touches(0, 2)
    assert schedule.blocks(3, 6, 10)
    assert not schedule.blocks(3, 6, 13)
    assert schedule.verdict(3, 6, 9).drop
    assert [r.kind.value for r in schedule.node_faults()] == ["crash", "hang"]
    assert schedule.node_faults(2) == [hang]
    assert (crash.first_step, hang.last_step) == (12, 6)
    assert not crash.touches(4, 0)  # a crash is carried out on the node, not frame by frame
