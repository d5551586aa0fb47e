"""Issue 41's hardening findings replayed, each as a separate attacking process against a real
3-worker job, with the figures the issue's targets ask for (its closing note):

    python tests/attack_replay.py [--only NAME] [--size N] [--gap S]

For each attack it starts a fresh job of three worker processes at defaults (a job key; mutual
TLS besides for findings 1 and 5), each running checked allreduce steps of a known input
(fttree.tools.demo.run_steps, as `fttree worker` does) without end and reporting every step as a
JSON line on its stdout. It samples every worker's VmRSS (/proc/PID/status) every 50 ms: the
baseline is the median of the 2 s before the attack, the peak the largest sample from the
attack's start to the end, and "after" the median of the last second once the attacker is gone
and each worker ran five more steps (and 2 s passed, or --settle S). The early sums of 4 are for
steps 1,000 ahead of rank 0's (--early-ahead N): the replay ends before those steps run. Then it
prints one line per attack and `replay ok`, or `replay FAILED: ...` naming every target missed
(exit status 1):

- every step of every worker from the baseline on exact, with all three members in its sum;
- no member evicted; no step longer than the node deadline its rank held (for 3, whose silent
  joiner stalls the step it is in until it is evicted, the eviction time is the target);
- each worker's RSS never more than 300 MB above its baseline, and within 50 MB of it after;
- 1: rank 1's own redial (its control connection to rank 0 cut in its process, timed as
  tests/test_hardening_transport.py's redial_s does) and a member's new connection (TCP, TLS
  with rank 2's certificate, HELLO, CHALLENGE: member_hello_s) within 2 s during the flood;
- 3: the joiner evicted within 2 node deadlines of its admission (each member's view with it
  to its view without it), and the job going on;
- 5: with TLS, an impostor holding the key and a certificate of the job's CA (of rank 7) is
  refused as rank 1 on both channels. The same with a key alone (5-impostor-key) is printed
  as documented behaviour, not a target: docs/security.md says a shared key makes every
  holder every rank (the impostor displaces rank 1's connection until rank 1 redials);
- 6: a forged state declaring 2^27 elements raises StateError without allocating (the decode
  runs in a process of its own, tests/test_state_forged.py's PEAK).

Workers run with an open-files limit of 1,024 (the common default of finding 2). MB here is
10^6 bytes. The same file is the workers' program (--worker), the joiner's (--joiner) and the
key holders' (--attacker early|unfinished|impostor); the other attackers are tests/tls_flooder.py
and tests/slow_http.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

HERE = Path(__file__).resolve().parent
FLOODER = HERE / "tls_flooder.py"
SLOW_HTTP = HERE / "slow_http.py"
WORLD = 3
MEMBERS = tuple(range(WORLD))
EXTRA_CERT_RANK = 7  # a certificate of the job's CA that no member holds (the impostor's, in 5)
PEAK_MB, AFTER_MB, RECONNECT_S, EVICT_DEADLINES = 300.0, 50.0, 2.0, 2.0
SAMPLE_S = 0.05


# ---- the worker: checked steps without end, a JSON line each ------------------------------------


class _Stop(Exception):
    pass


def worker_main(a: argparse.Namespace) -> int:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if a.nofile:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(a.nofile, hard), hard))
    from fttree import FTTreeAllreduce
    from fttree.tools.demo import run_steps
    from tests.test_hardening_transport import redial_s

    lock = threading.Lock()

    def emit(rec: dict[str, Any]) -> None:
        with lock:
            sys.stdout.write(json.dumps(rec) + "\n")
            sys.stdout.flush()

    peers = Path(a.peers).read_text().split()
    kw: dict[str, Any] = {"auth_key_file": a.key}
    if a.tls_dir:
        kw["tls_dir"] = a.tls_dir
    ar = FTTreeAllreduce(a.rank, peers, http_port=0, http_host=peers[a.rank].rsplit(":", 1)[0], **kw)
    ar.start()
    emit({"ready": True, "rank": a.rank, "pid": os.getpid(), "http": ar.http_address, "job": ar.credentials.job,
          "t": time.time()})
    stop = threading.Event()

    def commands() -> None:
        for line in sys.stdin:
            words = line.split()
            if words[:1] == ["redial"]:
                peer = int(words[1])
                try:
                    emit({"redial_s": redial_s(ar, peer=peer), "peer": peer, "t": time.time()})
                except Exception as exc:
                    emit({"redial_s": None, "peer": peer, "error": f"{type(exc).__name__}: {exc}"})
            elif words[:1] == ["stop"]:
                break
        stop.set()

    def views() -> None:
        seen: tuple[int, ...] = ()
        while not stop.wait(0.01):
            view = ar.view
            if view.members != seen:
                seen = view.members
                emit({"view": list(seen), "epoch": view.epoch, "t": time.time()})

    threading.Thread(target=commands, daemon=True).start()
    threading.Thread(target=views, daemon=True).start()
    began = [time.time()]

    def before_step(step: int) -> None:
        if stop.wait(a.gap):
            raise _Stop
        began[0] = time.time()

    try:
        for rec in run_steps(ar, 1 << 40, a.size, before_step=before_step):
            node = ar.node
            status = None if node is None else ar.status().membership
            emit({"step": rec.step, "t0": began[0], "t1": time.time(), "duration_s": rec.duration_s,
                  "exact": rec.exact, "ranks": rec.ranks, "error": rec.error, "epoch": rec.epoch,
                  "deadline_s": None if status is None else status.node_deadline_s,
                  "evicted_total": None if status is None else status.evicted_total,
                  "evicted": [] if status is None else [e.rank for e in status.evictions]})
    except _Stop:
        pass
    finally:
        node = ar.node
        evictions = [] if node is None else [
            {"rank": e.rank, "reason": e.reason, "detected_after_s": e.detected_after_s}
            for e in ar.status().membership.evictions]
        emit({"final": True, "evictions": evictions, "left_group": ar.left_group})
        ar.close()
    return 0


def joiner_main(a: argparse.Namespace) -> int:
    """Joins the running job as rank 3, is admitted, says so, and stops itself (SIGSTOP): its
    connections stay open and no frame comes (tests/test_hardening_core_real.py's joiner)."""
    from fttree import FTTreeAllreduce

    ar = FTTreeAllreduce(3, {3: a.address}, join=a.contact, auth_key_file=a.key, startup_timeout_s=60).start()
    ar.admit()
    print(json.dumps({"admitted": time.time(), "joined_at": ar.joined_at}), flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(3600)
    return 0


# ---- key holders ------------------------------------------------------------------------------


def _tls_socket(raw: socket.socket, tls_dir: str | None, cert_rank: int | None) -> socket.socket:
    if tls_dir is None:
        return raw
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(Path(tls_dir) / "ca.pem"))
    ctx.check_hostname = False
    if cert_rank is not None:
        ctx.load_cert_chain(str(Path(tls_dir) / f"rank-{cert_rank}.pem"), str(Path(tls_dir) / f"rank-{cert_rank}.key"))
    return ctx.wrap_socket(raw, server_hostname="fttree")


def _closed(sock: socket.socket, wait_s: float = 0.0) -> bool:
    """True if the worker closed (or reset) `sock`, waiting up to `wait_s` for it."""
    sock.settimeout(wait_s if wait_s > 0 else None)
    if wait_s <= 0:
        sock.setblocking(False)
    try:
        while True:
            if not sock.recv(65536):
                return True
    except (BlockingIOError, TimeoutError, ssl.SSLWantReadError):
        return False
    except (OSError, ssl.SSLError):
        return True


def attacker_main(a: argparse.Namespace) -> int:
    import numpy as np

    from fttree.core.messages import MAGIC, PREFIX, VERSION, Kind, Message
    from fttree.net import handshake as hs
    from fttree.net.credentials import Credentials
    from tests.rawpeer import connect, handshake, message_frame

    key = Credentials.from_key_file(a.key).key
    host, port_s = a.target.rsplit(":", 1)
    port = int(port_s)
    report: dict[str, Any] = {"attack": a.attacker}
    started = time.monotonic()

    def prove(rank: int, channel: int, address: str = "") -> socket.socket | None:
        try:
            raw = connect(host, port)
        except OSError:
            return None
        try:
            sock = _tls_socket(raw, a.tls_dir, a.cert_rank)
            sock.settimeout(10)
            if handshake(sock, rank, dst=0, world=WORLD, key=key, channel=channel, address=address):
                return sock
        except (OSError, ssl.SSLError, AssertionError):
            pass
        raw.close()
        return None

    if a.attacker == "early":
        # subtree sums "from rank 1" for steps rank 0 has not reached, on rank 1's bulk channel
        # (unused while the steps are small: nothing is displaced), then gone
        sock = prove(1, hs.BULK)
        report["proven"] = sock is not None
        sent = 0
        payload = np.ones(a.numel, np.float32).tobytes()
        if sock is not None:
            sock.settimeout(30)
            try:
                for i in range(a.count):
                    msg = Message(kind=Kind.DATA_REDUCE, src=1, epoch=a.epoch, step=a.first_step + i, chunk=0,
                                  chunks=1, tree=0, origin=1, contributors=(1,), dtype="<f4", numel=a.numel,
                                  signature=f"float32[{a.numel}]", payload=payload)
                    sock.sendall(message_frame(msg))
                    sent += 1
            except OSError:
                pass
            report["closed_by_worker"] = sent < a.count or _closed(sock, 0.5)
            sock.close()
        report.update(frames_sent=sent, mb_sent=round(sent * len(payload) / 1e6, 1),
                      steps=[a.first_step, a.first_step + sent - 1])
    elif a.attacker == "unfinished":
        # ranks the job does not have, each starting a large frame and never finishing it
        socks = {r: prove(r, hs.CONTROL, f"127.0.0.100:{r + 1}") for r in range(a.first_rank, a.first_rank + a.count)}
        report["proven"] = sum(s is not None for s in socks.values())
        head, chunk = b"\x80" * 16, bytes(1 << 20)
        sent_mib: dict[int, int] = {}
        for r, sock in socks.items():
            sent_mib[r] = 0
            if sock is None:
                continue
            sock.settimeout(5)
            try:
                sock.sendall(PREFIX.pack(MAGIC, VERSION, len(head), a.announce_mib << 20) + head)
                for _ in range(a.payload_mib):
                    sock.sendall(chunk)
                    sent_mib[r] += 1
            except OSError:
                pass
        time.sleep(0.5)
        report["mib_sent"] = sent_mib
        report["kept_after_sending"] = [r for r, s in socks.items() if s is not None and not _closed(s)]
        time.sleep(a.hold)
        report["kept_after_hold"] = [r for r, s in socks.items() if s is not None and not _closed(s)]
        for s in socks.values():
            if s is not None:
                s.close()
    elif a.attacker == "impostor":
        # proves the key as rank 1 (a live member), on each channel, again and again
        tries = proven = refused = 0
        lifetimes: list[float] = []
        still_open = 0
        end = time.monotonic() + a.seconds
        log: list[str] = []
        while time.monotonic() < end:
            for channel in (hs.CONTROL, hs.BULK):
                tries += 1
                name = "control" if channel == hs.CONTROL else "bulk"
                sock = prove(1, channel)  # None: no CHALLENGE (refused at the HELLO, or by TLS)
                if sock is None:
                    refused += 1
                    log.append(f"{name}: refused")
                    continue
                proven += 1  # the PROOF went out; a refusal of it would show as a close at once
                t0 = time.monotonic()
                if _closed(sock, a.hold):
                    lifetimes.append(round(time.monotonic() - t0, 3))
                    log.append(f"{name}: proved, then closed by the worker")
                else:
                    still_open += 1
                    log.append(f"{name}: proved, open after {a.hold:g} s")
                sock.close()
            time.sleep(0.3)
        report.update(tries=tries, proven=proven, refused=refused, closed_after_s=lifetimes,
                      open_at_hold_end=still_open, outcomes={o: log.count(o) for o in sorted(set(log))})
    report["seconds"] = round(time.monotonic() - started, 2)
    print(json.dumps(report), flush=True)
    return 0


# ---- the driver -------------------------------------------------------------------------------


@dataclass
class Worker:
    rank: int
    proc: subprocess.Popen[str]
    log: IO[str]
    records: list[dict[str, Any]] = field(default_factory=list)
    changed: threading.Condition = field(default_factory=threading.Condition)
    ended: bool = False

    def start_reading(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with contextlib.suppress(ValueError):
                rec = json.loads(line)
                if isinstance(rec, dict):
                    with self.changed:
                        self.records.append(rec)
                        self.changed.notify_all()
        with self.changed:
            self.ended = True
            self.changed.notify_all()

    def wait(self, pred: Callable[[dict[str, Any]], bool], limit_s: float, what: str,
             since: int = 0) -> dict[str, Any]:
        """The first record from index `since` on that `pred` holds for, waiting up to `limit_s`."""
        deadline = time.monotonic() + limit_s
        with self.changed:
            while True:
                for rec in self.records[since:]:
                    if pred(rec):
                        return rec
                left = deadline - time.monotonic()
                if self.ended or left <= 0:
                    raise RuntimeError(f"rank {self.rank}: no {what} within {limit_s:g} s"
                                       f"{' (it ended)' if self.ended else ''}")
                self.changed.wait(min(left, 1.0))

    def steps(self) -> list[dict[str, Any]]:
        with self.changed:
            return [r for r in self.records if "step" in r]

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        with contextlib.suppress(OSError):
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()


class Sampler:
    """Every worker's VmRSS every SAMPLE_S seconds."""

    def __init__(self, pids: dict[int, int]) -> None:
        self.pids = pids
        self.samples: dict[int, list[tuple[float, float]]] = {r: [] for r in pids}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(SAMPLE_S):
            now = time.time()
            for rank, pid in self.pids.items():
                mb = vm_rss_mb(pid)
                if mb is not None:
                    self.samples[rank].append((now, mb))

    def between(self, rank: int, t0: float, t1: float) -> list[float]:
        return [mb for t, mb in self.samples[rank] if t0 <= t <= t1]


def vm_rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024 / 1e6
    except OSError:
        return None
    return None


class Job:
    """Three worker processes of this file, on 127.0.0.1-3 and one port, with a key (and TLS)."""

    def __init__(self, tmp: Path, tls: bool, args: argparse.Namespace) -> None:
        from fttree.net import address, certs
        from fttree.net.credentials import write_key

        self.tmp, self.args = tmp, args
        self.port = address.free_port(address.local_hosts(16))
        self.peers = [f"127.0.0.{r + 1}:{self.port}" for r in MEMBERS]
        (tmp / "peers.txt").write_text("\n".join(self.peers) + "\n")
        self.key = write_key(tmp / "job.key")
        self.tls_dir: Path | None = None
        if tls:
            self.tls_dir = tmp / "tls"
            certs.make(self.tls_dir, [*MEMBERS, EXTRA_CERT_RANK])
        self.workers: list[Worker] = []
        self.ready: list[dict[str, Any]] = []
        self.stopped = False

    def start(self) -> None:
        for r in MEMBERS:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--rank", str(r), "--peers",
                   str(self.tmp / "peers.txt"), "--key", str(self.key), "--size", str(self.args.size),
                   "--gap", str(self.args.gap), "--nofile", "1024"]
            if self.tls_dir is not None:
                cmd += ["--tls-dir", str(self.tls_dir)]
            log = open(self.tmp / f"worker-{r}.log", "w")  # noqa: SIM115 (closed in stop)
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
            w = Worker(r, proc, log)
            w.start_reading()
            self.workers.append(w)
        self.ready = [w.wait(lambda rec: bool(rec.get("ready")), 120, "ready line") for w in self.workers]

    def steps_done(self, since_t: float) -> int:
        """The fewest steps any worker finished after `since_t`."""
        return min(sum(1 for s in w.steps() if s["t1"] > since_t) for w in self.workers)

    def wait_steps(self, n: int, since_t: float, limit_s: float) -> bool:
        deadline = time.monotonic() + limit_s
        while self.steps_done(since_t) < n:
            if time.monotonic() > deadline or any(w.proc.poll() is not None for w in self.workers):
                return False
            time.sleep(0.05)
        return True

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        for w in self.workers:
            w.send("stop")
        deadline = time.monotonic() + 30
        for w in self.workers:
            with contextlib.suppress(RuntimeError):
                w.wait(lambda rec: bool(rec.get("final")), max(0.1, deadline - time.monotonic()), "final line")
        for w in self.workers:
            try:
                w.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait(10)

    def kill(self) -> None:
        for w in self.workers:
            if w.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.proc.pid, signal.SIGCONT)
                w.proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    w.proc.wait(10)
            w.log.close()


