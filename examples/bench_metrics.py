"""Does serving /metrics during steps slow the data path? No-fault step time while every worker's
/metrics is scraped, against the same job with the control server idle.

    python examples/bench_metrics.py -n 7 --steps 300 --block 20 --rounds 4 --scrape-interval 1

One `fttree launch`-style job per round (worker processes on 127.0.0.x, HTTP on). Steps come
in blocks of --block: odd blocks are scraped, even blocks are not, so both kinds of step share
the same processes and the same moment of a busy machine. A step's time is the slowest
worker's; the first two steps of each block are left out (the switch lags a step behind).
The scraper is one niced process, standing in for a Prometheus server on another machine.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import statistics
import tempfile
from pathlib import Path
from typing import Any

from fttree.net.address import local_peers
from fttree.status.cli import HTTP_PORT_OFFSET
from fttree.tools.launch import launch

_STEP_LINE = re.compile(r"^step\s+(\d+)\s")


def scraped_block(step: int, block: int) -> bool:
    return (step // block) % 2 == 1


def _scrape_main(urls: list[str], interval_s: float, block: int, done_step: Any, stop: Any, served: Any) -> None:
    """The scraper process: niced so it does not compete with the workers for CPU, and aiohttp
    so one process keeps up with every worker."""
    import asyncio

    import aiohttp

    os.nice(19)

    async def scrape(session: aiohttp.ClientSession, url: str) -> None:
        while not stop.is_set():
            if not scraped_block(done_step.value + 1, block):
                await asyncio.sleep(0.005)
                continue
            try:
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                    await resp.read()
                with served.get_lock():
                    served.value += 1
            except (aiohttp.ClientError, OSError, TimeoutError):
                await asyncio.sleep(0.05)
                continue
            await asyncio.sleep(interval_s)

    async def scrape_all() -> None:
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(scrape(session, u) for u in urls))

    asyncio.run(scrape_all())


def run_round(args: argparse.Namespace, port: int) -> tuple[list[float], list[float], int]:
    """Step times (s) of the idle and the scraped blocks of one job, and the scrapes served."""
    http_base = port + HTTP_PORT_OFFSET
    hosts = [p.rsplit(":", 1)[0] for p in local_peers(args.world, port=port)]
    urls = [f"http://{h}:{http_base + r}/metrics" for r, h in enumerate(hosts)]
    done_step, served, stop = mp.Value("i", -1), mp.Value("i", 0), mp.Event()

    def on_line(line: str) -> None:  # launch prints "step N ..." once N is done on every worker
        m = _STEP_LINE.match(line)
        if m:
            done_step.value = int(m.group(1))

    scraper = mp.Process(target=_scrape_main, args=(urls, args.scrape_interval, args.block, done_step, stop, served),
                         daemon=True)
    scraper.start()
    worker_args = ["--steps", str(args.steps), "--size", str(args.size), "--timeout", str(args.timeout),
                   "--http-port-base", str(http_base)]
    try:
        with tempfile.TemporaryDirectory(prefix="fttree-bench-metrics-") as tmp:
            result = launch(args.world, worker_args, steps=args.steps, port=port, launch_dir=Path(tmp),
                            echo=on_line, deadline_s=900)
    finally:
        stop.set()
        scraper.join(timeout=10)
        if scraper.is_alive():
            scraper.terminate()
    if not result.ok:
        raise SystemExit(f"job on port {port} failed: exit codes {result.exit_codes}")
    idle, scraped = [], []
    for step in sorted(result.records):
        if step < args.block or step % args.block < 2:
            continue  # warm-up block, and the steps where the switch lags
        (scraped if scraped_block(step, args.block) else idle).append(result.step_time(step))
    return idle, scraped, int(served.value)


def loop_cpu_per_scrape(world: int, scrapes: int = 500) -> float:
    """CPU seconds one GET /metrics costs the event-loop thread of a rank with the most links,
    measured as that thread's own CPU time: unlike wall time it does not grow when other
    processes crowd the machine."""
    import asyncio
    import threading
    import time
    import urllib.request

    import numpy as np

    from fttree import FTTreeAllreduce

    peers = [f"127.0.0.{r + 1}:{29790}" for r in range(world)]
    handles = [FTTreeAllreduce(r, peers, http_port=0) for r in range(world)]
    threads = [threading.Thread(target=h.start) for h in handles]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        for h in handles:  # a few steps, so the snapshot has real numbers in it
            h.allreduce_async(np.ones(1000, dtype=np.float32))
        h = handles[1 if world > 1 else 0]
        assert h._loop is not None

        async def cpu() -> float:
            return time.thread_time()

        url = f"http://{h.http_address}/metrics"
        urllib.request.urlopen(url).read()
        before = asyncio.run_coroutine_threadsafe(cpu(), h._loop).result()
        for _ in range(scrapes):
            urllib.request.urlopen(url).read()
        after = asyncio.run_coroutine_threadsafe(cpu(), h._loop).result()
        return (after - before) / scrapes
    finally:
        for h in handles:
            h.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--world", type=int, default=7)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--block", type=int, default=20, help="steps per scraped / idle block")
    parser.add_argument("--size", type=int, default=407_050, help="float32 elements per step (thesis MLP)")
    parser.add_argument("--timeout", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--scrape-interval", type=float, default=1.0,
                        help="seconds between scrapes of each worker (0: back to back)")
    parser.add_argument("--port", type=int, default=29800)
    parser.add_argument("--cpu-only", action="store_true", help="only measure the loop CPU per scrape")
    args = parser.parse_args()

    per_scrape = loop_cpu_per_scrape(args.world)
    print(f"one GET /metrics costs a rank's event loop {per_scrape * 1e6:.0f} us of CPU "
          f"({per_scrape / args.scrape_interval * 100 if args.scrape_interval else float('inf'):.3f}% of the loop "
          f"at one scrape every {args.scrape_interval:g} s)", flush=True)
    if args.cpu_only:
        return
    all_idle: list[float] = []
    all_scraped: list[float] = []
    ratios = []
    for rnd in range(args.rounds):
        idle, scraped, served = run_round(args, args.port + rnd)
        all_idle += idle
        all_scraped += scraped
        ratios.append(statistics.median(scraped) / statistics.median(idle))
        print(f"round {rnd}: idle {statistics.median(idle) * 1000:7.2f} ms  scraped "
              f"{statistics.median(scraped) * 1000:7.2f} ms  ratio {ratios[-1]:.3f}  ({served} scrapes)", flush=True)
    idle_ms, scraped_ms = statistics.median(all_idle) * 1000, statistics.median(all_scraped) * 1000
    print(f"\n{args.world} workers, {args.size} float32 per step, {args.rounds} x {args.steps} steps in blocks of "
          f"{args.block}; each worker scraped every {args.scrape_interval:g} s in scraped blocks")
    print(f"median step: idle {idle_ms:.2f} ms, scraped {scraped_ms:.2f} ms; scraped / idle = "
          f"{scraped_ms / idle_ms:.3f} ({(scraped_ms / idle_ms - 1) * 100:+.1f}%); median of round ratios "
          f"{statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
