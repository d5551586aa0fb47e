"""A join's state transfer end to end on the simulator (issue 43): the group admits a joiner, its
donors send the training state through the in-memory network as pieces, the joiner checks each
piece and the whole digest, loads the state and replays the steps it kept, and ends with the
members' bytes. A donor that dies mid-transfer, or sends a corrupt piece, costs only the pieces
it did not deliver."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from fttree.core.messages import Frame, Kind, State
from fttree.testing.simstate import SimTrainer, simulate_training
from fttree.testing.simulate import Simulation
from fttree.training import elastic

WORLD = 4
JOINER = WORLD


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test model's state is 2.5 KB: in 128-byte pieces, 20 of them to deal among 4 donors."""
    monkeypatch.setattr(elastic, "CHUNK_BYTES", 128)


def piece_sent(msg: Frame) -> bool:
    return isinstance(msg, State) and msg.kind is Kind.STATE and msg.piece >= 0


def test_a_simulated_join_takes_the_state_from_several_donors_and_ends_with_their_bytes() -> None:
    """The joiner starts from other values; pieces come from every donor, each once, over the
    simulated network; after its load and replay every process holds the same state bytes."""
    before: dict[int, bytes] = {}

    def keep_joiner_start(run: Simulation, trainers: dict[int, SimTrainer]) -> None:
        def admitted(run: Simulation, rank: int, first_step: int) -> None:
            given(run, rank, first_step)
            before[rank] = trainers[rank].state_bytes()
        given = run.on_admitted
        assert given is not None
        run.on_admitted = admitted

    run, trainers = simulate_training(WORLD, f"join {JOINER} @3", steps=16, before=keep_joiner_start)
    run.check()
    joiner = trainers[JOINER]
    record = joiner.transfer.record
    assert record is not None, "the joiner never had a checked state"
    assert not joiner.syncing
    assert len(record.donors) >= 3, f"pieces came from {record.pieces}, not from several donors"
    total = sum(record.pieces.values())
    assert total == -(-record.nbytes // elastic.CHUNK_BYTES) > WORLD
    assert record.piece_bytes == record.nbytes, "a piece came twice"
    assert record.refetched == 0
    assert sum(joiner.transfer.dropped.values()) == 0
    assert sum(trainers[r].transfer.pieces_sent for r in range(WORLD)) == total
    assert run.network.stats.by_kind[Kind.STATE] >= total + len(record.donors_asked)  # through the network
    members = trainers[0].state_bytes()
    assert before[JOINER] != members
    for rank, trainer in trainers.items():
        assert trainer.state_bytes() == members, f"rank {rank} holds other training state than rank 0"
        assert not trainer.failed


def test_a_donor_that_dies_mid_transfer_costs_only_the_pieces_it_did_not_deliver() -> None:
    """Rank 1 dies after sending two pieces: the group evicts it, its two pieces are kept, and
    only the window it still owed is asked of the others."""
    dead = 1

    def crash_after_two_pieces(run: Simulation, trainers: dict[int, SimTrainer]) -> None:
        link: Any = trainers[dead].transfer.ar
        send = link.send_frame
        sent = [0]

        def send_then_die(dst: int, msg: Frame) -> None:
            if piece_sent(msg):
                if sent[0] == 2:
                    run.network.crash(dead)
                    return
                sent[0] += 1
            send(dst, msg)

        link.send_frame = send_then_die

    run, trainers = simulate_training(WORLD, f"join {JOINER} @3", steps=20, before=crash_after_two_pieces,
                                      step_timeout_s=0.5, transfer={"wait_s": 1.0, "window": 2})
    run.check()
    assert dead in run.network.wire.crashed
    joiner = trainers[JOINER]
    record = joiner.transfer.record
    assert record is not None, "the joiner never had a checked state"
    assert record.pieces[dead] == 2
    total = sum(record.pieces.values())
    assert total == -(-record.nbytes // elastic.CHUNK_BYTES)
    assert record.piece_bytes == record.nbytes, "a piece came twice: the dead donor's were fetched again"
    assert 1 <= record.refetched <= 2, "only the window the dead donor owed is asked again"
    members = trainers[0].state_bytes()
    for rank, trainer in trainers.items():
        if rank != dead:
            assert trainer.state_bytes() == members, f"rank {rank} holds other training state than rank 0"


def test_a_corrupt_piece_loses_its_donor_and_is_taken_from_the_others() -> None:
    """Rank 2's first piece arrives with a flipped byte: the joiner's check of that piece drops
    it and asks rank 2 nothing more; the others deliver the whole state."""
    liar = 2

    def corrupt_first_piece(run: Simulation, trainers: dict[int, SimTrainer]) -> None:
        link: Any = trainers[liar].transfer.ar
        send = link.send_frame
        done = [False]

        def send_corrupted(dst: int, msg: Frame) -> None:
            if piece_sent(msg) and isinstance(msg, State) and msg.payload is not None and not done[0]:
                bad = bytearray(msg.payload)
                bad[0] ^= 0xFF
                msg = dataclasses.replace(msg, payload=bytes(bad))
                done[0] = True
            send(dst, msg)

        link.send_frame = send_corrupted

    run, trainers = simulate_training(WORLD, f"join {JOINER} @3", steps=16, before=corrupt_first_piece)
    run.check()
    joiner = trainers[JOINER]
    record = joiner.transfer.record
    assert record is not None, "the joiner never had a checked state"
    assert joiner.transfer.dropped["a piece that does not match its digest"] == 1
    assert liar not in record.pieces
    assert sum(record.pieces.values()) == -(-record.nbytes // elastic.CHUNK_BYTES)
    members = trainers[0].state_bytes()
    for rank, trainer in trainers.items():
        assert trainer.state_bytes() == members, f"rank {rank} holds other training state than rank 0"


@pytest.mark.parametrize("faults", ["restart 2 @5", "restart 2 @4..6", f"join {JOINER} @3; join {JOINER + 1} @3",
                                    f"join {JOINER} @3; crash 2 @5"])
def test_every_process_admitted_under_a_schedule_ends_with_the_members_bytes(faults: str) -> None:
    """A restarted rank and joiners admitted together take the state the same way; a member
    that dies meanwhile changes nothing for the others."""
    run, trainers = simulate_training(WORLD, faults, steps=20)
    run.check()
    assert run.admitted, "no process was admitted"
    members = trainers[0].state_bytes()
    for rank in run.admitted:
        assert trainers[rank].transfer.record is not None, f"rank {rank} never had a checked state"
    for rank, trainer in trainers.items():
        if rank not in run.network.wire.crashed:
            assert not trainer.syncing
            assert trainer.state_bytes() == members, f"rank {rank} holds other training state than rank 0"