@dataclass
class Result:
    name: str
    figures: list[str] = field(default_factory=list)  # what the attack itself measured
    misses: list[str] = field(default_factory=list)  # targets missed
    documented: bool = False  # printed, not held to the targets
    line: str = ""


@contextlib.contextmanager
def attacker(cmd: list[str]) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired, ValueError):
            proc.communicate(timeout=10)


def finish(proc: subprocess.Popen[str], limit_s: float) -> dict[str, Any]:
    """The attacker's last JSON line once it ends (within `limit_s`, or it is killed)."""
    try:
        out, err = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate(timeout=10)
        return {"error": f"did not end within {limit_s:g} s"}
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}: {err.strip()[-300:]}"}
    rec = json.loads(lines[-1])
    assert isinstance(rec, dict)
    return rec


def read_json_line(proc: subprocess.Popen[str], limit_s: float) -> str:
    """The attacker's next stdout line, within `limit_s` (read on a thread: never blocks past it)."""
    got: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        got.append(proc.stdout.readline())

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(limit_s)
    if not got:
        raise RuntimeError(f"no line from the attacker within {limit_s:g} s")
    return got[0].strip()


def status_counts(address: str) -> dict[str, Any]:
    """The nonzero counters of a worker's GET /status ("counts", and "http": its status port's
    connections and those it shed), or why there are none."""
    try:
        with urllib.request.urlopen(f"http://{address}/status", timeout=5) as resp:
            doc = json.loads(resp.read())
    except (OSError, ValueError) as exc:
        return {"error": str(exc)}
    out = {k: v for k, v in doc.get("counts", {}).items() if v}
    http = doc.get("http", {})
    if http.get("shed"):
        out["http_shed"] = http["shed"]
    return out


