"""`fttree bench --elastic`'s report (tools/bench_elastic.py): a run whose pattern did not happen
says so, with the worker's last words, and fails; a complete one prints its figures."""

from __future__ import annotations

import pytest

from fttree.tools.bench_elastic import _Seen, report

N, STEPS = 3, 100


def _steady(last: int) -> _Seen:
    seen = _Seen()
    for step in range(last + 1):
        seen.times[step] = 0.015
        seen.walls[step] = 1000.0 + step * 0.02
    return seen


def test_a_restart_that_never_joined_is_reported_with_its_last_words(capsys: pytest.CaptureFixture[str]) -> None:
    seen = {0: _steady(39), 1: _steady(39), 2: _steady(9)}
    seen[0].stderr.extend(["rank 0: minority 1 of 2: this rank stops producing results"])
    rejoined = _Seen()
    rejoined.stderr.extend(["Traceback (most recent call last):", "PeerError: rank 2 could not reach peers"])
    assert report(N, STEPS, seen, rejoined) is False
    out = capsys.readouterr().out
    assert "not measured: the restarted rank 2 never joined (rank 0 ran to step 39 of 100" in out
    assert "    PeerError: rank 2 could not reach peers" in out
    assert f"not measured: rank 0 never reached step {STEPS - 20}, where rank 1 leaves" in out
    assert "    rank 0: minority 1 of 2" in out


def test_a_complete_pattern_prints_its_figures() -> None:
    seen = {0: _steady(STEPS - 1), 1: _steady(STEPS - 21), 2: _steady(9)}
    rejoined = _Seen(events={"asked": 1000.25, "joined": 14, "synced": 20, "donor": 0, "as_of": 14,
                             "nbytes": 3_256_955, "seconds": 0.13, "replayed": 6})
    assert report(N, STEPS, seen, rejoined) is True
