"""torchrun across hosts: addresses exchanged through the rendezvous store, a cut link, a killed worker.

Two "hosts" are two network namespaces joined by a veth pair (10.231.0.1 and 10.231.0.2), so
each has its own interfaces, routing table and firewall, as separate machines would. One
torchrun is started inside each; they meet through torchrun's c10d rendezvous on host A.
Tests need root (namespaces, iptables) and skip with the reason otherwise; every namespace is
deleted (with its rules and veth) and every process in it ended by pid, even when a test fails.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fttree.errors import ConfigError, PeerError
from fttree.net import rendezvous as rdzv

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
    info = {"rank": rank, "pid": os.getpid(), "peers": [str(p) for p in ar.peers], "sums": [], "contributors": [],
            "job": ar.credentials.job}  # the job id the store-provided key gives
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


# ---- two hosts in network namespaces (root) ------------------------------------------------


def sh(*cmd: str | Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=60, check=check)


def hosts_missing() -> str:
    """Why two-host tests cannot run here ('' when they can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth, iptables)"
    if shutil.which("ip") is None or shutil.which("iptables") is None:
        return "needs iproute2 and iptables"
    if shutil.which("torchrun") is None and not (Path(sys.executable).parent / "torchrun").exists():
        return "torchrun is not installed next to this python"
    return ""