def status_code(address: str) -> int:
    try:
        with urllib.request.urlopen(f"http://{address}/status", timeout=5) as resp:
            json.loads(resp.read())
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return err.code
    except (OSError, ValueError):
        return 0


def fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


# ---- the attacks: each runs while the job steps, returns what it measured -----------------------

Attack = Callable[[Job, Result], None]


def attack_tls_flood(job: Job, res: Result) -> None:
    from tests.test_hardening_transport import member_hello_s

    target = job.peers[0]
    with attacker([sys.executable, str(FLOODER), "--target", target, "--count", "1000", "--mode", "partial",
                   "--hold", "12"]) as flooder:
        if json.loads(read_json_line(flooder, 30)) != {"ready": True}:
            raise RuntimeError("the flooder did not say ready")
        time.sleep(2.0)  # the flood fills whatever it can fill
        redials: list[float] = []
        rank1 = job.workers[1]
        for _ in range(3):
            since = len(rank1.records)
            rank1.send("redial 0")
            rec = rank1.wait(lambda r: "redial_s" in r, 30, "redial result", since)
            redials.append(float("inf") if rec["redial_s"] is None else rec["redial_s"])
            time.sleep(0.3)
        assert job.tls_dir is not None
        hellos = [member_hello_s(target, job.tls_dir, 2, job.ready[0]["job"]) for _ in range(3)]
        report = finish(flooder, 60)
    res.figures.append(f"rank 1 redial {fmt_list(redials)} s, member HELLO answered {fmt_list(hellos)} s "
                       f"(flooder {report})")
    if max(redials) > RECONNECT_S:
        res.misses.append(f"rank 1's redial took {max(redials):.2f} s (target {RECONNECT_S:g} s)")
    if max(hellos) > RECONNECT_S:
        res.misses.append(f"a member's new connection took {max(hellos):.2f} s (target {RECONNECT_S:g} s)")


