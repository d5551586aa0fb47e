"""State from peers, in real processes: how long restarted workers take to get their state
from several donors, and what a dead or lying donor costs them.

    python -m fttree.tools.bench_peers -n 4 --state-mb 32 [--joiners 3] [--max-donors 1]

n worker processes (FTTreeAllreduce over TCP on 127.0.0.x, one torch thread each) train the
thesis's MLP with `--state-mb` MB of registered extra state (a deterministic tensor), so the
training state is that large. The last `--joiners` ranks are killed at step CRASH_AT and started
again together when rank 0 reaches START_AT; each prints, once synced, its transfer's seconds,
donors and pieces, its timeline (first manifest, first and last piece, digest checked, decoded,
loaded) and the bytes it received while syncing, pieces and the steps' traffic.
`--die-after K` makes rank 0 SIGKILL itself (by its own pid) after sending K pieces; `--forge`
makes rank 1 flip a byte of every piece it sends. The last line is the figures. Behind a rate
limit, run it under netem/uplink.sh (and netem/downlink.sh). A restarted worker that never
synced gets its stderr's last lines printed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ..net.address import local_peers

CRASH_AT = 5
START_AT = 12
WAIT_S = 600.0  # a whole run's deadline
LOG_TAIL = 30  # lines of a worker's stderr printed when it never synced


def _worker(rank: int, peers: list[str], steps: int, crash_at: int | None, state_mb: float, max_donors: int | None,
            die_after: int | None, forge: bool, joiners: int) -> None:
    """One worker process: a JSON line per training step on stdout, and one once synced."""
    import hashlib
    import os
    import signal
    import time

    import torch

    from ..api import FTTreeAllreduce
    from ..core.messages import Kind, State
    from ..errors import GroupLeft
    from ..training.optim import DistributedOptimizer

    torch.set_num_threads(1)

    def say(**record: Any) -> None:
        print(json.dumps(record), flush=True)

    ar = FTTreeAllreduce(rank, peers, timeout_s=0.2, step_timeout_s=15).start()
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model, allreduce=ar)
        ballast = (torch.arange(int(state_mb * (1 << 20) / 4), dtype=torch.float32) % 997) / 997
        def set_ballast(v: torch.Tensor) -> None:
            ballast.copy_(v)

        opt.register_state("ballast", lambda: ballast, set_ballast)
        transfer = opt.transfer
        if max_donors is not None:  # alike on every worker: a donor works out whether a joiner will ask it
            transfer.max_donors = max_donors
        send_piece = transfer._send_piece
        if die_after is not None:
            def send_then_die(msg: State) -> None:
                if transfer.pieces_sent >= die_after:
                    say(dying=transfer.pieces_sent)
                    os.kill(os.getpid(), signal.SIGKILL)
                send_piece(msg)
            transfer._send_piece = send_then_die  # type: ignore[method-assign]
        if forge:
            real_send = ar.send_frame

            def forged(dst: int, msg: Any) -> None:
                if isinstance(msg, State) and msg.kind is Kind.STATE and msg.piece >= 0 and msg.payload is not None:
                    data = bytearray(bytes(msg.payload))
                    data[0] ^= 1
                    msg = State(kind=Kind.STATE, src=msg.src, user_step=msg.user_step, piece=msg.piece,
                                pieces=msg.pieces, digest=msg.digest, numel=len(data), payload=bytes(data))
                real_send(dst, msg)
            ar.send_frame = forged  # type: ignore[method-assign]
        gen = torch.Generator().manual_seed(rank)
        synced = not ar.joining
        started = time.time()
        step: int | None = None
        synced_for = 0
        syncing_from: tuple[int, int] | None = None  # (step, bytes received by then) at the first syncing step

        def received() -> int:
            """Bytes this worker has read from every link (frames of every kind)."""
            tcp = ar.transport.inner if ar.transport is not None else None
            return sum(st.bytes_received for st in list(getattr(tcp, "stats", {}).values()))

        while step is None or step < steps:
            if crash_at is not None and step == crash_at:
                ar.crash("bench: killed")
            x, y = torch.randn(100, 784, generator=gen), torch.randint(0, 10, (100,), generator=gen)
            opt.zero_grad()
            torch.autograd.backward(torch.nn.functional.cross_entropy(model(x), y))
            opt.step()
            done = opt.sync.rounds - 1
            say(step=done, syncing=opt.syncing)
            if opt.syncing and syncing_from is None:
                syncing_from = (done, received())
            if not synced and not opt.syncing:
                synced = True
                rec = transfer.record
                if rec is not None:
                    first, rx = syncing_from if syncing_from is not None else (done, received())
                    say(synced=done, since_start=time.time() - started, seconds=rec.seconds, nbytes=rec.nbytes,
                        pieces={str(d): n for d, n in rec.pieces.items()}, refetched=rec.refetched,
                        as_of=rec.user_step, dropped=sum(transfer.dropped.values()), replayed=rec.replayed,
                        manifest_s=rec.manifest_s, first_piece_s=rec.first_piece_s, all_pieces_s=rec.all_pieces_s,
                        checked_s=rec.checked_s,
                        piece_bytes=rec.piece_bytes, steps_syncing=done - first, rx_syncing=received() - rx,
                        loaded_s=time.monotonic() - transfer._started_at)
            # every worker learns the same count of synced joiners, so all stop at the same step
            flag = torch.tensor([1.0 if (ar.joined_at is not None and not opt.syncing) else 0.0])
            synced_for = synced_for + 1 if float(ar.allreduce(flag)[0]) >= joiners else 0
            step = done + 1
            if synced_for >= 8:
                break
        digest = hashlib.blake2b(b"".join(p.detach().numpy().tobytes() for p in model.parameters()),
                                 digest_size=16).hexdigest()
        say(final=step, model=digest, pieces_sent=transfer.pieces_sent)
    except GroupLeft:
        pass
    finally:
        ar.close()


@dataclass
class Seen:
    """What one worker process printed."""

    steps: int = -1
    events: dict[str, Any] = field(default_factory=dict)
    reached: dict[int, threading.Event] = field(default_factory=dict)


def spawn(rank: int, peers: list[str], steps: int, seen: Seen, args: list[str], stderr: Any = subprocess.DEVNULL
          ) -> tuple[subprocess.Popen[str],
                                                                                          threading.Thread]:
    """Start a worker process and a thread reading its lines into `seen`."""
    cmd = [sys.executable, "-m", "fttree.tools.bench_peers", "--worker", str(rank), "--peers", ",".join(peers),
           "--steps", str(steps), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True)

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if "step" in rec:
                seen.steps = rec["step"]
                for at, event in seen.reached.items():
                    if rec["step"] >= at:
                        event.set()
            else:
                seen.events.update(rec)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return proc, thread


@dataclass
class Outcome:
    """A run's processes' output and exit codes, by rank (`rejoined`: the restarted ones)."""

    members: dict[int, Seen]
    rejoined: dict[int, Seen]
    codes: dict[int, int]


def _exit_code(proc: subprocess.Popen[str], what: str) -> int:
    """`proc`'s exit status, waited for up to WAIT_S; TimeoutError saying `what` after that."""
    try:
        return proc.wait(WAIT_S)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"{what} within {WAIT_S:.0f} s") from None


