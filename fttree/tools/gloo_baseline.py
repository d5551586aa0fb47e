"""The baseline of `fttree bench`: torch.distributed's gloo all_reduce on the same tensor.

One process per rank, like the fttree workers, with the same checked payload and the same
records (see bench_worker.py), so both sides pay the same work outside the timed region:

    python -m fttree.tools.gloo_baseline --rank R --world N --port P --steps K --size ELEMENTS

Gloo's CPU allreduce is a ring: each rank sends and receives 2(N-1)/N of the tensor, which is
what a tree (the root moves 2x the tensor each way) loses to on large tensors.

With --bind ADDR (rank r: 127.0.0.(r+1), as fttree's workers) every byte this rank sends
leaves from ADDR, so that netem/uplink.sh, which limits each rank by source address, limits
gloo exactly as it limits fttree. Two parts do that: the gloo device is created for ADDR
(ProcessGroupGloo.create_device(hostname=ADDR): its listener, hence the connections peers
open to it), and the connections this rank opens itself (to lower-addressed peers and to the
TCP store), which gloo never binds, are bound by a connect() wrapper loaded with LD_PRELOAD
(bindshim.py; the process re-executes itself once to load it). After the group is up the
rank checks its own established connections and fails if one leaves from another address.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from ..errors import ConfigError
from .bench_worker import Payload, emit, wait_for_release
from .bindshim import BIND_ENV, bound_env, shim_active, tcp_sources

BOUND_BACKEND = "fttree_gloo_bound"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fttree.tools.gloo_baseline", description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True, help="TCP store port on --host")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--size", type=int, required=True, help="float32 elements")
    p.add_argument("--startup-timeout", type=float, default=120.0)
    p.add_argument("--bind", metavar="ADDR", default=None,
                   help="send everything from this local IPv4 address (rank r: 127.0.0.(r+1))")
    args = p.parse_args(argv)
    if args.bind is not None:
        try:
            socket.inet_aton(args.bind)
            ok = args.bind.count(".") == 3
        except OSError:
            ok = False
        if not ok:
            p.error(f"--bind needs an IPv4 address like 127.0.0.2, got {args.bind!r}")
    return args


def register_bound_gloo(addr: str) -> str:
    """Register (once per process) a backend that is gloo with its device on `addr`;
    returns its name for init_process_group. The collectives are gloo's own: this only
    picks the device that torch's gloo backend would otherwise derive from GLOO_SOCKET_IFNAME
    or the hostname."""
    import torch.distributed as dist

    # torch's stubs call them Options/devices; the classes its own tests use are _Options/_devices.
    gloo: Any = dist.ProcessGroupGloo

    def create(store: Any, rank: int, size: int, timeout: timedelta) -> Any:
        opts = gloo._Options()
        opts._timeout = timeout
        opts._devices = [gloo.create_device(hostname=addr)]
        return gloo(store, rank, size, opts)

    if BOUND_BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BOUND_BACKEND, create, devices=["cpu"])
    return BOUND_BACKEND


def reexec_with_shim(addr: str) -> None:
    """Replace this process by itself with the connect() wrapper loaded (does not return)."""
    env = bound_env(addr)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.bind is not None and not shim_active(args.bind):
        if argv is not None:  # called in-process: re-executing would replace the caller
            print(f"gloo rank {args.rank}: --bind works only when run as a program "
                  f"(python -m fttree.tools.gloo_baseline ...)", file=sys.stderr)
            return 2
        if os.environ.get(BIND_ENV) == args.bind:  # re-executed already: the preload did not take
            print(f"gloo rank {args.rank}: --bind {args.bind}: the connect() wrapper did not load "
                  f"(LD_PRELOAD={os.environ.get('LD_PRELOAD', '')!r})", file=sys.stderr)
            return 2
        try:
            reexec_with_shim(args.bind)
        except (ConfigError, OSError) as exc:
            print(f"gloo rank {args.rank}: --bind {args.bind}: {exc}", file=sys.stderr)
            return 2
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # one core per worker, as in the thesis
    backend = "gloo" if args.bind is None else register_bound_gloo(args.bind)
    try:
        dist.init_process_group(backend, init_method=f"tcp://{args.host}:{args.port}", rank=args.rank,
                                world_size=args.world, timeout=timedelta(seconds=args.startup_timeout))
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"gloo rank {args.rank}: init_process_group on {args.host}:{args.port} failed: {exc}", file=sys.stderr)
        return 1
    if args.bind is not None:
        # gloo has connected the full mesh inside init_process_group (unless TORCH_GLOO_LAZY_INIT).
        stray = tcp_sources() - {args.bind}
        if stray:
            print(f"gloo rank {args.rank}: --bind {args.bind}, but connections leave from {sorted(stray)}",
                  file=sys.stderr)
            dist.destroy_process_group()
            return 1
    payload = Payload(args.rank, args.world, args.size)
    tensor = torch.from_numpy(payload.buf)  # shares memory: fill() writes the tensor in place
    emit({"kind": "ready", "rank": args.rank, "at": time.monotonic()})
    failed = False
    try:
        for step in range(args.steps):
            payload.fill(step)
            error, exact = "", False
            cpu, start = time.process_time(), time.monotonic()
            try:
                dist.all_reduce(tensor)
            except RuntimeError as exc:
                error = f"gloo all_reduce failed: {exc}"
            end, cpu = time.monotonic(), time.process_time() - cpu
            if not error:
                exact = payload.check(payload.buf, step)
            failed |= not exact
            emit({"kind": "step", "rank": args.rank, "step": step, "start": start, "end": end,
                  "duration_s": end - start, "cpu_s": cpu, "exact": exact, "error": error, "events": []})
        emit({"kind": "done", "rank": args.rank})
        wait_for_release()
    finally:
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