def attack_slow_http(job: Job, res: Result) -> None:
    from tests.test_hardening_transport import member_hello_s

    address = job.ready[0]["http"]
    pid = job.workers[0].proc.pid
    fds_before = fds(pid)
    codes: list[int] = []
    data_port: list[bool] = []
    fds_peak = fds_before
    with attacker([sys.executable, str(SLOW_HTTP), "--target", address, "--count", "2000", "--hold", "10"]) as slow:
        if read_json_line(slow, 60) != "sent":
            raise RuntimeError("slow_http did not say sent")
        end = time.monotonic() + 20
        while slow.poll() is None and time.monotonic() < end:
            fds_peak = max(fds_peak, fds(pid))
            codes.append(status_code(address))
            data_port.append(member_hello_s(job.peers[0], None, 2, job.ready[0]["job"], limit_s=5.0) < 5.0)
            time.sleep(0.5)
        report = finish(slow, 30)
    res.figures.append(f"rank 0 open files {fds_before} -> {fds_peak} (limit 1024); GET /status during it "
                       f"{codes.count(200)}/{len(codes)} answered 200; member HELLO on the data port answered "
                       f"{sum(data_port)}/{len(data_port)} (slow_http {report})")
    if codes.count(200) < len(codes):
        res.misses.append(f"/status answered {codes.count(200)} of {len(codes)} reads during the slowloris")
    if not all(data_port):
        res.misses.append(f"the data port answered {sum(data_port)} of {len(data_port)} HELLOs during the slowloris")


