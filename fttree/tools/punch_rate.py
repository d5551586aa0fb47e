"""How often a TCP hole punch (net/holepunch.py) succeeds through Linux NAT.

Three namespaces' worth of hosts (netem/nat.sh): a public coordinator and two hosts behind
NATs of their own. Each attempt, both hosts bind a fresh port, dial the coordinator from it
(which sees the port's mapping: the connection's peer address), and are told the other's
mapped address and when to go; then each dials the other from its port until a connection
forms or the deadline passes, and a byte each way proves it carries data. The sockets only:
the authentication a worker adds on top (punch.py) changes nothing of whether the NATs let
the SYNs through.

    sudo python -m fttree.tools.punch_rate --attempts 20 --nat-ports keep
    sudo python -m fttree.tools.punch_rate --attempts 20 --nat-ports random-fully

Needs root (network namespaces, iptables); the network is removed on exit, whatever happens.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Sequence

from ..net.holepunch import reusable_socket, simultaneous_open
from .realfaults import nat_network, netem_dir

COORDINATOR_PORT = 33100
GO_AFTER_S = 0.2  # both hosts dial this long after the coordinator answers them
WAIT_S = 60.0  # for the coordinator, and for the other host to show up to an attempt
PUBLIC_HOST = "10.77.0.10"  # netem/nat.sh: rank 0, public


@dataclasses.dataclass(frozen=True, slots=True)
class Attempt:
    """One host's view of one attempt."""

    attempt: int
    ok: bool
    elapsed_s: float
    local_port: int
    mapped: str  # host:port the coordinator saw this host's port as
    peer: str  # host:port dialled
    why: str = ""


async def serve(port: int, attempts: int) -> None:
    """The coordinator: pairs the two hosts' probes of each attempt and tells each the other's
    mapped address."""
    waiting: dict[int, tuple[asyncio.StreamWriter, tuple[str, int]]] = {}
    done = asyncio.Event()
    answered = 0

    async def probe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal answered
        line = await asyncio.wait_for(reader.readline(), WAIT_S)
        attempt = int(line.split()[0])
        seen = writer.get_extra_info("peername")
        other = waiting.pop(attempt, None)
        if other is None:
            waiting[attempt] = (writer, (seen[0], seen[1]))
            return
        for w, mine, theirs in ((other[0], other[1], seen), (writer, seen, other[1])):
            w.write(f"{theirs[0]} {theirs[1]} {mine[0]} {mine[1]} {GO_AFTER_S}\n".encode())
            await w.drain()
            w.close()
        answered += 1
        if answered == attempts:
            done.set()

    server = await asyncio.start_server(probe, "0.0.0.0", port, reuse_address=True)
    print("up", flush=True)
    async with server:
        await asyncio.wait_for(done.wait(), WAIT_S * attempts)


