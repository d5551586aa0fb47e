"""Address exchange through torch.distributed's rendezvous store, so torchrun jobs span hosts.

fttree needs every rank's `host:port` before it starts, and torchrun knows only a store
(MASTER_ADDR:MASTER_PORT, or the store torch hands a backend). Each rank therefore picks its
own address, writes `rank -> host:port` into the store once, and reads everyone else's with a
deadline; a rank that never shows up is named in the error instead of a silent hang. After
that the store is not used again, so a store that later dies costs fttree nothing.

The address: FTTREE_HOST if set, else the local interface address that routes to the store
(a UDP connect() picks the route without sending a packet), else 127.0.0.1. The port:
FTTREE_PORT + LOCAL_RANK if FTTREE_PORT is set, else a free one.

torch is imported only inside the functions, so `import fttree.api` stays light.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
from datetime import timedelta
from typing import TYPE_CHECKING

from ..errors import ConfigError, PeerError
from .address import Address, parse_address
from .credentials import new_key

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

__all__ = ["env_value", "exchange", "job_key", "local_host", "peers_from_env_store", "pick_port",
           "rendezvous_from_env_store", "store_from_env"]


def env_value(name: str) -> str:
    """An environment variable, stripped ("" when unset)."""
    return os.environ.get(name, "").strip()


def local_host(master_addr: str | None = None, master_port: int | None = None) -> str:
    """This rank's address: FTTREE_HOST, else the interface that reaches the store.

    A loopback store address means a single-machine job: then 127.0.0.1 (the route to
    127.x.y.z would otherwise pick that very address and every rank would claim it).
    """
    if env_value("FTTREE_HOST"):
        return env_value("FTTREE_HOST")
    master = master_addr if master_addr is not None else env_value("MASTER_ADDR") or "127.0.0.1"
    try:
        if master == "localhost" or ipaddress.ip_address(master).is_loopback:
            return "127.0.0.1"
    except ValueError:
        pass  # a host name: let the resolver and the routing table answer
    port = master_port if master_port is not None else int(env_value("MASTER_PORT") or "29500")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, port))  # UDP: no packet is sent, the kernel only picks a route
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def pick_port(host: str) -> int:
    """FTTREE_PORT + LOCAL_RANK, else a port the kernel says is free on `host` now.

    The free port is released before fttree binds it, so another process could take it in
    between; the window is one address exchange long. Set FTTREE_PORT where that matters.
    """
    base = env_value("FTTREE_PORT")
    if base:
        if not base.isdigit():
            raise ConfigError(f"FTTREE_PORT must be a port number, got {base!r}")
        return int(base) + int(env_value("LOCAL_RANK") or "0")
    try:
        with socket.socket() as s:
            s.bind((host, 0))
            return int(s.getsockname()[1])
    except OSError as exc:
        where = "FTTREE_HOST" if env_value("FTTREE_HOST") else "the interface that reaches MASTER_ADDR"
        raise ConfigError(f"cannot bind to {host} ({where}): {exc}; set FTTREE_HOST to an address of "
                          f"this machine") from None


def exchange(store: Store, rank: int, world: int, address: str, timeout_s: float,
             prefix: str = "fttree/peer") -> list[Address]:
    """Publish `address` as `rank`'s and return every rank's, waiting at most `timeout_s`.

    Raises PeerError naming the ranks whose address never arrived (they did not start,
    crashed, or cannot reach the store).
    """
    me = parse_address(address)
    if rank == 0 and not env_value("FTTREE_AUTH_KEY_FILE"):  # the job's key, before rank 0's address
        store.set(f"{prefix}/job-key", new_key().decode())
    keys = [f"{prefix}/{r}" for r in range(world)]
    store.set(keys[rank], str(me))
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception as exc:  # torch raises DistStoreError / RuntimeError on timeout
        missing = [r for r, key in enumerate(keys) if not _has(store, key)]
        if not missing:
            raise PeerError(f"rank {rank}: reading peer addresses from the rendezvous store failed: {exc}") from None
        raise PeerError(f"rank {rank}: no address from rank(s) {missing} of {world} in the rendezvous store after "
                        f"{timeout_s:g} s (did they start, and can they reach MASTER_ADDR:MASTER_PORT?)") from None
    return [parse_address(store.get(key).decode()) for key in keys]


def job_key(store: Store, prefix: str = "fttree/peer") -> bytes | None:
    """The key rank 0 put in the store for this job (read after `exchange`, which it preceded),
    or None where FTTREE_AUTH_KEY_FILE names one. The store is torchrun's trust boundary
    already: whoever can write it can start the job's workers."""
    if env_value("FTTREE_AUTH_KEY_FILE"):
        return None
    return bytes(store.get(f"{prefix}/job-key"))


def _has(store: Store, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except Exception:
        return False


def store_from_env(rank: int, world: int, timeout_s: float) -> Store:
    """A client of the store at MASTER_ADDR:MASTER_PORT, as torch's env:// rendezvous makes it.

    Under torchrun's elastic agent (TORCHELASTIC_USE_AGENT_STORE=True) the agent hosts the
    store; otherwise rank 0 does (multi-tenant, so a later init_process_group shares it).
    """
    from torch._C._distributed_c10d import TCPStore

    addr, port = env_value("MASTER_ADDR"), env_value("MASTER_PORT")
    if not addr or not port.isdigit():
        raise ConfigError(f"MASTER_ADDR/MASTER_PORT must name the rendezvous store, got {addr!r}:{port!r}")
    agent = env_value("TORCHELASTIC_USE_AGENT_STORE") == "True"
    try:
        return TCPStore(addr, int(port), world, is_master=rank == 0 and not agent,
                        timeout=timedelta(seconds=timeout_s), wait_for_workers=False, multi_tenant=True)
    except Exception as exc:
        raise PeerError(f"rank {rank}: cannot reach the rendezvous store at {addr}:{port}: {exc}") from None


def peers_from_env_store(rank: int, world: int, timeout_s: float) -> list[Address]:
    """Every rank's address via the MASTER_ADDR store (`rendezvous_from_env_store`'s peers)."""
    return rendezvous_from_env_store(rank, world, timeout_s)[0]


def rendezvous_from_env_store(rank: int, world: int, timeout_s: float) -> tuple[list[Address], bytes | None]:
    """Every rank's address and the job's key via the MASTER_ADDR store (what
    `FTTreeAllreduce.from_env()` uses under torchrun). Keys carry torchrun's run id and restart
    count so a restarted round never reads the addresses of the round before."""
    store = store_from_env(rank, world, timeout_s)
    host = local_host()
    me = f"{host}:{pick_port(host)}"
    run = env_value("TORCHELASTIC_RUN_ID") or "none"
    prefix = f"fttree/{run}/{env_value('TORCHELASTIC_RESTART_COUNT') or '0'}"
    peers = exchange(store, rank, world, me, timeout_s, prefix=f"{prefix}/peer")
    key = job_key(store, prefix=f"{prefix}/peer")
    # Without an agent the store lives in rank 0's process: rank 0 keeps it up until every
    # rank has read (the last reader says so), so nobody is cut off mid-exchange.
    if store.add(f"{prefix}/read", 1) == world:
        store.set(f"{prefix}/all-read", "1")
    if rank == 0 and env_value("TORCHELASTIC_USE_AGENT_STORE") != "True":
        # A reader that never finishes fails on its own deadline, naming what it lacks.
        with contextlib.suppress(Exception):
            store.wait([f"{prefix}/all-read"], timedelta(seconds=timeout_s))
    return peers, key
