"""One configuration object with one set of defaults, from the API down to the protocol.

`FTTreeAllreduce(rank, peers, **fields)`, the CLI, the backend's environment variables and the
simulator all build a `Config`; the node, the transport and the state machine read theirs from
it. Durations are seconds, as floats, and their names end in `_s`; sizes are bytes.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .limits import DEFAULT_MAX_PAYLOAD_BYTES
from .timeouts import AdaptiveTimeouts, StaticTimeouts, TimeoutPolicy
from .trees import check_family

TIMEOUT_POLICIES = ("static", "adaptive")
NODE_FAILURE_POLICIES = ("forward", "abort", "rollback")
COMPRESSIONS = (None, "bf16", "fp16", "int8")
NONFINITE_POLICIES = ("skip", "abort", "allow")
STRAGGLER_POLICIES = ("wait", "deadline")

# Settings that must be the same on every worker of a job: they decide how a step is cut into
# chunks and trees, what travels on the wire, or what a failure does to the steps in flight
# (a difference fails steps, or ends them differently on different ranks). The credentials
# must match in content: the same key, certificates of the same CA.
SAME_ON_EVERY_WORKER = frozenset({"trees", "chunk_bytes", "uplink_bytes_per_s", "uplinks_by_rank", "compression",
                                  "fault_tolerant", "straggler_policy", "straggler_grace_s", "max_late",
                                  "on_node_failure", "auth_key_file", "tls_ca_file", "tls_dir"})



@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """Every tunable of a worker. Defaults suit a LAN or loopback and slow edge links alike;
    read docs/bandwidth.md before changing the timeouts (docs/configuration.md lists them all)."""

    # Each setting's comment (beside it, or the block just above) is its line in the generated
    # docs/configuration.md; a "--" comment heads a group and belongs to no setting.

    # -- backup watches: how long an observer waits for a confirmation before it acts
    timeout_s: float = 0.5  # the fixed watch (static), or the first guess before samples (adaptive)
    timeout_policy: str = "adaptive"  # "adaptive": learnt per link and phase (timeouts.py); "static"
    adaptive_floor_s: float = 0.08  # the shortest watch the adaptive policy learns
    adaptive_ceiling_s: float = 2.0  # the longest watch the adaptive policy learns
    watch_retries: int = 2  # re-arm a watch this many times after acting on it
    fault_tolerant: bool = True  # False: a plain tree without metadata or backups (a baseline)

    # -- deadlines: nothing waits forever
    step_timeout_s: float = 30.0  # a rank gives up on a step this long after submitting it
    root_timeout_s: float | None = None  # the root gives up on contributions (default: step_timeout_s / 2)
    # the step and root deadlines are put off, by at most this long, while a member that has not
    # submitted the step yet says it is alive and computing (a slow device is not a failure)
    submit_wait_s: float = 300.0

    # -- link memory
    # route later steps around a primary link found broken, until it heals (False: every step
    # detects the broken link anew, as in the thesis)
    link_memory: bool = True
    probe_interval_s: float = 0.1  # how often a link routed around is probed
    heal_after_s: float = 0.5  # answered probes for this long before reuse; doubled per relapse
    max_heal_after_s: float = 30.0  # the longest heal_after_s grows to

    # -- node failures (membership.py): a silent or unreachable worker is evicted and the group goes on
    on_node_failure: str = "forward"  # steps in flight: "forward" (finish on the survivors), "abort", "rollback"
    node_deadline_s: float = 1.0  # least silence that suspects a neighbour (more when watches learnt longer)
    confirm_wait_s: float = 0.25  # a suspicion must stand this long, unrefuted, before an eviction

    # -- stragglers: a worker that computes slowly (docs/failures.md, "Stragglers")
    # "wait": every step waits for every member. "deadline": once at most max_late of a tree
    # root's inputs (its own contribution, its children's sums) are missing, it closes the step
    # straggler_grace_s past the median arrival of the others; the late ranks take part with
    # zeros, are named in the result's `late`, are not counted and stay members (no rank is
    # evicted for being slow). Only closable steps close so (gradient buckets: submit_array)
    straggler_policy: str = "wait"
    straggler_grace_s: float = 0.1  # how long past the median input a root waits for the late ones
    max_late: int = 1  # a root closes a step without at most this many of its inputs

    # -- data path
    # a step travels as chunks of at most this size, pipelined through the tree (a step larger
    # than one chunk: in at least SPLIT_CHUNKS pieces, see chunk_bytes_for)
    chunk_bytes: int = 4 * 1024 * 1024
    # which trees a step of two or more chunks spreads them over (trees.py): "rotated" (p trees,
    # each rank sends the ring's 2N(p-1)/p), "double" (the double binary tree, 2N) or "single"
    # (3N on interior ranks); a one-chunk step always runs on tree 0
    trees: str = "rotated"
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES  # a frame announcing more is refused (at least chunk_bytes)
    # a contribution holding NaN or Inf: "skip" (this rank contributes nothing to that step, which
    # the result's contributors show, and a note names it), "abort" (the step fails on every rank,
    # naming this one) or "allow" (added as it is: every rank's result is NaN)
    nonfinite: str = "skip"
    # add the children's subtree sums in slot order, holding one that comes early (True: the same
    # bits on every run; False: each as it comes, which can change the last bits from run to run)
    ordered_sums: bool = True
    # float32 data on the wire: None (as is), "bf16" or "fp16" (half the bytes) or "int8" (a quarter
    # and a float32 scale per 256 values); every hop decodes, adds in float32 and encodes again;
    # every rank gets the root's decoded result bit for bit
    compression: str | None = None
    # a hint, never needed: the uplink speed a worker assumes, in bytes per second, until it has
    # measured its own (backup watches) and the group has agreed on a pace (how steps are cut
    # into chunks, membership.py)
    uplink_bytes_per_s: float = 50e6
    # declared uplinks of some ranks, bytes per second ({3: 1.25e6}, or "3=1.25e6,5=6.25e6"; the
    # others at uplink_bytes_per_s): when they differ, the rotated trees' shares of a step follow
    # them, so slow ranks become leaves (core/shares.py); without it the shares follow the
    # uplinks the workers measure, once the view holds them (docs/bandwidth.md)
    uplinks_by_rank: tuple[tuple[int, float], ...] = ()
    # a rank whose uplink (declared, or else measured and held by the view) is below this many
    # bytes per second sends its sums up as bf16: half its bytes, so only slow links pay the
    # precision cost (the next hop adds in float32; results travel as the root made them, alike
    # everywhere). 0: off
    bf16_uplinks_below: float = 0.0

    # -- bookkeeping bounds (nothing grows with the number of steps run)
    max_ops_ahead: int = 4096  # a peer may run this many steps ahead of our last submit
    retired_memory: int = 8192  # ids of finished ops remembered to drop their late messages
    # -- bounds that bad input from a peer cannot push memory past (none is hit by a 100 MB model)
    max_step_chunks: int = 65536  # a frame naming a step of more chunks is refused
    max_live_ops: int = 65536  # (step, chunk) ops kept at once; a frame that would make more is dropped
    receive_pool_bytes: int = 512 * 1024 * 1024  # received payload buffers kept for reuse, at most

    # -- trust boundary (docs/security.md)
    # the job's shared key, read from this file by every worker (`fttree key --out FILE`);
    # without a key or TLS, only loopback addresses unless `insecure`
    auth_key_file: str | os.PathLike[str] | None = None
    insecure: bool = False  # run without a credential on addresses others can reach
    # mutual TLS, every connection encrypted: this rank's certificate (its rank in a URI SAN,
    # urn:fttree:rank:R), with tls_key_file and tls_ca_file
    tls_cert_file: str | os.PathLike[str] | None = None
    tls_key_file: str | os.PathLike[str] | None = None  # this rank's TLS private key
    tls_ca_file: str | os.PathLike[str] | None = None  # the job CA's certificate: peers must show one it signed
    # instead of the three files: a folder made by `fttree certs` holding ca.pem, rank-N.pem and
    # rank-N.key for this worker's rank N (ca.key need not be there)
    tls_dir: str | os.PathLike[str] | None = None
    handshake_timeout_s: float = 10.0  # a connection proves the key this soon, or is closed
    # outsiders' connections not proven yet, at most (from addresses no rank listens on, 4 from
    # one; a flood is refused beyond, and members' addresses have places of their own; with TLS
    # a quarter of it are in their TLS handshake at once)
    max_pending_handshakes: int = 64

    # -- transport
    startup_timeout_s: float = 60.0  # wait this long for the tree neighbours at start
    connect_timeout_s: float = 2.0  # one attempt to connect to a peer gives up after this long
    stall_timeout_s: float = 5.0  # a link whose writes stall this long is dropped and reconnected
    # two ranks behind different NATs try a TCP hole punch, coordinated by a public rank, and
    # stop relaying their frames if it connects (docs/nat.md)
    hole_punch: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "uplinks_by_rank", _rank_rates(self.uplinks_by_rank))
        self._check_numbers()
        self._check_choices()
        self._check_credentials()

    def _check_numbers(self) -> None:
        """Rates and durations positive, counts positive integers, and bounds that fit together."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_per_s"):
                if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                    raise ConfigError(f"{f.name} must be a positive number of bytes per second, got {value!r}")
            elif f.name.endswith("_s") and value is not None and not (isinstance(value, int | float) and value > 0):
                raise ConfigError(f"{f.name} must be a positive number of seconds, got {value!r}")
        if self.adaptive_floor_s > self.adaptive_ceiling_s:
            raise ConfigError(f"adaptive_floor_s ({self.adaptive_floor_s}) is above adaptive_ceiling_s "
                              f"({self.adaptive_ceiling_s})")
        for name in ("chunk_bytes", "max_payload_bytes", "max_ops_ahead", "retired_memory", "max_pending_handshakes",
                     "max_step_chunks", "max_live_ops", "receive_pool_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.max_payload_bytes < self.chunk_bytes:
            raise ConfigError(f"max_payload_bytes ({self.max_payload_bytes}) is below chunk_bytes "
                              f"({self.chunk_bytes}): a chunk could not be received")
        below = self.bf16_uplinks_below
        if isinstance(below, bool) or not isinstance(below, int | float) or below < 0:
            raise ConfigError(f"bf16_uplinks_below must be a rate in bytes per second, or 0 (off), got {below!r}")
        if not isinstance(self.max_late, int) or isinstance(self.max_late, bool) or self.max_late < 1:
            raise ConfigError(f"max_late must be a positive integer, got {self.max_late!r}")
        if not isinstance(self.watch_retries, int) or self.watch_retries < 0:
            raise ConfigError(f"watch_retries must be a non-negative integer, got {self.watch_retries!r}")

    def _check_choices(self) -> None:
        """Settings that name one of a few policies or formats."""
        if self.on_node_failure not in NODE_FAILURE_POLICIES:
            raise ConfigError(f"on_node_failure must be one of {', '.join(NODE_FAILURE_POLICIES)}, "
                              f"got {self.on_node_failure!r}")
        if self.nonfinite not in NONFINITE_POLICIES:
            raise ConfigError(f"nonfinite must be one of {', '.join(NONFINITE_POLICIES)}, got {self.nonfinite!r}")
        if self.straggler_policy not in STRAGGLER_POLICIES:
            raise ConfigError(f"straggler_policy must be one of {', '.join(STRAGGLER_POLICIES)}, "
                              f"got {self.straggler_policy!r}")
        if self.compression not in COMPRESSIONS:
            raise ConfigError(f"compression must be None, 'bf16', 'fp16' or 'int8', got {self.compression!r}")
        if self.timeout_policy not in TIMEOUT_POLICIES:
            raise ConfigError(f"timeout_policy must be 'static' or 'adaptive', got {self.timeout_policy!r}")
        check_family(self.trees)

    def _check_credentials(self) -> None:
        """Paths are paths, and TLS comes as a folder or as all three files."""
        if self.auth_key_file is not None and not isinstance(self.auth_key_file, str | os.PathLike):
            raise ConfigError(f"auth_key_file must be a path, got {self.auth_key_file!r}")
        tls_files = {"tls_cert_file": self.tls_cert_file, "tls_key_file": self.tls_key_file,
                     "tls_ca_file": self.tls_ca_file}
        for name, value in [*tls_files.items(), ("tls_dir", self.tls_dir)]:
            if value is not None and not isinstance(value, str | os.PathLike):
                raise ConfigError(f"{name} must be a path, got {value!r}")
        given = [name for name, value in tls_files.items() if value is not None]
        if given and len(given) < 3:
            raise ConfigError(f"TLS needs tls_cert_file, tls_key_file and tls_ca_file together; only "
                              f"{', '.join(given)} given")
        if given and self.tls_dir is not None:
            raise ConfigError("give tls_dir or the three tls_*_file settings, not both")
        if not isinstance(self.insecure, bool):
            raise ConfigError(f"insecure must be True or False, got {self.insecure!r}")

    @classmethod
    def build(cls, config: Config | None = None, **fields: Any) -> Config:
        """`config` (or the defaults) with `fields` replaced; an unknown field is a ConfigError
        naming it and the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ConfigError(f"unknown setting{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                              f"known: {', '.join(sorted(known))}")
        return dataclasses.replace(config or cls(), **fields)

    def uplink_of(self, rank: int) -> float:
        """The declared uplink of `rank`, bytes per second."""
        return dict(self.uplinks_by_rank).get(rank, self.uplink_bytes_per_s)

    @property
    def slowest_declared(self) -> float:
        """The slowest uplink `uplinks_by_rank` declares (inf: none): a step's bytes may need
        that long, so deadlines allow for it."""
        return min((rate for _, rate in self.uplinks_by_rank), default=float("inf"))

    @property
    def root_give_up_s(self) -> float:
        return self.root_timeout_s if self.root_timeout_s is not None else self.step_timeout_s / 2

    @property
    def linger_s(self) -> float:
        """How long a finished op is kept to serve late observers: long enough for its watches to
        settle at the first-guess timeout. Not the adaptive ceiling: finished ops hold tensor
        buffers, and keeping 100 MB steps for 8 s measurably slowed big allreduces."""
        return (self.watch_retries + 2) * self.timeout_s

    def chunk_bytes_for(self, nbytes: int, pace: float = 0.0) -> int:
        """The chunk size of a step of `nbytes` at the view's `pace` (the rule: chunking.py)."""
        from .chunking import chunk_bytes  # chunking reads this class's fields

        return chunk_bytes(self, nbytes, pace)

    @classmethod
    def env_name(cls, field_name: str) -> str:
        """The environment variable of a field: FTTREE_ and its name in capitals, without the
        `_s` of seconds (step_timeout_s: FTTREE_STEP_TIMEOUT)."""
        seconds = field_name.endswith("_s") and not field_name.endswith("_per_s")
        base = field_name[:-2] if seconds else field_name
        return f"FTTREE_{base.upper()}"

    @classmethod
    def parse(cls, field_name: str, text: str) -> Any:
        """A field's value from text (a command line's NAME=VALUE, an environment variable),
        by the field's type: numbers, true/false, "none" for an optional field."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        found = fields.get(field_name)
        if found is None:
            raise ConfigError(f"unknown setting {field_name}; known: {', '.join(sorted(fields))}")
        kind = str(found.type)
        word = text.strip()
        if "None" in kind and word.lower() in ("", "none"):
            return None
        if kind.startswith("tuple[tuple[int, float]"):
            return _rank_rates(word)
        try:
            if kind.startswith("bool"):
                if word.lower() not in ("1", "0", "true", "false", "yes", "no"):
                    raise ValueError(word)
                return word.lower() in ("1", "true", "yes")
            if kind.startswith("int"):
                return int(word)
            if kind.startswith("float"):
                return float(word)
        except ValueError:
            raise ConfigError(f"{field_name} must be {kind.split(' |')[0]}, got {text!r}") from None
        return word

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> dict[str, Any]:
        """The fields the environment sets (each field's env_name), parsed; a bad value is a
        ConfigError naming the variable."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            text = environ.get(cls.env_name(f.name))
            if text:
                try:
                    out[f.name] = cls.parse(f.name, text)
                except ConfigError as exc:
                    raise ConfigError(f"{cls.env_name(f.name)}: {exc}") from None
        return out

    def make_timeouts(self) -> TimeoutPolicy:
        if self.timeout_policy == "adaptive":
            return AdaptiveTimeouts(initial_s=self.timeout_s, floor_s=self.adaptive_floor_s,
                                    ceiling_s=self.adaptive_ceiling_s)
        return StaticTimeouts(self.timeout_s)


def _rank_rates(value: object) -> tuple[tuple[int, float], ...]:
    """Per-rank rates from a mapping, pairs, or text "RANK=BYTES_PER_S,...", sorted by rank."""
    if isinstance(value, str):
        pairs: list[tuple[object, object]] = []
        for part in (p.strip() for p in ("" if value.strip() in ("()", "none") else value).split(",")):
            if part:
                key, eq, text = part.partition("=")
                if not eq:
                    raise ConfigError(f"uplinks_by_rank: {part!r} is not RANK=BYTES_PER_S")
                pairs.append((key.strip(), text.strip()))
    elif isinstance(value, Mapping):
        pairs = list(value.items())
    else:
        pairs = list(value)  # type: ignore[call-overload]
    out: dict[int, float] = {}
    for rank, rate in pairs:
        try:
            r, b = int(str(rank)), float(str(rate))
        except ValueError:
            raise ConfigError(f"uplinks_by_rank: rank {rank!r} must be an integer and rate {rate!r} a number of "
                              f"bytes per second") from None
        if r < 0 or not b > 0:
            raise ConfigError(f"uplinks_by_rank: rank {r} must not be negative and its rate {b!r} must be positive")
        out[r] = b
    return tuple(sorted(out.items()))