async def _probe(coordinator: tuple[str, int], attempt: int) -> tuple[int, str, tuple[str, int], float]:
    """Bind a fresh port, show it to the coordinator: (port, our mapping, the peer's, delay)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while True:
        sock = reusable_socket("0.0.0.0", 0)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, coordinator), 5.0)
            break
        except OSError:  # the coordinator is not up yet
            sock.close()
            if loop.time() > deadline:
                raise TimeoutError(f"coordinator {coordinator} did not answer within {WAIT_S:g} s") from None
            await asyncio.sleep(0.1)
    port = sock.getsockname()[1]
    reader, writer = await asyncio.open_connection(sock=sock)
    writer.write(f"{attempt}\n".encode())
    line = (await asyncio.wait_for(reader.readline(), WAIT_S)).decode().split()
    writer.close()
    peer_host, peer_port, my_host, my_port, delay = line
    return port, f"{my_host}:{my_port}", (peer_host, int(peer_port)), float(delay)


async def client(coordinator: tuple[str, int], side: str, attempts: int, deadline_s: float) -> None:
    """One host behind a NAT: `attempts` punches, a JSON line each."""
    for attempt in range(attempts):
        port, mapped, peer, delay = await _probe(coordinator, attempt)
        await asyncio.sleep(delay)
        result = await simultaneous_open(("0.0.0.0", port), peer, deadline_s)
        why = result.why
        if result.sock is not None:
            reader, writer = await asyncio.open_connection(sock=result.sock)
            writer.write(side.encode())
            try:
                got = await asyncio.wait_for(reader.readexactly(1), deadline_s)
                if got == side.encode():
                    why = "connected to itself"
            except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
                why = f"connected, but no byte came back: {exc or type(exc).__name__}"
            writer.close()
        seen = Attempt(attempt, result.ok and not why, round(result.elapsed_s, 3), port, mapped,
                       f"{peer[0]}:{peer[1]}", why)
        print(json.dumps(dataclasses.asdict(seen)), flush=True)


def measure(attempts: int, nat_ports: str, deadline_s: float, name: str) -> list[tuple[Attempt, Attempt]]:
    """Build the network, run the coordinator and both hosts, and return each attempt as the
    two hosts saw it."""
    nat = str(netem_dir() / "nat.sh")
    me = [sys.executable, "-m", "fttree.tools.punch_rate"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    with nat_network([[1], [2]], 3, name=name, nat_ports=nat_ports) as net:
        coord = subprocess.Popen([nat, "exec", net, "0", "--", *me, "serve", "--attempts", str(attempts)],
                                 stdout=subprocess.PIPE, text=True, env=env)
        try:
            assert coord.stdout is not None
            if coord.stdout.readline().strip() != "up":
                raise RuntimeError("the coordinator did not start")
            hosts = [subprocess.Popen([nat, "exec", net, str(rank), "--", *me, "client", "--side", side,
                                       "--attempts", str(attempts), "--deadline", str(deadline_s)],
                                      stdout=subprocess.PIPE, text=True, env=env)
                     for rank, side in ((1, "a"), (2, "b"))]
            outs = [h.communicate(timeout=attempts * (deadline_s + WAIT_S))[0] for h in hosts]
            for h in hosts:
                if h.returncode:
                    raise RuntimeError(f"a host exited with status {h.returncode}")
        finally:
            coord.kill()
            coord.wait(timeout=30)
    a, b = ([Attempt(**json.loads(line)) for line in out.splitlines() if line.startswith("{")] for out in outs)
    return list(zip(a, b, strict=True))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fttree.tools.punch_rate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", nargs="?", default="measure", choices=["measure", "serve", "client"])
    parser.add_argument("--attempts", type=int, default=20)
    parser.add_argument("--nat-ports", default="keep", choices=["keep", "random", "random-fully"])
    parser.add_argument("--deadline", type=float, default=3.0, help="seconds each punch may take")
    parser.add_argument("--side", default="a")
    parser.add_argument("--name", default=f"punchrate{os.getpid()}", help="the namespaces' prefix")
    args = parser.parse_args(argv)
    if args.role == "serve":
        asyncio.run(serve(COORDINATOR_PORT, args.attempts))
        return
    if args.role == "client":
        asyncio.run(client((PUBLIC_HOST, COORDINATOR_PORT), args.side, args.attempts, args.deadline))
        return
    pairs = measure(args.attempts, args.nat_ports, args.deadline, args.name)
    for a, b in pairs:
        why = f" ({a.why or b.why})" if a.why or b.why else ""
        print(f"attempt {a.attempt}: {'ok' if a.ok and b.ok else 'failed'} in {max(a.elapsed_s, b.elapsed_s):.3f} "
              f"s; a {a.mapped} -> {a.peer}, b {b.mapped} -> {b.peer}{why}")
    ok = sum(1 for a, b in pairs if a.ok and b.ok)
    print(f"--nat-ports {args.nat_ports}: {ok}/{len(pairs)} punches connected")


if __name__ == "__main__":
    main()
