"""The join handshake's decisions (core/admission.py), through the replica's one entrance and
without a network: what a member answers, which requests reach the membership, and how an
asker takes its admission."""

from __future__ import annotations

from fttree.core.admission import MAX_CANDIDATES, Admission, Answer, Answered, Joined, LearnAddress, Query, Reply
from fttree.core.config import Config
from fttree.core.lifecycle import Phase
from fttree.core.messages import Join, Kind
from fttree.core.protocol import Send
from fttree.core.replica import Arrived, Replica, StepDone
from fttree.core.view import View

VIEW = View(0, (0, 1, 2, 3))


def ask(rank: int, incarnation: int, query: Query = Query.IS_RUNNING) -> Arrived:
    return Arrived(msg=Join(kind=Kind.JOIN, src=rank, query=query, incarnation=incarnation,
                            addresses=((rank, f"127.0.0.{rank + 1}:29500"),)))


def test_a_member_answers_starting_to_a_peer_of_the_first_start_and_running_to_its_restart() -> None:
    member = Replica(0, VIEW, Config())
    first = member.step(ask(2, incarnation=7), 0.0)
    assert Reply(dst=2, answer=Answer.STARTING, view=VIEW) in first
    assert LearnAddress(rank=2, address="127.0.0.3:29500") in first
    again = member.step(ask(2, incarnation=7), 0.1)  # the same process asking again: still starting
    assert next(a for a in again if isinstance(a, Reply)).answer is Answer.STARTING
    restarted = member.step(ask(2, incarnation=8), 0.2)  # a new process of rank 2: a group runs
    assert next(a for a in restarted if isinstance(a, Reply)).answer is Answer.RUNNING


def test_a_rank_outside_the_view_or_asking_after_steps_were_done_finds_a_running_group() -> None:
    member = Replica(0, VIEW, Config())
    outsider = member.step(ask(9, incarnation=1), 0.0)
    assert next(a for a in outsider if isinstance(a, Reply)).answer is Answer.RUNNING
    member.step(StepDone(step=0), 0.0)  # a step was done: whoever asks now is late
    late = member.step(ask(3, incarnation=1), 0.0)
    assert next(a for a in late if isinstance(a, Reply)).answer is Answer.RUNNING


def test_a_members_repeated_request_stays_away_from_the_membership_and_a_restart_reaches_it() -> None:
    adm = Admission()
    adm.answer(2, 7, view=VIEW, began=False, stopped=False)  # rank 2 is process 7
    assert not adm.request(2, 7, VIEW)  # its own late request: it is in already
    assert adm.request(2, 8, VIEW)  # a new process of rank 2
    assert adm.candidates[2] == 8
    adm.admitted((2,))
    assert adm.incarnations[2] == 8
    assert 2 not in adm.candidates
    assert not adm.request(2, 8, VIEW)  # admitted: its repeated asks are not a restart


def test_candidates_are_bounded() -> None:
    adm = Admission()
    assert all(adm.request(100 + i, 1, VIEW) for i in range(MAX_CANDIDATES))
    assert not adm.request(100 + MAX_CANDIDATES, 1, VIEW)
    assert len(adm.candidates) == MAX_CANDIDATES
    assert adm.request(100, 2, VIEW)  # a rank already waiting may still ask again


def test_a_request_goes_to_the_membership_which_answers_with_a_prepare() -> None:
    member = Replica(0, VIEW, Config())
    out = member.step(ask(4, incarnation=1, query=Query.ADMIT_ME), 0.0)
    assert LearnAddress(rank=4, address="127.0.0.5:29500") in out
    assert {a.msg.kind for a in out if isinstance(a, Send)} == {Kind.VIEW_PREPARE}
    assert member.may_send(4)  # a rank it is admitting may send it frames


def test_a_start_settles_on_a_majority_saying_starting_only_after_the_grace() -> None:
    adm = Admission()
    adm.heard(1, Answer.STARTING, 0, (), starting=True)
    adm.heard(2, Answer.STARTING, 0, (), starting=True)
    peers = (1, 2, 3, 4)  # with this rank, 5: three of five is a majority
    assert not adm.start_settled(peers, waited_s=0.5, grace_s=2.0)
    assert adm.start_settled(peers, waited_s=2.0, grace_s=2.0)
    adm.heard(3, Answer.RUNNING, 4, (1, 3), starting=True)
    assert adm.start_settled(peers, waited_s=0.0, grace_s=2.0)
    assert adm.asked() == (1, 3)


def test_an_asker_admitted_starts_its_machines_in_the_view_and_from_the_step_it_was_told() -> None:
    joiner = Replica(4, View(0, (4,)), Config(), join=True)
    assert joiner.phase is Phase.ASKING
    running = Join(kind=Kind.JOIN_REPLY, src=0, answer=Answer.RUNNING, epoch=2, members=(0, 1, 2, 3),
                      addresses=((0, "127.0.0.1:1"), (1, "127.0.0.2:1")))
    out = joiner.step(Arrived(msg=running), 0.0)
    assert joiner.admission.asked() == (0, 1, 2, 3)
    assert LearnAddress(rank=1, address="127.0.0.2:1") in out
    assert Answered() in out
    assert joiner.may_send(2)
    assert not joiner.may_send(9)
    admitted = Join(kind=Kind.JOIN_REPLY, src=0, answer=Answer.ADMITTED, epoch=3, members=(0, 1, 2, 3, 4),
                       step=60, user_step=6, addresses=((4, "127.0.0.5:1"), (3, "127.0.0.4:1")))
    out = joiner.step(Arrived(msg=admitted), 0.1)
    assert Joined(first_step=60, user_step=6) in out
    assert LearnAddress(rank=3, address="127.0.0.4:1") in out
    assert LearnAddress(rank=4, address="127.0.0.5:1") not in out  # its own address: nothing to learn
    assert joiner.phase is Phase.ADMITTED
    assert joiner.view.epoch == 3
    assert joiner.view.members == (0, 1, 2, 3, 4)


def test_an_admission_naming_other_ranks_only_is_not_taken() -> None:
    joiner = Replica(4, View(0, (4,)), Config(), join=True)
    other = Join(kind=Kind.JOIN_REPLY, src=0, answer=Answer.ADMITTED, epoch=3, members=(0, 1, 5), step=9)
    out = joiner.step(Arrived(msg=other), 0.0)
    assert not [a for a in out if isinstance(a, Joined)]
    assert joiner.phase is Phase.ASKING
