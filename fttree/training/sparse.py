"""Sparse, low-bit pseudo-gradients for DiLoCo (`compression="sparse"` or `fttree.Sparse(...)`).

Each worker sends, per outer step, only a `density` share of its pseudo-gradient's coordinates,
each as a `bits`-bit multiple of a scale, and keeps what it did not send in an error-feedback
accumulator that is added to its next pseudo-gradient (as SparseLoCo and DeMo do).

Why a shared index set. A tree sums as it goes up; the union of independent top-k masks is not
sparse (64 masks of 1.56% cover 63%), so every worker sends the values of the same coordinates
in a round. They are derived from state every worker holds bit for bit (the outer step's count,
with `index="momentum"` the outer momentum, with `index="energy"` the block energies every worker
reported one round earlier), so no message agrees on them, and a joiner that takes the state
over derives them as the others do.

Why "energy". A random share of the coordinates delivers that share of the workers' progress per
round: with 1/16 a coordinate waits 16 rounds on average, and for a model whose small layers
matter (an MLP's output layer is 1% of its parameters) the global model learns slowly. With
`index="energy"` every worker also reports, per block of `block` coordinates, the size of what
it kept (its accumulator's RMS after the round, as a log2 level in a small packed field), and the
next round sends the blocks with the largest mean level: the round's budget goes where the
unsent progress is, as a top-k would, and a block just sent waits until it has grown again.

Why a shared scale. Per-worker scales would make the sum a sum of dequantised floats (int8's way:
decode, add and re-quantise at every hop), which needs float words on the wire. With one scale
per chunk for everyone, the values are small integers whose sum is exact in any order: each
worker sends `q + Q` (0..2Q) in a field wide enough for the sum over every rank, several fields
packed into one float64 word (an exact integer below 2**53), and the tree adds the words as
floats without a carry crossing a field. A chunk's scale is the mean over the workers of their
accumulator's RMS in that chunk one round earlier (sent in the same message, one float per
chunk), so it is shared state too; a value beyond Q scales is clipped and the rest stays in the
accumulator. In the first round (and the first after a checkpoint is loaded) no scale is known:
nothing is sent but the RMS, and the round's pseudo-gradients wait in the accumulators.

The accumulator is each worker's own, like its inner optimizer's state: a restarted or joining
worker starts with an empty one (a peer's describes the peer's data), and a worker that dies
takes its unsent progress with it, as it takes its round's work in dense DiLoCo.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..api import FTTreeAllreduce
from ..errors import ConfigError, FTTreeError
from .optim import DistributedOptimizer, broadcast_parameters

__all__ = ["INDEX_RULES", "Sparse", "SparseCodec", "SparseOuter"]

INDEX_RULES = ("random", "momentum", "energy")
EXACT_BITS = 53  # a float64 holds every integer below 2**53 exactly, so sums of them are exact
# The step between levels, in units of the chunk's RMS: about the best uniform quantiser of a
# Gaussian for Q = 1, 3 and 7 levels each side.
STEP_PER_RMS = {2: 1.2, 3: 0.6, 4: 0.33}
# index="energy": a block's level is 2 log2(its RMS) + LEVEL_ZERO, in 1..LEVEL_MAX (0: nothing kept), so
# one level is half an octave and the levels cover RMS from 2**-49.5 to 2**13.5
LEVEL_ZERO = 100
LEVEL_MAX = 127


@dataclass(frozen=True)
class Sparse:
    """What `compression=fttree.Sparse(...)` sends (`compression="sparse"`: these defaults).

    `density`: the share of coordinates sent per outer step. `bits`: 2, 3 or 4 bits per value
    (levels -Q..Q, Q = 1, 3, 7; the wire field is wider by log2 of the world size, so that the
    tree's sum fits). `index`: how the round's coordinates are chosen, alike on every worker
    (the default "energy" reached gloo's accuracy in half the rounds "random" took, on the 10M
    model of docs/diloco.md): "random" (k per chunk drawn from `seed` and the outer step
    count), "momentum" (half the k with the largest outer momentum, the other half drawn as
    "random", so that no coordinate is starved) or "energy" (whole blocks, those whose unsent
    progress, as every worker reported it one round earlier, is largest). `block`: "random"
    and "momentum": coordinates sent per chunk (a chunk spans block / density coordinates and
    has one scale); "energy": the coordinates of one block, which is sent whole or not at all
    and has one scale and one reported level."""

    density: float = 1 / 16
    bits: int = 2
    index: str = "energy"
    block: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.density <= 1:
            raise ConfigError(f"Sparse density must be in (0, 1], got {self.density}")
        if self.bits not in STEP_PER_RMS:
            raise ConfigError(f"Sparse bits must be one of {sorted(STEP_PER_RMS)}, got {self.bits}")
        if self.index not in INDEX_RULES:
            raise ConfigError(f"Sparse index must be one of {INDEX_RULES}, got {self.index!r}")
        if self.block < 1:
            raise ConfigError(f"Sparse block must be at least 1 coordinate, got {self.block}")

    @property
    def levels(self) -> int:
        """Q: values travel as integers in -Q..Q."""
        return int(2 ** (self.bits - 1) - 1)


def field_bits(levels: int, world: int) -> int:
    """Bits of one packed field: room for the sum of `world` values in 0..2Q."""
    return (2 * levels * world).bit_length()


class SparseCodec:
    """One worker's side of the sparse outer step: the accumulator, the round's shared index set
    and scales, and the wire vector (a float64 Parameter whose `.grad` the outer step's
    GradientSync sums, unaveraged).

    The accumulator is [chunks, chunk]: "random" and "momentum" send k coordinates of every
    chunk; "energy" makes a chunk one block and sends `picked` whole blocks. Wire layout
    (float64): packed fields of the round's values; then "random"/"momentum": per chunk the
    sender's accumulator RMS, "energy": per block the packed level of what the sender kept,
    and its whole accumulator's RMS (one float, which carries NaN or Inf to the allreduce's
    nonfinite policy); then the count of workers whose values are in (1 per worker), then a
    digest of the sender's index set and scales (the sum is count x digest when every worker
    used the same ones: anything else is a bug that would make workers differ, so it raises).

    `rms` is the shared per-chunk state the next round's plan reads: the mean RMS the workers
    reported ("random", "momentum") or the mean level ("energy"); 0 where none is known."""

    def __init__(self, config: Sparse, named_globals: Sequence[tuple[str, torch.Tensor]], world: int) -> None:
        self.config = config
        self.globals = [g for _, g in named_globals]
        self.numel = sum(g.numel() for g in self.globals)
        self.world = world
        self.energy = config.index == "energy"
        if self.energy:
            self.chunk = min(self.numel, config.block)
            self.k = self.chunk  # a chosen block goes whole
        else:
            self.chunk = min(self.numel, max(config.block, round(config.block / config.density)))
            self.k = max(1, min(self.chunk, round(config.density * self.chunk)))
        self.chunks = -(-self.numel // self.chunk)
        self.picked = max(1, min(self.chunks, round(config.density * self.chunks))) if self.energy else self.chunks
        self.padded = self.chunks * self.chunk
        self.width = field_bits(config.levels, world)
        if self.width > EXACT_BITS:
            raise ConfigError(f"Sparse: {world} workers need {self.width}-bit fields, more than a float64 holds")
        self.per_word = EXACT_BITS // self.width
        self.values = self.picked * self.k
        self.words = -(-self.values // self.per_word)
        self.level_width = (LEVEL_MAX * world).bit_length()
        self.levels_per_word = EXACT_BITS // self.level_width
        self.level_words = -(-self.chunks // self.levels_per_word) if self.energy else 0
        self.stats_at = self.words + self.level_words
        self.count_at = self.stats_at + (1 if self.energy else self.chunks)
        self.digest_at = self.count_at + 1
        self.wire = torch.nn.Parameter(torch.zeros(self.digest_at + 1, dtype=torch.float64))
        self.acc = torch.zeros(self.chunks, self.chunk)  # float32, padding always 0
        self.rms = torch.zeros(self.chunks)  # shared: what the workers reported last round (see above)
        self._plan_key: tuple[int, bytes] | None = None
        self._plan: tuple[torch.Tensor, torch.Tensor, int] | None = None
        self._sent: tuple[torch.Tensor, torch.Tensor] | None = None  # this round's (indices, values sent)
        self.momentum: Callable[[], list[torch.Tensor] | None] = lambda: None  # set by SparseOuter
        self.rounds_sent = 0
        self.nonfinite_rounds = 0  # rounds whose accumulator held NaN or Inf (forget_nonfinite)

    # ---- sizes --------------------------------------------------------------------------

    @property
    def wire_bytes(self) -> int:
        """Bytes of one worker's message per outer step (the tree sends it up and the sum down)."""
        return self.wire.numel() * 8

    # ---- the shared plan ----------------------------------------------------------------

    def plan(self, step: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The round's indices (sorted, into the flat accumulator), the scale of each, and their
        digest: a function of shared state only (the step count, the reported RMS or levels, the
        outer momentum)."""
        key = (step, self.rms.numpy().tobytes())
        if self._plan_key == key and self._plan is not None:
            return self._plan
        gen = torch.Generator().manual_seed(hash_seed(self.config.seed, step))
        if self.energy:
            idx, scale = self._plan_energy(gen)
        else:
            idx, scale = self._plan_chunks(gen)
        h = hashlib.blake2b(idx.numpy().tobytes(), digest_size=8)
        h.update(scale.numpy().tobytes())
        digest = int.from_bytes(h.digest(), "little") % (1 << 20)
        self._plan_key, self._plan = key, (idx, scale, digest)
        return self._plan

    def _plan_chunks(self, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """"random" and "momentum": k coordinates of every chunk, at the chunk's scale."""
        scores = torch.rand(self.chunks, self.chunk, generator=gen)
        pad = self.padded - self.numel
        if pad:
            scores.view(-1)[self.numel:] = -3.0  # padding is never chosen while a real coordinate is left
        momentum = self.momentum() if self.config.index == "momentum" else None
        if momentum is not None and self.k >= 2:
            top = self.k // 2
            m = torch.full((self.padded,), -1.0)
            m[:self.numel] = torch.cat([t.reshape(-1) for t in momentum]).abs()
            first = m.view(self.chunks, self.chunk).topk(top, dim=1).indices
            scores.scatter_(1, first, -2.0)
            rest = scores.topk(self.k - top, dim=1).indices
            idx = torch.cat([first, rest], dim=1)
        else:
            idx = scores.topk(self.k, dim=1).indices
        idx = idx.sort(dim=1).values + (torch.arange(self.chunks) * self.chunk)[:, None]
        scale = torch.where(torch.isfinite(self.rms), self.rms * STEP_PER_RMS[self.config.bits],
                            torch.zeros_like(self.rms))
        return idx.reshape(-1), scale.repeat_interleave(self.k)

    def _plan_energy(self, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """"energy": the `picked` blocks of the largest mean level (ties drawn alike everywhere),
        each at a scale from its level."""
        draw = torch.rand(self.chunks, generator=gen)
        # mean levels differ by at least 1/world, and the draw stays below half of that
        score = self.rms.double() + draw.double() / (2 * self.world)
        blocks = score.topk(self.picked).indices.sort().values
        level = self.rms[blocks]
        rms = torch.where(level > 0, torch.exp2((level - LEVEL_ZERO) / 2), torch.zeros_like(level))
        idx = (blocks * self.chunk)[:, None] + torch.arange(self.chunk)[None, :]
        return idx.reshape(-1), (rms * STEP_PER_RMS[self.config.bits]).repeat_interleave(self.chunk)

    # ---- sending ------------------------------------------------------------------------

    def encode(self, pseudo: Sequence[torch.Tensor] | None, step: int, *, accumulate: bool = False) -> None:
        """Fill the wire's `.grad` from `pseudo`, this worker's whole distance from the global
        parameters (its model is the global parameters less its accumulator, so that is the
        accumulator plus this round's progress), or with `accumulate` only this round's progress
        (DiLoCo's overlap, whose model goes on from where it was): its values at the round's
        indices, quantised; what is not sent stays in the accumulator. `pseudo=None`: an empty
        contribution (all zeros, counted in no average; the accumulator is kept)."""
        wire = torch.zeros_like(self.wire)
        self._sent = None
        if pseudo is not None:
            with torch.no_grad():
                flat = self.acc.view(-1)
                offset = 0
                for t in pseudo:
                    n = t.numel()
                    if accumulate:
                        flat[offset:offset + n] += t.detach().reshape(-1).float()
                    else:
                        flat[offset:offset + n] = t.detach().reshape(-1).float()
                    offset += n
                idx, scale, digest = self.plan(step)
                levels = self.config.levels
                vals = flat[idx]
                safe = torch.where(scale > 0, scale, torch.ones_like(scale))
                q = torch.where(scale > 0, (vals / safe).round().clamp(-levels, levels), torch.zeros_like(vals))
                q = torch.nan_to_num(q, nan=0.0)
                sent = q * scale
                # NaN or Inf anywhere makes the reported RMS so: the allreduce's nonfinite policy then
                # meets this contribution as it meets a dense one (see forget_nonfinite)
                stats = wire[self.stats_at:self.count_at]
                if self.energy:
                    sumsq = block_sumsq(self.acc)
                    stats[0] = float((sumsq.sum() / self.padded).sqrt())
                else:
                    stats.copy_(self.acc.square().mean(dim=1).sqrt().double())
                if bool(torch.isfinite(stats).all()):
                    flat[idx] -= sent
                    self._sent = (idx, sent)
                    if self.energy:  # what this worker keeps, block by block: the next round's choice
                        blocks = idx.view(-1, self.chunk)[:, 0] // self.chunk  # only the sent ones changed
                        sumsq[blocks] = block_sumsq(self.acc[blocks])
                        wire[self.words:self.stats_at] = pack(levels_of(sumsq, self.chunk), self.level_width,
                                                              self.levels_per_word, self.level_words)
                else:
                    self.forget_nonfinite()
                wire[:self.words] = pack(q.to(torch.int64) + levels, self.width, self.per_word, self.words)
                wire[self.count_at] = 1.0
                wire[self.digest_at] = float(digest)
                self.rounds_sent += 1
        self.wire.grad = wire

    def forget_nonfinite(self) -> None:
        """The accumulator holds NaN or Inf (the worker's training diverged in this round): it
        can never be sent, and kept it would make every later message of this worker non-finite
        and its model NaN for good. This round's message carries the non-finite RMS, so the
        allreduce treats it as a non-finite dense pseudo-gradient (Config.nonfinite: "skip"
        leaves this worker out of the round, with a note; "abort" fails the round on every
        worker, naming it; "allow" lets it into the sum, where decode refuses it), and the
        accumulator starts over: the worker loses its unsent progress, as a dense worker that
        is skipped loses its round, and goes on from the global parameters."""
        self.acc.zero_()
        self._sent = None
        self.nonfinite_rounds += 1

    def left_out(self) -> None:
        """This worker's values were not in the round's sum (it was late, say): keep them."""
        if self._sent is not None:
            idx, sent = self._sent
            self.acc.view(-1)[idx] += sent
            self._sent = None

    def sent(self) -> list[torch.Tensor] | None:
        """What this round's message carries of this worker, dequantised and shaped as the global
        parameters (its term in the average, times the count), or None when it sent nothing
        (an empty contribution, or an accumulator that held NaN or Inf): the eager update's
        stand-in for that term while the sum is in flight."""
        if self._sent is None:
            return None
        idx, values = self._sent
        flat = torch.zeros(self.padded)
        flat[idx] = values
        out, offset = [], 0
        for g in self.globals:
            out.append(flat[offset:offset + g.numel()].view(g.shape))
            offset += g.numel()
        return out

    def residuals(self) -> list[torch.Tensor]:
        """The accumulator shaped as the global parameters: what this worker's model keeps
        beyond them (its progress not yet sent)."""
        flat, out, offset = self.acc.view(-1), [], 0
        for g in self.globals:
            out.append(flat[offset:offset + g.numel()].view(g.shape))
            offset += g.numel()
        return out

    def reset(self) -> None:
        """Forget the accumulator (a worker whose state came from a peer, or a checkpoint's)."""
        self.acc.zero_()
        self._sent = None

    # ---- receiving ----------------------------------------------------------------------

    def decode(self, total: torch.Tensor, step: int) -> list[torch.Tensor]:
        """The averaged sparse pseudo-gradient (dense tensors shaped as the global parameters)
        from the round's summed wire vector, and the new shared RMS or levels. Alike on every worker:
        they all hold the same sum and the same plan."""
        count = round(float(total[self.count_at]))
        out = torch.zeros(self.padded)
        if count > 0:
            idx, scale, digest = self.plan(step)
            if round(float(total[self.digest_at])) != count * digest:
                raise FTTreeError(f"sparse outer step {step}: the workers chose different index sets or scales "
                                  f"(digest sum {float(total[self.digest_at]):.0f}, expected {count} x {digest}); "
                                  f"their shared state differs")
            stats = total[self.stats_at:self.count_at]
            if not bool(torch.isfinite(stats).all()):
                bad = torch.nonzero(~torch.isfinite(stats)).view(-1)
                where = "" if self.energy else \
                    f" (chunks {bad[:8].tolist()}{' ...' if len(bad) > 8 else ''} of {self.chunks})"
                raise FTTreeError(f"sparse outer step {step}: a worker's error-feedback accumulator held NaN or Inf"
                                  f"{where}, and the sum took it in (nonfinite='allow'); the shared scales "
                                  f"would be lost on every worker. Use nonfinite='skip' (leave that worker out of "
                                  f"the round) or 'abort'")
            fields = unpack(total[:self.words], self.width, self.per_word, self.values)
            q = (fields - count * self.config.levels).to(torch.float32)
            out[idx] = q * scale / count
            if self.energy:
                levels = unpack(total[self.words:self.stats_at], self.level_width, self.levels_per_word, self.chunks)
                self.rms = (levels.double() / count).float()
            else:
                self.rms = (stats / count).float()
        grads, offset = [], 0
        for g in self.globals:
            grads.append(out[offset:offset + g.numel()].view(g.shape).clone())
            offset += g.numel()
        return grads

    # ---- shared state a joiner takes over -------------------------------------------------

    def shared_state(self) -> dict[str, Any]:
        return {"rms": self.rms.clone()}

    def load_shared_state(self, value: Any) -> None:
        rms = torch.as_tensor(value["rms"], dtype=torch.float32)
        if rms.shape != self.rms.shape:
            raise ConfigError(f"the donor's sparse scales have shape {list(rms.shape)}, this worker's "
                              f"{list(self.rms.shape)} (same model and Sparse settings everywhere?)")
        self.rms = rms.clone()


def hash_seed(seed: int, step: int) -> int:
    """A 63-bit generator seed for round `step` (not Python's hash(): it is salted per process)."""
    h = hashlib.blake2b(f"fttree sparse {seed} {step}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") >> 1


def block_levels(acc: torch.Tensor) -> torch.Tensor:
    """index="energy": each block's (row's) RMS as a level, 2 log2(RMS) + LEVEL_ZERO rounded and
    held in 1..LEVEL_MAX, 0 for a block that keeps nothing."""
    return levels_of(block_sumsq(acc), acc.shape[1])


def block_sumsq(acc: torch.Tensor) -> torch.Tensor:
    """Each block's (row's) sum of squares, as float64. Summed in float32, which reads the
    accumulator once (a float64 copy first took 4x as long: 43 ms of a 10M model's 100 ms
    encode, twice a round); rows whose float32 sum overflowed are summed again in float64."""
    sums = (acc * acc).sum(dim=1)
    bad = ~torch.isfinite(sums)
    out = sums.double()
    if bool(bad.any()):
        out[bad] = acc[bad].double().square().sum(dim=1)
    return out


def levels_of(sumsq: torch.Tensor, block: int) -> torch.Tensor:
    """block_levels from each block's sum of squares over `block` coordinates."""
    rms = (sumsq / block).sqrt()
    level = (2 * torch.log2(rms.clamp_min(1e-300))).round() + LEVEL_ZERO
    return torch.where(rms > 0, level.clamp(1, LEVEL_MAX), torch.zeros_like(level)).to(torch.int64)


def pack(fields: torch.Tensor, width: int, per_word: int, words: int) -> torch.Tensor:
    """Non-negative int64 fields (each below 2**width) -> float64 words of `per_word` fields."""
    padded = torch.zeros(words * per_word, dtype=torch.int64)
    padded[:fields.numel()] = fields
    grid = padded.view(words, per_word)
    shifts = torch.arange(per_word, dtype=torch.int64) * width
    return (grid << shifts).sum(dim=1).double()


def unpack(words: torch.Tensor, width: int, per_word: int, count: int) -> torch.Tensor:
    """The inverse of pack for summed words (each field still below 2**width)."""
    ints = words.round().to(torch.int64)
    shifts = torch.arange(per_word, dtype=torch.int64) * width
    fields = (ints[:, None] >> shifts) & ((1 << width) - 1)
    return fields.reshape(-1)[:count]


class SparseOuter(DistributedOptimizer):
    """The outer step's DistributedOptimizer for sparse DiLoCo: its GradientSync sums the codec's
    wire vector (unaveraged) instead of the global parameters' gradients, and a step pre-hook
    decodes the sum into them before the outer optimizer steps, in a normal step and in a
    joiner's replay alike. A joiner takes over the global parameters (not the wire), the outer
    optimizer's state and the shared scales."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, named_globals: Sequence[tuple[str, torch.Tensor]],
                 codec: SparseCodec, allreduce: FTTreeAllreduce, bucket_mb: float) -> None:
        self._globals = list(named_globals)
        if not allreduce.joining:  # rank 0's global parameters become everyone's start
            allreduce.mark_step(None)
            broadcast_parameters(self._globals, allreduce)
        self.codec = codec
        # the wire is one parameter, so one bucket: a worker's values, count and digest are in
        # the sum together or not at all
        super().__init__(optimizer, allreduce=allreduce, named_parameters=[("sparse wire", codec.wire)],
                         bucket_mb=max(bucket_mb, codec.wire_bytes / 2**20 + 1), average=False, broadcast=False)
        codec.momentum = self._momentum
        optimizer.register_step_pre_hook(self._decode_before_step)
        self.register_state("sparse scales", codec.shared_state, codec.load_shared_state)

    def _model_state(self) -> dict[str, torch.Tensor]:
        return dict(self._globals)

    def _momentum(self) -> list[torch.Tensor] | None:
        bufs = [self.optimizer.state.get(g, {}).get("momentum_buffer") for _, g in self._globals]
        return None if any(b is None for b in bufs) else [b for b in bufs if b is not None]

    def _decode_before_step(self, _opt: Any, _args: tuple[Any, ...], _kwargs: dict[str, Any]) -> None:
        total = self.codec.wire.grad
        if total is None:
            raise FTTreeError("sparse outer step without a summed wire vector")
        grads = self.codec.decode(total.detach(), self.step_count)
        for (_, g), d in zip(self._globals, grads, strict=True):
            g.grad = d

    def encode(self, pseudo: Sequence[torch.Tensor] | None, *, accumulate: bool = False) -> None:
        """This round's message; `pseudo=None` for an empty contribution. A worker still waiting
        for its state sends an empty one too (it is counted in nothing) and keeps no accumulator."""
        counted = pseudo is not None and self.sync.contribute and not self.syncing
        self.codec.encode(pseudo if counted else None, self.step_count, accumulate=accumulate)

    def settle(self) -> None:
        """After the sum: values of a worker the sum left out go back into its accumulator."""
        last = self.last_step
        if last is not None and self.sync.ar.rank not in last.contributors:
            self.codec.left_out()

