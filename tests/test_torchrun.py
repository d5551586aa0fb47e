"""torchrun across hosts: addresses exchanged through the rendezvous store, a cut link, a killed worker.

Two "hosts" are two network namespaces joined by a veth pair (10.231.0.1 and 10.231.0.2), so
each has its own interfaces, routing table and firewall, as separate machines would. One
torchrun is started inside each; they meet through torchrun's c10d rendezvous on host A.
Tests need root (namespaces, iptables) and skip with the reason otherwise; every namespace is
deleted (with its rules and veth) and every process in it ended by pid, even when a test fails.
"""

from __future__ import annotations

import itertools
import socket
import textwrap
from pathlib import Path
from typing import Any

import pytest

from fttree.errors import ConfigError, PeerError
from fttree.training import rendezvous as rdzv

ROOT = Path(__file__).resolve().parent.parent
NETEM = ROOT / "netem"
NS_PREFIX = "ftt-tr-"
DEADLINE_S = 120.0  # every wait below ends by then, whatever the workers do
_counter = itertools.count()

# The worker: a small model trained with DDP over the "fttree" backend (mode "backend") or
# with DistributedOptimizer over FTTreeAllreduce.from_env() (mode "env"). Every step also
# allreduces a float64 value whose exact sum the checker knows. Each rank writes what it saw
# to OUT/rank-R.json; FTT_GATE=K makes every rank wait before step K for the test (which cuts
# a link or kills a worker there) and FTT_RANK_HOSTS gives each local rank its own address.
WORKER = textwrap.dedent('''
    import json, os, sys, time
    from pathlib import Path
from typing import Any

    rank_hosts = os.environ.get("FTT_RANK_HOSTS")
    if rank_hosts:
        os.environ["FTTREE_HOST"] = rank_hosts.split(",")[int(os.environ["LOCAL_RANK"])]
    import torch
    import torch.distributed as dist
    import fttree
    from fttree.tools.realfaults import StepGate

    out, mode = Path(os.environ["FTT_OUT"]), os.environ["FTT_MODE"]
    steps, gate_at = int(os.environ["FTT_STEPS"]), int(os.environ.get("FTT_GATE", "-1"))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    gen = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(steps, world * 4, 8, generator=gen), torch.randn(steps, world * 4, 4, generator=gen)
    if mode == "backend":
        dist.init_process_group("fttree")
        ar = fttree.allreduce_of()
        net = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        def exact(v):
            t = torch.tensor([v], dtype=torch.float64)
            dist.all_reduce(t)
            return float(t.item()), list(range(world))
    else:
        ar = fttree.FTTreeAllreduce.from_env(timeout_s=0.2, step_timeout_s=20).start()
        net = model
        opt = fttree.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model,
                                          allreduce=ar)
        def exact(v):
            r = ar.allreduce(torch.tensor([v], dtype=torch.float64))
            return float(r.item()), sorted(ar.last.contributors)
    info = {"rank": rank, "pid": os.getpid(), "peers": [str(p) for p in ar.peers], "sums": [], "contributors": []}
    (out / f"peers-{rank}.json").write_text(json.dumps(info))
    gate = StepGate(out, [gate_at], rank, timeout_s=60)
    for step in range(steps):
        gate(step)
        ar.mark_step(step)
        total, contributors = exact(float((rank + 1) * (step + 1)))
        info["sums"].append(total)
        info["contributors"].append(contributors)
        opt.zero_grad()
        part = slice(rank * 4, rank * 4 + 4)
        torch.nn.functional.mse_loss(net(xs[step, part]), ys[step, part]).backward()
        opt.step()
    info["params"] = [p.detach().double().reshape(-1).tolist() for p in model.parameters()]
    info["bits"] = [p.detach().numpy().tobytes().hex() for p in model.parameters()]
    (out / f"rank-{rank}.json").write_text(json.dumps(info))
    if mode == "backend":
        dist.destroy_process_group()
    else:
        fttree.training.optim.close_gracefully(ar)
''')


