"""Mutual TLS (docs/security.md): every connection encrypted, every peer's rank read from a
certificate of the job's own CA. An outsider, another job's worker or a member claiming
another rank is refused at the handshake while the job's steps stay exact."""

from __future__ import annotations

import gc
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from fttree import ConfigError, FTTreeAllreduce
from fttree.net import certs
from fttree.net.credentials import Credentials, Tls, rank_of, write_key
from fttree.tools.cli import main as cli

from .conftest import cluster, exact_steps, free_port, local_peers, start_all
from .procs import Output

PROBER = Path(__file__).resolve().parent / "tls_prober.py"


def test_certificates_name_their_rank_and_a_ca_signs_more_later(tmp_path: Path) -> None:
    made = certs.make(tmp_path, range(2))
    assert [p.name for p in made] == ["rank-0.pem", "rank-1.pem"]
    certs.make(tmp_path, [5], add=True)
    tls = Tls.from_dir(tmp_path, 5)
    assert tls.server.verify_mode.name == "CERT_REQUIRED"
    assert tls.client.verify_mode.name == "CERT_REQUIRED"
    assert rank_of({"subjectAltName": (("URI", "urn:fttree:rank:5"),)}) == 5
    assert rank_of({"subjectAltName": (("DNS", "rank5"),)}) is None
    assert rank_of(None) is None
    with pytest.raises(ConfigError, match="a job CA is there already"):
        certs.make(tmp_path, range(2))
    with pytest.raises(ConfigError, match=r"lacks rank-3\.pem, rank-3\.key for rank 3"):
        Tls.from_dir(tmp_path, 3)
    with pytest.raises(ConfigError, match="cannot read the job CA"):
        certs.make(tmp_path / "none", [1], add=True)


def test_certs_cli(tmp_path: Path) -> None:
    runner = CliRunner()
    out = runner.invoke(cli, ["certs", "-n", "3", "--out", str(tmp_path / "job")])
    assert out.exit_code == 0, out.output
    assert sorted(p.name for p in (tmp_path / "job").iterdir()) == [
        "ca.key", "ca.pem", "rank-0.key", "rank-0.pem", "rank-1.key", "rank-1.pem", "rank-2.key", "rank-2.pem"]
    assert (tmp_path / "job" / "ca.key").stat().st_mode & 0o077 == 0
    added = runner.invoke(cli, ["certs", "--add", "7", "--out", str(tmp_path / "job")])
    assert added.exit_code == 0, added.output
    assert (tmp_path / "job" / "rank-7.pem").exists()
    both = runner.invoke(cli, ["certs", "-n", "2", "--add", "3", "--out", str(tmp_path / "x")])
    assert both.exit_code != 0
    assert "either -n N" in both.output


def test_a_tls_job_sums_exactly_and_names_its_job_by_its_ca(tmp_path: Path) -> None:
    certs.make(tmp_path / "tls", range(3))
    with cluster(3, tls_dir=str(tmp_path / "tls"), timeout_s=0.3, step_timeout_s=20) as handles:
        exact_steps(handles, 10, size=50_000)
        assert {h.credentials.job for h in handles} == {Tls.from_dir(tmp_path / "tls", 0).ca_fingerprint[:16]}
        assert all(h.status().transport.refusals == 0 for h in handles)
    key = write_key(tmp_path / "job.key")  # a key and TLS together: the key names the job
    with cluster(3, tls_dir=str(tmp_path / "tls"), auth_key_file=str(key), timeout_s=0.3, step_timeout_s=20) as handles:
        exact_steps(handles, 3, size=50_000)
        assert handles[0].credentials.job == Credentials.from_key_file(key).job


def test_outsiders_and_a_member_claiming_another_rank_are_refused(tmp_path: Path) -> None:
    certs.make(tmp_path / "tls", range(3))
    certs.make(tmp_path / "other", range(3))
    with cluster(3, tls_dir=str(tmp_path / "tls"), timeout_s=0.3, step_timeout_s=20,
                 handshake_timeout_s=2.0) as handles:
        exact_steps(handles, 3, size=50_000)
        prober = subprocess.Popen([sys.executable, str(PROBER), "--target", str(handles[0].peers[0]), "--job-dir",
                                   str(tmp_path / "tls"), "--other-dir", str(tmp_path / "other"), "--job",
                                   handles[0].credentials.job], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)
        while prober.poll() is None:  # the job runs while it is probed
            exact_steps(handles, 1, size=50_000)
        out, err = prober.communicate(timeout=60)
        assert prober.returncode == 0, err
        report = json.loads(out)
        assert report == {"clear": "refused", "no_certificate": "refused", "other_job": "refused",
                          "rank1_as_rank2": "refused", "rank1_as_itself": "answered"}, report
        exact_steps(handles, 3, size=50_000)
        transport = handles[0].transport
        assert transport is not None
        # the lie about the rank, and three failed TLS handshakes (counted as their
        # connections are let go, which a collection of cycles may be needed for)
        deadline = time.monotonic() + 30
        while handles[0].status().transport.refusals < 4 and time.monotonic() < deadline:
            gc.collect()
            exact_steps(handles, 1, size=50_000)
        assert handles[0].status().transport.refusals >= 4, handles[0].status().transport.refusals