def attack_silent_joiner(job: Job, res: Result) -> None:
    from fttree.core.config import Config

    joined_t: dict[int, float] = {}
    evicted_t: dict[int, float] = {}
    since = {w.rank: len(w.records) for w in job.workers}
    with attacker([sys.executable, str(Path(__file__).resolve()), "--joiner", "--address",
                   f"127.0.0.4:{job.port}", "--contact", job.peers[0], "--key", str(job.key)]) as joiner:
        line = read_json_line(joiner, 120)
        admitted = json.loads(line)["admitted"]
        for w in job.workers:
            rec = w.wait(lambda r: 3 in r.get("view", ()), 60, "a view with rank 3", since[w.rank])
            joined_t[w.rank] = rec["t"]

            def without_3(r: dict[str, Any], t: float = rec["t"]) -> bool:
                return "view" in r and 3 not in r["view"] and r["t"] >= t

            rec = w.wait(without_3, 120, "a view without rank 3 after its admission", since[w.rank])
            evicted_t[w.rank] = rec["t"]
        stopped = joiner.poll() is None  # stopped, not dead: its connections stayed open
    deadline = max_deadline(job, min(joined_t.values()) - 5, max(evicted_t.values()) + 5)
    took = max(evicted_t[r] - joined_t[r] for r in MEMBERS)
    configured = Config().node_deadline_s
    res.figures.append(f"admitted (joiner's clock) at +0, installed by the members within "
                       f"{max(joined_t.values()) - admitted:+.3f} s; evicted {took:.3f} s after its admission "
                       f"= {took / deadline:.2f} node deadlines as held ({deadline:.2f} s, the largest any member "
                       f"held then), {took / configured:.2f} of the configured {configured:g} s; per rank "
                       f"{fmt_list([evicted_t[r] - joined_t[r] for r in MEMBERS])} s; joiner stopped, not dead: "
                       f"{stopped}")
    if took > EVICT_DEADLINES * deadline:
        res.misses.append(f"the silent joiner was evicted {took:.2f} s after its admission, "
                          f"{took / deadline:.2f} node deadlines (target {EVICT_DEADLINES:g})")