def single_process(steps: int, world: int) -> list[list[float]]:
    """The same model trained in one process on the concatenated batches."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    gen = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(steps, world * 4, 8, generator=gen), torch.randn(steps, world * 4, 4, generator=gen)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        opt.zero_grad()
        # The mean over world equal slices of a mean-reduced loss: what gradient averaging computes.
        loss = sum(torch.nn.functional.mse_loss(model(xs[step, r * 4:r * 4 + 4]), ys[step, r * 4:r * 4 + 4])
                   for r in range(world)) / world
        loss.backward()
        opt.step()
    return [p.detach().double().reshape(-1).tolist() for p in model.parameters()]


# ---- unit tests of the exchange (no root needed) -------------------------------------------


def _store(world: int, port: int = 0) -> Any:
    """A store server (port 0) or a client of the one on `port`: one client per thread, as
    one per process in a real job (a client blocked in wait() holds its connection)."""
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", port, world, is_master=port == 0, wait_for_workers=False)


def test_exchange_returns_every_rank_in_rank_order() -> None:
    import threading

    server = _store(3)
    got: dict[int, list[str]] = {}

    def run(rank: int) -> None:
        store = _store(3, server.port)
        got[rank] = [str(a) for a in rdzv.exchange(store, rank, 3, f"10.0.0.{rank + 1}:{7000 + rank}", 10.0)]

    threads = [threading.Thread(target=run, args=(r,)) for r in (2, 0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=DEADLINE_S)
    want = ["10.0.0.1:7000", "10.0.0.2:7001", "10.0.0.3:7002"]
    assert got == {0: want, 1: want, 2: want}


def test_exchange_deadline_names_the_missing_ranks() -> None:
    store = _store(4)
    store.set("fttree/peer/2", "10.0.0.3:7002")
    with pytest.raises(PeerError, match=r"rank 0: no address from rank\(s\) \[1, 3\] of 4 .* after 0.3 s"):
        rdzv.exchange(store, 0, 4, "10.0.0.1:7000", 0.3)


def test_local_host_prefers_fttree_host_then_the_route_to_the_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FTTREE_HOST", "10.9.8.7")
    assert rdzv.local_host("192.0.2.1", 29500) == "10.9.8.7"
    monkeypatch.delenv("FTTREE_HOST")
    assert rdzv.local_host("127.0.0.5", 29500) == "127.0.0.1"  # a one-machine job
    assert rdzv.local_host("localhost", 29500) == "127.0.0.1"


def test_pick_port_uses_fttree_port_plus_local_rank_or_names_a_bad_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FTTREE_PORT", "31000")
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert rdzv.pick_port("127.0.0.1") == 31002
    monkeypatch.setenv("FTTREE_PORT", "abc")
    with pytest.raises(ConfigError, match="FTTREE_PORT must be a port number"):
        rdzv.pick_port("127.0.0.1")
    monkeypatch.delenv("FTTREE_PORT")
    monkeypatch.setenv("FTTREE_HOST", "192.0.2.77")  # TEST-NET: not an address of this machine
    with pytest.raises(ConfigError, match=r"cannot bind to 192.0.2.77 \(FTTREE_HOST\)"):
        rdzv.pick_port("192.0.2.77")


def test_from_env_exchanges_through_a_store_rank0_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without torchrun's agent, rank 0 hosts the store (as env:// does) and stays up until all read."""
    import threading

    from fttree.api import FTTreeAllreduce

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for k in ("FTTREE_PEERS", "FTTREE_RANK", "FTTREE_HOST", "FTTREE_PORT", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(k, raising=False)
    got: dict[int, list[str]] = {}

    def run(rank: int) -> None:
        peers = rdzv.peers_from_env_store(rank, 3, 20.0)
        got[rank] = [str(p) for p in peers]

    threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=DEADLINE_S)
    assert len(got) == 3
    assert got[0] == got[1] == got[2]
    assert all(p.startswith("127.0.0.1:") for p in got[0])
    assert len(set(got[0])) == 3
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "")
    monkeypatch.setenv("FTTREE_BASE_PORT", "31100")
    ar = FTTreeAllreduce.from_env()  # no store named: the one-machine fallback
    assert [str(p) for p in ar.peers] == ["127.0.0.1:31100", "127.0.0.1:31101", "127.0.0.1:31102"]