def run(n: int, steps: int, *, state_mb: float, joiners: int = 1, max_donors: int | None = None,
        die_after: int | None = None, forge: bool = False, port: int = 29500, logs: Path | None = None) -> Outcome:
    """Start n workers, kill the last `joiners` at CRASH_AT and restart them together at
    START_AT; rank 0 dies after `die_after` pieces, rank 1 forges its pieces. Each process's
    stderr goes to `logs`/rank-R.log (a restarted one's to rank-R-rejoined.log), if given."""
    files: list[IO[str]] = []

    def log_of(name: str) -> Any:
        if logs is None:
            return subprocess.DEVNULL
        files.append((logs / f"{name}.log").open("w"))
        return files[-1]

    peers = local_peers(n, port=port)
    base = ["--state-mb", str(state_mb), "--joiners", str(joiners)]
    if max_donors is not None:
        base += ["--max-donors", str(max_donors)]
    members = {r: Seen() for r in range(n)}
    rejoined = {r: Seen() for r in range(n - joiners, n)}
    start = threading.Event()
    members[0].reached[START_AT] = start
    procs: dict[int, subprocess.Popen[str]] = {}
    threads: list[threading.Thread] = []
    try:
        for r in range(n):
            extra = list(base)
            if r >= n - joiners:
                extra += ["--crash-at", str(CRASH_AT)]
            if r == 0 and die_after is not None:
                extra += ["--die-after", str(die_after)]
            if r == 1 and forge:
                extra += ["--forge"]
            procs[r], t = spawn(r, peers, steps, members[r], extra, stderr=log_of(f"rank-{r}"))
            threads.append(t)
        deadline = time.monotonic() + WAIT_S
        while not start.wait(1.0):  # in slices: a worker that died ends the wait at once
            dead = {r: p.returncode for r, p in procs.items() if p.poll() is not None and r < n - joiners}
            if dead:
                raise RuntimeError(f"members {sorted(dead)} exited (codes {dead}) before rank 0 reached step "
                                   f"{START_AT}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 did not reach step {START_AT} within {WAIT_S:.0f}s (it is at step "
                                   f"{members[0].steps})")
        for r in range(n - joiners, n):
            _exit_code(procs[r], f"rank {r} did not exit after its crash at step {CRASH_AT}")
            procs[r], t = spawn(r, peers, steps, rejoined[r], base, stderr=log_of(f"rank-{r}-rejoined"))
            threads.append(t)
        codes = {r: _exit_code(p, f"rank {r} did not exit after its last step") for r, p in procs.items()}
        for t in threads:
            t.join(WAIT_S)
        return Outcome(members=members, rejoined=rejoined, codes=codes)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in files:
            f.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fttree.tools.bench_peers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2000, help="at most; the run ends once the joiners synced")
    parser.add_argument("--port", type=int, default=29500)
    parser.add_argument("--state-mb", type=float, default=32.0)
    parser.add_argument("--joiners", type=int, default=1)
    parser.add_argument("--max-donors", type=int, default=None,
                        help="donors a joiner asks at most (default: fttree.training.elastic.MAX_DONORS)")
    parser.add_argument("--die-after", type=int, default=None)
    parser.add_argument("--forge", action="store_true")
    parser.add_argument("--logs", type=Path, default=None,
                        help="a directory for every process's stderr (default: a temporary one, whose restarted "
                             "workers' last lines are printed if they never synced)")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--peers", default="", help=argparse.SUPPRESS)
    parser.add_argument("--crash-at", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        _worker(args.worker, args.peers.split(","), args.steps, args.crash_at, args.state_mb, args.max_donors,
                args.die_after, args.forge, args.joiners)
        return
    if not 0 < args.joiners < args.workers:
        parser.error(f"--joiners must be between 1 and {args.workers - 1}, got {args.joiners}")
    if 2 * args.joiners >= args.workers:
        parser.error(f"--joiners {args.joiners} of {args.workers} workers: the survivors of their crash would not be "
                     f"a majority, and a group without one stops; use at least {2 * args.joiners + 1} workers")
    with tempfile.TemporaryDirectory(prefix="bench_peers-") as tmp:
        logs = args.logs if args.logs is not None else Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        out = run(args.workers, args.steps, state_mb=args.state_mb, joiners=args.joiners,
                  max_donors=args.max_donors, die_after=args.die_after, forge=args.forge, port=args.port, logs=logs)
        report(args, out, logs)


def report(args: argparse.Namespace, out: Outcome, logs: Path) -> None:
    """Print each restarted worker's transfer, or why it never synced (its stderr's tail)."""
    figures = []
    for r, seen in out.rejoined.items():
        ev = seen.events
        if "seconds" not in ev:
            print(f"rank {r} never synced (exit {out.codes.get(r)}); the last lines of its stderr:")
            tail = (logs / f"rank-{r}-rejoined.log").read_text(errors="replace").splitlines()[-LOG_TAIL:]
            print("\n".join(f"    {line}" for line in tail) or "    (empty)")
            continue
        print(f"rank {r}: {ev['nbytes'] / 1e6:.1f} MB in {ev['seconds']:.2f}s, pieces by donor {ev['pieces']}, "
              f"refetched {ev['refetched']}, dropped {ev['dropped']}")
        print(f"rank {r} timeline: first manifest {ev['manifest_s']:.2f}s, first piece {ev['first_piece_s']:.2f}s, "
              f"all pieces {ev['all_pieces_s']:.2f}s, "
              f"digest checked {ev['checked_s']:.2f}s, decoded {ev['seconds']:.2f}s, loaded and replayed "
              f"{ev['loaded_s']:.2f}s; while syncing "
              f"{ev['steps_syncing']} steps ({ev['replayed']} replayed), {ev['rx_syncing'] / 1e6:.1f} MB received, "
              f"{ev['piece_bytes'] / 1e6:.1f} MB of it pieces")
        figures.append(ev["seconds"])
    donors = args.max_donors or "default"
    print(f"state {args.state_mb} MB, {args.workers} workers, {args.joiners} joiners, max donors {donors}: "
          f"transfer seconds {' '.join(f'{s:.2f}' for s in figures)}")


if __name__ == "__main__":
    main()