def attack_early_data(job: Job, res: Result) -> None:
    step = max(s["step"] for s in job.workers[0].steps())
    first = step + job.args.early_ahead
    epoch = job.workers[0].steps()[-1]["epoch"]
    with attacker([sys.executable, str(Path(__file__).resolve()), "--attacker", "early", "--target", job.peers[0],
                   "--key", str(job.key), "--first-step", str(first), "--count", "2000", "--numel", "62500",
                   "--epoch", str(epoch)]) as early:
        report = finish(early, 120)
    res.figures.append(f"rank 0 at step {step}; key holder as rank 1 {report}")
    if not report.get("proven"):
        res.misses.append(f"the early-data attacker did not get in, nothing was tested: {report}")


def attack_unfinished(job: Job, res: Result) -> None:
    with attacker([sys.executable, str(Path(__file__).resolve()), "--attacker", "unfinished", "--target",
                   job.peers[0], "--key", str(job.key), "--first-rank", "1000", "--count", "4", "--announce-mib",
                   "255", "--payload-mib", "200", "--hold", "4"]) as holder:
        report = finish(holder, 180)
    res.figures.append(f"key holder as ranks 1000-1003 {report}")


def attack_impostor(job: Job, res: Result) -> None:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--attacker", "impostor", "--target", job.peers[0],
           "--key", str(job.key), "--seconds", "6", "--hold", "3"]
    if job.tls_dir is not None:
        cmd += ["--tls-dir", str(job.tls_dir), "--cert-rank", str(EXTRA_CERT_RANK)]
    with attacker(cmd) as impostor:
        report = finish(impostor, 120)
    who = f"key + certificate of rank {EXTRA_CERT_RANK}" if job.tls_dir is not None else "key"
    res.figures.append(f"impostor ({who}) as rank 1 {report}")
    if job.tls_dir is not None and report.get("proven", 1):
        res.misses.append(f"with TLS the impostor was taken for rank 1 {report.get('proven')} times")
    if job.tls_dir is not None:
        no_cert = [*cmd[:cmd.index("--cert-rank")], "--seconds", "1"]
        with attacker(no_cert) as bare:
            report = finish(bare, 60)
        res.figures.append(f"key without certificate {report}")
        if report.get("proven", 1):
            res.misses.append(f"with TLS a key holder without certificate got in {report.get('proven')} times")