def ns_pids(ns: str) -> list[int]:
    out = sh("ip", "netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split()]


def end_processes(ns: str) -> None:
    """SIGTERM everything this test started in `ns`, SIGKILL what is left after 5 s (an agent
    blocked in its store wait ignores SIGTERM)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in ns_pids(ns):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        end = time.monotonic() + 5
        while ns_pids(ns) and time.monotonic() < end:
            time.sleep(0.1)


def delete_hosts(names: list[str]) -> None:
    for ns in names:
        if ns in sh("ip", "netns", "list", check=False).stdout.split():
            end_processes(ns)
            sh("ip", "netns", "del", ns, check=False)


@dataclass
class Hosts:
    """Host A (10.231.0.1, store) and host B (10.231.0.2); each also has three per-rank addresses
    10.231.0.1x / 10.231.0.2x so a rule between two of them cuts exactly one rank pair."""

    a: str
    b: str

    def addr(self, host: str) -> str:
        return "10.231.0.1" if host == self.a else "10.231.0.2"

    def rank_addrs(self, host: str) -> list[str]:
        return [f"{self.addr(host)}{i}" for i in (1, 2, 3)]


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    missing = hosts_missing()
    if missing:
        pytest.skip(missing)
    for name in sh("ip", "netns", "list", check=False).stdout.split():  # earlier runs killed mid-test
        pid = name.removeprefix(NS_PREFIX).split("-")[0]
        if name.startswith(NS_PREFIX) and pid.isdigit() and not Path(f"/proc/{pid}").exists():
            delete_hosts([name])
    n = next(_counter)
    h = Hosts(f"{NS_PREFIX}{os.getpid()}-{n}-a", f"{NS_PREFIX}{os.getpid()}-{n}-b")
    veth = f"ftt{os.getpid() % 100000}{n}"
    try:
        sh("ip", "netns", "add", h.a)
        sh("ip", "netns", "add", h.b)
        sh("ip", "link", "add", f"{veth}a", "type", "veth", "peer", "name", f"{veth}b")
        for ns, dev in ((h.a, f"{veth}a"), (h.b, f"{veth}b")):
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{h.addr(ns)}/24", "dev", dev)
            for extra in h.rank_addrs(ns):
                sh("ip", "-n", ns, "addr", "add", f"{extra}/32", "dev", dev)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "-n", ns, "link", "set", dev, "up")
        yield h
    finally:
        delete_hosts([h.a, h.b])  # the veth pair and every rule go with the namespaces
    assert not {h.a, h.b} & set(sh("ip", "netns", "list", check=False).stdout.split())


@dataclass
class Job:
    out: Path
    procs: dict[str, subprocess.Popen[bytes]]

    def wait_files(self, pattern: str, count: int, what: str) -> None:
        end = time.monotonic() + DEADLINE_S
        while len(list(self.out.glob(pattern))) < count:
            failed = {h: p.returncode for h, p in self.procs.items() if p.poll() is not None}
            if failed or time.monotonic() > end:
                raise AssertionError(f"waiting for {what}: {len(list(self.out.glob(pattern)))} of {count} "
                                     f"(torchrun exits: {failed})\n{self.logs()}")
            time.sleep(0.1)

    def finish(self) -> dict[str, int]:
        codes = {}
        for host, p in self.procs.items():
            try:
                codes[host] = p.wait(timeout=DEADLINE_S)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"torchrun on {host} did not exit\n{self.logs()}") from None
        return codes

    def logs(self) -> str:
        return "\n".join(f"--- {f.name}\n{f.read_text()[-4000:]}" for f in sorted(self.out.glob("log-*")))

    def ranks(self) -> dict[int, dict[str, Any]]:
        return {int(f.stem.split("-")[1]): json.loads(f.read_text()) for f in self.out.glob("rank-*.json")}

    def peers(self) -> dict[int, dict[str, Any]]:
        return {int(f.stem.split("-")[1]): json.loads(f.read_text()) for f in self.out.glob("peers-*.json")}


def start_job(h: Hosts, tmp: Path, *, mode: str, steps: int, gate: int, rank_hosts: bool, guard: bool) -> Job:
    """One torchrun per host, --nnodes 2 --nproc-per-node 3, meeting at host A's c10d store."""
    out = tmp / "out"
    out.mkdir()
    (tmp / "worker.py").write_text(WORKER)
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    procs = {}
    for host in (h.a, h.b):
        env = {**os.environ, "FTT_OUT": str(out), "FTT_MODE": mode, "FTT_STEPS": str(steps), "FTT_GATE": str(gate),
               "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "FTTREE_STEP_TIMEOUT": "20", "FTTREE_TIMEOUT": "0.2"}
        env.pop("FTTREE_HOST", None)
        if rank_hosts:
            env["FTT_RANK_HOSTS"] = ",".join(h.rank_addrs(host))
        # --local-addr: the address the other host reaches this agent's workers' store by
        # (this VM's hostname resolves to nothing useful); is_host: host A serves the rendezvous.
        cmd = ["ip", "netns", "exec", host, torchrun, "--nnodes", "2", "--nproc-per-node", "3", "--max-restarts", "0",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{h.addr(h.a)}:29400", "--rdzv-id", "fttree-test",
               "--local-addr", h.addr(host), "--rdzv-conf", f"is_host={'true' if host == h.a else 'false'}"]
        cmd += ["-m", "fttree.training.rendezvous", str(tmp / "worker.py")] if guard else [str(tmp / "worker.py")]
        log = open(out / f"log-{'a' if host == h.a else 'b'}.txt", "wb")  # noqa: SIM115
        procs[host] = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
        log.close()
    return Job(out, procs)


def exact_sum(step: int, ranks: list[int]) -> float:
    return float(sum((r + 1) * (step + 1) for r in ranks))


@pytest.mark.realnet
def test_ddp_on_the_fttree_backend_across_two_hosts_with_a_link_cut_mid_run(hosts: Hosts, tmp_path: Path) -> None:
    """init_process_group("fttree") under two torchruns; at step 4 the primary link between a
    host-A parent and its host-B child is cut (iptables DROP on host B) until the end.

    Cutting everything between the two hosts would split the tree in two halves with no path
    between them (no backup can bridge that; the side without a majority stops), so the cut is
    one rank pair's link: each rank has its own address here, so the rule hits only that pair.
    """
    steps, gate = 10, 4
    job = start_job(hosts, tmp_path, mode="backend", steps=steps, gate=gate, rank_hosts=True, guard=False)
    job.wait_files(f"ready-{gate}-*", 6, f"all 6 ranks at step {gate}")
    addr = {r: info["peers"][r].rpartition(":")[0] for r, info in job.peers().items()}
    host_a = set(hosts.rank_addrs(hosts.a))
    assert {a in host_a for a in addr.values()} == {True, False}, addr  # both hosts took part
    child = next(c for c in range(1, 6) if (addr[c] in host_a) != (addr[(c - 1) // 2] in host_a))
    parent = (child - 1) // 2
    cut = sh(NETEM / "cut.sh", "--netns", hosts.b, f"{addr[parent]}-{addr[child]}")
    assert "cut" in cut.stdout, cut.stderr
    (job.out / f"go-{gate}").touch()
    codes = job.finish()
    assert codes == {hosts.a: 0, hosts.b: 0}, job.logs()
    rules = sh("ip", "netns", "exec", hosts.b, "iptables", "-w", "5", "-L", "INPUT", "-v", "-n", "-x").stdout
    dropped = sum(int(line.split()[0]) for line in rules.splitlines() if "fttree cut" in line)
    assert dropped > 0, rules  # the cut link was in use and its frames went nowhere
    ranks = job.ranks()
    assert sorted(ranks) == list(range(6))
    for r, info in ranks.items():
        assert info["sums"] == [exact_sum(s, list(range(6))) for s in range(steps)], (r, info["sums"])
    assert len({tuple(info["bits"]) for info in ranks.values()}) == 1  # every rank the same bits
    jobs = {info["job"] for info in ranks.values()}
    assert len(jobs) == 1, jobs  # every rank proved the key rank 0 put in the store
    assert "" not in jobs
    want = single_process(steps, 6)
    import torch

    for got, ref in zip(ranks[0]["params"], want, strict=True):
        assert torch.allclose(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=1e-6)


@pytest.mark.realnet
def test_from_env_across_two_hosts_survives_a_killed_worker_under_the_guard(hosts: Hosts, tmp_path: Path) -> None:
    """FTTreeAllreduce.from_env() (addresses: the interface that reaches the store, found by the
    UDP trick) under `torchrun -m fttree.training.rendezvous`: rank 1 on host A, the store's
    host, is SIGKILLed before step 4. Its agent keeps the node's other workers; the survivors
    finish every step with the exact sum of the survivors, and both torchruns exit 0 at once."""
    steps, gate = 10, 4
    job = start_job(hosts, tmp_path, mode="env", steps=steps, gate=gate, rank_hosts=False, guard=True)
    job.wait_files(f"ready-{gate}-*", 6, f"all 6 ranks at step {gate}")
    peers = job.peers()
    hosts_seen = {info["peers"][r].rpartition(":")[0] for r, info in peers.items()}
    assert hosts_seen == {"10.231.0.1", "10.231.0.2"}, hosts_seen  # each host's own interface address
    victim = next(r for r in (1, 2, 3, 4, 5) if peers[r]["peers"][r].startswith("10.231.0.1:"))
    os.kill(peers[victim]["pid"], signal.SIGKILL)
    (job.out / f"go-{gate}").touch()
    codes = job.finish()
    assert codes == {hosts.a: 0, hosts.b: 0}, job.logs()
    assert f"fttree guard: rank {victim}" in job.logs()
    ranks = job.ranks()
    survivors = sorted(set(range(6)) - {victim})
    assert sorted(ranks) == survivors, job.logs()
    for r, info in ranks.items():
        for s in range(steps):
            who = info["contributors"][s]
            assert who == (list(range(6)) if s < gate else survivors), (r, s, who)
            assert info["sums"][s] == exact_sum(s, who), (r, s)
    assert len({tuple(info["bits"]) for info in ranks.values()}) == 1
    jobs = {info["job"] for info in ranks.values()}
    assert len(jobs) == 1, jobs  # every rank proved the key rank 0 put in the store
    assert "" not in jobs
