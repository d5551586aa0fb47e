"""Fig. 11 of the seed thesis: how many random link failures the tree survives, by tree height.

Monte Carlo: fail the links of a full tree (primary and backup) one at a time in random order
until some primary link is down with no live one-hop detour (child -> brother -> parent or
child -> uncle -> parent, Fig. 9b): from then on the backup scheme cannot bridge and the step
stops. The count reported is the failures *tolerated* before that one, as a number and as a
percentage of all links. The rule is the one the protocol tests use (`bridgeable()` in
tests/test_protocol_sim.py); a test checks the two agree.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..core import topology as topo

Link = tuple[int, int]


def _key(a: int, b: int) -> Link:
    return (a, b) if a < b else (b, a)


def all_links(world: int) -> list[Link]:
    """Every link of the fault-tolerant tree, primary and backup, as sorted pairs."""
    return sorted({_key(c, p) for c, p in topo.tree_links(world)} | set(topo.backup_links(world)))


def detours(world: int) -> dict[Link, list[tuple[Link, Link]]]:
    """For each primary link (child, parent): the link pairs of its brother and uncle detours."""
    out: dict[Link, list[tuple[Link, Link]]] = {}
    for child, parent in topo.tree_links(world):
        n = topo.neighbours(child, world)
        out[_key(child, parent)] = [(_key(child, k), _key(k, parent)) for k in (n.brother, n.uncle) if k is not None]
    return out


def bridgeable(world: int, failed: set[Link]) -> bool:
    """Every failed primary link has a live brother or uncle detour."""
    dead = {_key(a, b) for a, b in failed}
    for primary, ways in detours(world).items():
        if primary in dead and not any(x not in dead and y not in dead for x, y in ways):
            return False
    return True


def world_of_height(height: int) -> int:
    """Nodes of a full binary tree of this height (height 1: 3 nodes, 2: 7, 3: 15, ...)."""
    return int(2 ** (height + 1)) - 1


def tolerated_failures(world: int, rng: random.Random) -> int:
    """Fail links in a random order; return how many failed before the tree could not bridge."""
    links = all_links(world)
    ways = detours(world)
    # a new failure can only break the primary links it is, or lies on a detour of
    touched: dict[Link, set[Link]] = {link: set() for link in links}
    for primary, pairs in ways.items():
        touched[primary].add(primary)
        for x, y in pairs:
            touched[x].add(primary)
            touched[y].add(primary)
    order = links[:]
    rng.shuffle(order)
    dead: set[Link] = set()
    for i, link in enumerate(order):
        dead.add(link)
        for primary in touched[link]:
            if primary in dead and not any(x not in dead and y not in dead for x, y in ways[primary]):
                return i
    return len(order)  # never reached for world >= 2: cutting everything isolates someone


@dataclass(frozen=True, slots=True)
class HeightResult:
    height: int
    world: int
    links: int
    primary_links: int
    trials: int
    mean_tolerated: float
    stdev_tolerated: float
    mean_percent: float
    min_tolerated: int
    max_tolerated: int


def monte_carlo(heights: list[int], trials: int, seed: int = 0) -> list[HeightResult]:
    rng = random.Random(seed)
    results = []
    for h in heights:
        if h < 1:
            raise ValueError(f"tree height must be at least 1 (3 nodes), got {h}")
        world = world_of_height(h)
        n_links = len(all_links(world))
        counts = [tolerated_failures(world, rng) for _ in range(trials)]
        results.append(HeightResult(
            height=h, world=world, links=n_links, primary_links=world - 1, trials=trials,
            mean_tolerated=statistics.fmean(counts),
            stdev_tolerated=statistics.stdev(counts) if len(counts) > 1 else 0.0,
            mean_percent=100.0 * statistics.fmean(counts) / n_links,
            min_tolerated=min(counts), max_tolerated=max(counts)))
    return results


def render(results: list[HeightResult]) -> str:
    lines = ["Fig. 11: link failures tolerated until some node is isolated (random order, one-hop backups)",
             f"{'height':>6} {'workers':>7} {'links':>5} {'mean tolerated':>14} {'stdev':>6} {'% of links':>10} "
             f"{'min..max':>9}"]
    for r in results:
        lines.append(f"{r.height:>6} {r.world:>7} {r.links:>5} {r.mean_tolerated:>14.2f} {r.stdev_tolerated:>6.2f} "
                     f"{r.mean_percent:>9.1f}% {r.min_tolerated:>4}..{r.max_tolerated:<4}")
    return "\n".join(lines)


def as_json(results: list[HeightResult], seed: int) -> dict[str, Any]:
    return {"figure": "11", "seed": seed, "rule": "one-hop brother/uncle detour (tests/test_protocol_sim.bridgeable)",
            "results": [asdict(r) for r in results]}


def plot(results: list[HeightResult], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heights = [r.height for r in results]
    fig, (ax_a, ax_b) = plt.subplots(1, 2, figsize=(10, 4))
    ax_a.bar(heights, [r.mean_tolerated for r in results], yerr=[r.stdev_tolerated for r in results],
             color="tab:blue", capsize=3)
    ax_a.set(xlabel="tree height", ylabel="failed links",
             title="(a) average number of failed links\nuntil a node is isolated")
    ax_b.bar(heights, [r.mean_percent for r in results], color="tab:orange")
    ax_b.set(xlabel="tree height", ylabel="% of links",
             title="(b) average percentage of failed links\nuntil a node is isolated")
    for ax in (ax_a, ax_b):
        ax.set_xticks(heights)
    fig.suptitle(f"Fig. 11 (Monte Carlo, {results[0].trials} trials per height)" if results else "Fig. 11")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