def attack_forged_state(res: Result) -> None:
    from tests.test_state_forged import PEAK

    proc = subprocess.run([sys.executable, "-c", PEAK, str(ROOT)], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        res.misses.append(f"the decode process failed: {proc.stderr.strip()[-300:]}")
        res.line = f"{res.name:<18} decode process failed"
        return
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    vm, rss = report["vm_peak_mb"], report["max_rss_mb"]
    kinds = [e.split(":", 1)[0] for e in report["errors"]]
    res.line = (f"{res.name:<18} 2^27 float32 declared (16-byte entry; no bytes): {kinds}; VmPeak {vm[0]} -> "
                f"{vm[1]} MiB ({vm[1] - vm[0]:+d}), max RSS {rss[0]} -> {rss[1]} MiB ({rss[1] - rss[0]:+d}); "
                f"{report['errors'][-1][:110]}")
    if any(k != "StateError" for k in kinds):
        res.misses.append(f"decode raised {kinds}, not StateError")
    if vm[1] - vm[0] > PEAK_MB or rss[1] - rss[0] > PEAK_MB:
        res.misses.append(f"decoding grew the peak by {vm[1] - vm[0]} MiB address space, {rss[1] - rss[0]} MiB RSS")


ATTACKS: list[tuple[str, bool, Attack | None, bool]] = [  # name, TLS, attack, documented only
    ("1-tls-flood", True, attack_tls_flood, False),
    ("2-slow-http", False, attack_slow_http, False),
    ("3-silent-joiner", False, attack_silent_joiner, False),
    ("4-early-data", False, attack_early_data, False),
    ("4-unfinished", False, attack_unfinished, False),
    ("5-impostor-tls", True, attack_impostor, False),
    ("5-impostor-key", False, attack_impostor, True),
    ("6-forged-state", False, None, False),
]


def fmt_list(xs: list[float]) -> str:
    return "[" + ", ".join(f"{x:.3f}" for x in xs) + "]"


def evicted_text(evicted: dict[int, list[int]]) -> str:
    if not any(evicted.values()):
        return "none"
    return ", ".join(f"r{r} evicted {sorted(e)}" for r, e in evicted.items() if e)


def max_deadline(job: Job, t0: float, t1: float) -> float:
    """The largest node deadline any member held in [t0, t1] (it adapts to the machine's load)."""
    held = [s["deadline_s"] for w in job.workers for s in w.steps() if t0 <= s["t1"] <= t1 and s["deadline_s"]]
    return max(held, default=1.0)


def run_attack(name: str, tls: bool, attack: Attack, documented: bool, args: argparse.Namespace) -> Result:
    res = Result(name, documented=documented)
    with tempfile.TemporaryDirectory(prefix=f"fttree-replay-{name}-") as tmp_s:
        job = Job(Path(tmp_s), tls, args)
        sampler: Sampler | None = None
        try:
            job.start()
            sampler = Sampler({w.rank: w.proc.pid for w in job.workers})
            t_start = time.time()
            if not job.wait_steps(20, t_start, 120):
                raise RuntimeError("the job did not run 20 steps within 120 s")
            time.sleep(1.0)
            base0 = time.time()
            time.sleep(2.0)
            a0 = time.time()
            load0 = os.getloadavg()[0]
            attack(job, res)
            a1 = time.time()
            if not job.wait_steps(5, a1, 60):
                res.misses.append("the job did not run 5 steps within 60 s after the attack")
            while time.time() < a1 + args.settle:
                time.sleep(0.05)
            after0 = time.time()
            time.sleep(1.0)
            after1 = time.time()
            load1 = os.getloadavg()[0]
            sampler.stop.set()
            counts = status_counts(job.ready[0]["http"])
            job.stop()
            summarize(job, res, sampler, base0, a0, a1, after0, after1)
            res.figures.append(f"rank 0's /status afterwards: {counts}")
            res.figures.append(f"load {load0:.2f} -> {load1:.2f}")
        except Exception as exc:
            res.misses.append(f"the replay broke: {type(exc).__name__}: {exc}")
            res.line = res.line or f"{name:<18} (replay broke: {exc})"
        finally:
            if sampler is not None:
                sampler.stop.set()
            try:
                job.stop()
            finally:
                job.kill()
        logs = [(Path(tmp_s) / f"worker-{r}.log").read_text() for r in MEMBERS if (Path(tmp_s) /
                                                                                    f"worker-{r}.log").exists()]
        if args.keep_logs:
            keep = Path(tempfile.mkdtemp(prefix=f"fttree-replay-logs-{name}-"))
            for r, text in enumerate(logs):
                (keep / f"worker-{r}.log").write_text(text)
            res.figures.append(f"worker logs in {keep}")
    return res


def summarize(job: Job, res: Result, sampler: Sampler, base0: float, a0: float, a1: float, after0: float,
              after1: float) -> None:
    steps = [(w.rank, s) for w in job.workers for s in w.steps() if s["t0"] >= base0 and s["t1"] <= after1]
    bad = [(r, s) for r, s in steps if not s["exact"] or not set(MEMBERS) <= set(s["ranks"])]
    stalls = [(r, s) for r, s in steps if s["deadline_s"] and s["duration_s"] > s["deadline_s"]]
    slowest = max((s["duration_s"] for _, s in steps), default=0.0)
    views = [(w.rank, rec) for w in job.workers for rec in w.records if "view" in rec and base0 <= rec["t"] <= after1]
    members_out = sorted({m for _, v in views for m in MEMBERS if m not in v["view"]})
    # rank -> the ranks it had evicted by its last step in the window (not those at the job's stop,
    # where the workers close one by one and a rank still running may evict one that closed)
    evicted: dict[int, list[int]] = {
        w.rank: next((s["evicted"] for s in reversed(w.steps()) if s["t1"] <= after1), []) for w in job.workers}
    rss = []
    for w in job.workers:
        base = sampler.between(w.rank, base0, a0)
        peak = sampler.between(w.rank, a0, after1)
        after = sampler.between(w.rank, after0, after1)
        if not base or not peak or not after:
            res.misses.append(f"rank {w.rank}: no RSS samples")
            continue
        b, p, af = statistics.median(base), max(peak), statistics.median(after)
        rss.append(f"r{w.rank} {b:.0f}/{p:.0f}/{af:.0f} ({p - b:+.0f}/{af - b:+.0f})")
        if p - b > PEAK_MB:
            res.misses.append(f"rank {w.rank}'s RSS peaked {p - b:+.0f} MB above its baseline (target +{PEAK_MB:g})")
        if af - b > AFTER_MB:
            res.misses.append(f"rank {w.rank}'s RSS was {af - b:+.0f} MB above its baseline after the attack "
                              f"(target +{AFTER_MB:g})")
    deadline = max((s["deadline_s"] or 0 for _, s in steps), default=0.0)
    first_bad = ""
    if bad:
        r, s = bad[0]
        first_bad = f", first bad: rank {r} step {s['step']} ranks {s['ranks']} {s['error'][:120]!r}"
    res.line = (f"{res.name:<18} exact {'yes' if not bad else 'NO'} ({len(steps) - len(bad)}/{len(steps)} steps"
                f"{first_bad})"
                f"  evictions {sum(map(len, evicted.values()))} ({evicted_text(evicted)}; members out: "
                f"{members_out or 'none'})"
                f"  stalls>deadline {len(stalls)} (slowest {slowest:.3f} s, deadline <= {deadline:.2f} s)"
                f"  RSS MB base/peak/after {'; '.join(rss)}"
                f"  attack {a1 - a0:.1f} s")
    if bad:
        res.misses.append(f"{len(bad)} of {len(steps)} steps not exact with every member")
    if members_out:
        res.misses.append(f"members {members_out} left the view")
    if stalls and res.name != "3-silent-joiner":
        res.misses.append(f"{len(stalls)} steps longer than the node deadline (slowest {slowest:.3f} s)")
    if len(steps) < 3 * 5:
        res.misses.append(f"only {len(steps)} steps in all")


def driver_main(args: argparse.Namespace) -> int:
    chosen = [a for a in ATTACKS if args.only is None or a[0] == args.only or a[0].startswith(args.only + "-")]
    if not chosen:
        print(f"no attack named {args.only!r}: {[a[0] for a in ATTACKS]}", file=sys.stderr)
        return 2
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "fttree"], capture_output=True,
                           text=True)
    print(f"attack replay at {head.stdout.strip()}{' (fttree/ modified in the work tree)' if dirty.stdout else ''}, "
          f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, load {os.getloadavg()[0]:.2f}, "
          f"{os.cpu_count()} CPUs; steps of {args.size} float32, {args.gap:g} s apart; 'after' {args.settle:g} s "
          f"after the attack; MB = 10^6 bytes", flush=True)
    results = []
    for name, tls, attack, documented in chosen:
        if attack is None:
            res = Result(name)
            attack_forged_state(res)
        else:
            res = run_attack(name, tls, attack, documented, args)
        results.append(res)
        print(res.line, flush=True)
        for fig in res.figures:
            print(f"{'':<18}   {fig}", flush=True)
        for miss in res.misses:
            print(f"{'':<18}   {'(documented, not a target) ' if res.documented else ''}MISSED: {miss}", flush=True)
    failed = [f"{r.name}: {m}" for r in results if not r.documented for m in r.misses]
    if failed:
        print("replay FAILED: " + "; ".join(failed), flush=True)
        return 1
    print("replay ok", flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="one attack (a name, or its number: 4 runs both of 4)")
    ap.add_argument("--size", type=int, default=2048, help="float32 elements a step (small: one control frame)")
    ap.add_argument("--gap", type=float, default=0.02, help="seconds between a worker's steps")
    ap.add_argument("--settle", type=float, default=2.0, help="seconds after the attack before the 1 s 'after' window")
    ap.add_argument("--early-ahead", type=int, default=1000, help="4-early-data: its first step, ahead of rank 0's")
    ap.add_argument("--keep-logs", action="store_true", help="keep the workers' logs (their stderr)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--joiner", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--attacker", choices=["early", "unfinished", "impostor"], help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--peers", help=argparse.SUPPRESS)
    ap.add_argument("--key", help=argparse.SUPPRESS)
    ap.add_argument("--tls-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--nofile", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    ap.add_argument("--contact", help=argparse.SUPPRESS)
    ap.add_argument("--target", help=argparse.SUPPRESS)
    ap.add_argument("--first-step", type=int, default=1000, help=argparse.SUPPRESS)
    ap.add_argument("--epoch", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--count", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--numel", type=int, default=62500, help=argparse.SUPPRESS)
    ap.add_argument("--first-rank", type=int, default=1000, help=argparse.SUPPRESS)
    ap.add_argument("--announce-mib", type=int, default=255, help=argparse.SUPPRESS)
    ap.add_argument("--payload-mib", type=int, default=200, help=argparse.SUPPRESS)
    ap.add_argument("--hold", type=float, default=4.0, help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=6.0, help=argparse.SUPPRESS)
    ap.add_argument("--cert-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker_main(args)
    if args.joiner:
        return joiner_main(args)
    if args.attacker:
        return attacker_main(args)
    return driver_main(args)


if __name__ == "__main__":
    sys.exit(main())