def test_a_flood_of_idle_tls_connections_costs_bounded_memory(tmp_path: Path) -> None:
    """2,000 connections that start a TLS handshake and stall: at most max_pending_handshakes
    are accepted at a time (the rest wait in the kernel's backlog), each dropped at the
    handshake deadline; the job's steps stay exact and the worker's memory bounded."""
    certs.make(tmp_path / "tls", range(3))
    with cluster(3, tls_dir=str(tmp_path / "tls"), timeout_s=0.3, step_timeout_s=20,
                 handshake_timeout_s=2.0) as handles:
        exact_steps(handles, 10)
        before = rss_mb()
        prober = subprocess.Popen([sys.executable, str(PROBER), "--target", str(handles[0].peers[0]), "--job-dir",
                                   str(tmp_path / "tls"), "--other-dir", str(tmp_path / "tls"), "--job", "x",
                                   "--flood", "2000", "--hold", "5"], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        peak = before
        while prober.poll() is None:
            exact_steps(handles, 1)
            peak = max(peak, rss_mb())
        _out, err = prober.communicate(timeout=60)
        assert prober.returncode == 0, err
        transport = handles[0].transport
        assert transport is not None
        assert handles[0].status().transport.refusals > 0  # the stalled handshakes, at their deadline
        assert peak - before < 50, (before, peak)
        exact_steps(handles, 3)


def rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 1e6


def test_a_worker_without_the_job_certificate_cannot_join_the_job(tmp_path: Path) -> None:
    """The same ports, one worker holding another CA's certificate: it is never let in."""
    certs.make(tmp_path / "tls", range(3))
    certs.make(tmp_path / "other", range(3))
    peers = local_peers(3)
    good = [FTTreeAllreduce(r, peers, tls_dir=str(tmp_path / "tls"), startup_timeout_s=10, timeout_s=0.3)
            for r in (0, 1)]
    stranger = FTTreeAllreduce(2, peers, tls_dir=str(tmp_path / "other"), startup_timeout_s=10, timeout_s=0.3)
    errors = [str(e) for e in start_all([*good, stranger], 60)]
    try:
        assert len(errors) == 3, f"a worker with another job's certificate started with the job: {errors}"
        assert any("CERTIFICATE_VERIFY_FAILED" in e for e in errors), errors
    finally:
        for h in [*good, stranger]:
            h.close()


def test_tls_dir_is_checked_at_construction(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tls_dir .* lacks ca\.pem, rank-0\.pem, rank-0\.key for rank 0"):
        FTTreeAllreduce(0, local_peers(2), tls_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="tls_dir must be a path"):
        FTTreeAllreduce(0, local_peers(2), tls_dir=5)


def test_launch_tls_with_a_crash(tmp_path: Path) -> None:
    """The one-line command: `fttree launch --tls` with a worker killed mid-run."""
    proc = subprocess.run([sys.executable, "-m", "fttree", "launch", "-n", "5", "--steps", "10", "--size", "20000",
                           "--tls", "--faults", "crash 3 @4", "--launch-dir", str(tmp_path), "--port",
                           str(free_port())],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "all exact: yes" in proc.stdout
    assert "survivors [0, 1, 2, 4]" in proc.stdout
    assert (tmp_path / "tls" / "rank-4.pem").exists()


def test_from_env_reads_the_tls_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FTTREE_RANK", "0")
    monkeypatch.setenv("FTTREE_PEERS", ",".join(local_peers(2)))
    monkeypatch.setenv("FTTREE_TLS_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match=r"lacks ca\.pem"):
        FTTreeAllreduce.from_env()
    certs.make(tmp_path, range(2))
    assert FTTreeAllreduce.from_env().credentials.tls is not None


def test_tls_from_three_files_and_their_checks(tmp_path: Path) -> None:
    certs.make(tmp_path, range(2))
    peers = local_peers(2)

    def files(rank: int) -> dict[str, str]:
        return {"tls_cert_file": str(tmp_path / f"rank-{rank}.pem"), "tls_key_file": str(tmp_path / f"rank-{rank}.key"),
                "tls_ca_file": str(tmp_path / "ca.pem")}

    handles = [FTTreeAllreduce(r, peers, timeout_s=0.3, step_timeout_s=20, **files(r)) for r in range(2)]
    starts = [threading.Thread(target=h.start) for h in handles]
    for t in starts:
        t.start()
    for t in starts:
        t.join(timeout=60)
    try:
        exact_steps(handles, 2, size=50_000)
        assert all(h.credentials.tls is not None for h in handles)
    finally:
        for h in handles:
            h.close()
    with pytest.raises(ConfigError, match="only tls_cert_file, tls_ca_file given"):
        FTTreeAllreduce(0, peers, tls_cert_file=files(0)["tls_cert_file"], tls_ca_file=files(0)["tls_ca_file"])
    with pytest.raises(ConfigError, match="not both"):
        FTTreeAllreduce(0, peers, tls_dir=str(tmp_path), **files(0))
    with pytest.raises(ConfigError, match="TLS files"):  # a key that is not the certificate's
        FTTreeAllreduce(0, peers, **{**files(0), "tls_key_file": str(tmp_path / "rank-1.key")})


def test_launch_without_a_key_is_the_loopback_baseline(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "fttree", "launch", "-n", "3", "--steps", "3", "--size", "1000",
                           "--no-key", "--launch-dir", str(tmp_path), "--port", str(free_port())],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "all exact: yes" in proc.stdout
    assert not (tmp_path / "job.key").exists()


@pytest.mark.parametrize("credential", ["tls", "key"])
def test_worker_processes_survive_a_kill_and_the_restarted_rank_rejoins(tmp_path: Path, credential: str) -> None:
    """Real processes (`fttree worker`): rank 3 is SIGKILLed, started again with the same
    command, and admitted back; every step of every worker is exact. It then leaves on SIGTERM
    and the others go on."""
    if credential == "tls":
        certs.make(tmp_path / "tls", range(4))
        extra = ["--tls-dir", str(tmp_path / "tls")]
    else:
        extra = ["--auth-key-file", str(write_key(tmp_path / "job.key"))]
    peers = tmp_path / "peers.txt"
    peers.write_text("\n".join(local_peers(4)) + "\n")

    def worker(rank: int) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-m", "fttree", "worker", "--rank", str(rank), "--peers", str(peers),
                                 "--steps", "1000000", "--size", "64", "--timeout", "0.2", *extra],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    procs = [worker(r) for r in range(4)]
    outs = [Output(p) for p in procs]
    try:
        outs[0].wait_for("step  20 ")
        procs[3].kill()
        procs[3].wait()
        outs[0].wait_for("evicted [3]")
        procs[3] = worker(3)
        outs[3] = Output(procs[3])
        outs[3].wait_for(" exact", count=20)  # admitted: it runs the group's steps with the group's sums
        outs[0].wait_for("ranks [3] joined")
        procs[3].send_signal(signal.SIGTERM)  # and leaves again, gracefully
        assert procs[3].wait(timeout=120) == 0, outs[3].text()[-2000:]
        outs[0].wait_for(" exact", count=outs[0].text_now().count(" exact") + 20)  # the others go on
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, out in enumerate(outs):
        text = out.text()
        assert "FAILED" not in text, f"rank {rank}: {text[-2000:]}"
    assert "rank 3 left the group after step" in outs[3].text()


def test_cli_tls_flags_are_checked(tmp_path: Path) -> None:
    peers = tmp_path / "peers.txt"
    peers.write_text("\n".join(local_peers(2)) + "\n")
    (tmp_path / "cert.pem").write_text("")
    runner = CliRunner()
    worker = runner.invoke(cli, ["worker", "--rank", "0", "--peers", str(peers), "--tls-cert",
                                 str(tmp_path / "cert.pem")])
    assert worker.exit_code != 0
    assert "TLS needs tls_cert_file, tls_key_file and tls_ca_file together" in worker.output
    launch = runner.invoke(cli, ["launch", "-n", "2", "--tls-cert", str(tmp_path / "cert.pem")])
    assert launch.exit_code != 0
    assert "use --tls or --tls-dir" in launch.output
    both = runner.invoke(cli, ["launch", "-n", "2", "--no-key", "--auth-key-file", str(tmp_path / "cert.pem")])
    assert both.exit_code != 0
    assert "contradict" in both.output
