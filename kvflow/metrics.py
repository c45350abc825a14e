"""What a KV pool moved, and its Prometheus form (optional).

One source for each fact:

- :class:`TransferCounters`: running totals of one pool's user: lookups and their hit and missed
  tokens, blocks and bytes loaded and stored, failures by cause. Pure values.
- :class:`Observations`: one interval: the counters that changed in it, the seconds each lookup,
  load and store took, and whether the store was reachable. The vLLM connector sends one from
  every worker (and its scheduler) to vLLM's stats loggers; :class:`PoolMetrics` records one.
- :data:`CATALOGUE`: the metrics (name, kind, help, label, buckets). :class:`PoolMetrics` registers
  them with ``prometheus_client`` as ``kvflow_*`` for a custom engine; the vLLM connector registers
  the same ones through vLLM's per-connector hook as ``vllm:kvflow_*``, labelled like vLLM's own
  (``model_name``, ``engine``). docs/operations.md lists them with a sample scrape.

``prometheus_client`` is optional (``pip install 'kvflow[metrics]'``). Without it
:class:`PoolMetrics` records nothing (``enabled`` is False) and nothing raises.

A custom engine on a :class:`kvflow.KVPool`::

    metrics = PoolMetrics(labels={"model_name": "llama-3-8b"})  # prometheus_client's default registry
    pool = MeteredPool(await_created_pool, metrics)  # KVPool's store(_many), retrieve(_many), lookup
    result = await pool.store(KVRequest(tokens=prompt, block_ids=ids))
    # expose with prometheus_client.start_http_server(port) or your web framework

Objects here are not thread-safe: record from one thread (or one event loop).
"""

from __future__ import annotations

import enum
import importlib
import re
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import attrs

from kvflow.backends.base import GetStatus, PutStatus
from kvflow.errors import ConfigError, PoolClosedError, RequestError
from kvflow.ownership import owned
from kvflow.results import RetrieveResult, StoreResult

if TYPE_CHECKING:
    from kvflow.events import DeviceEvent
    from kvflow.pool import KVPool
    from kvflow.request import KVRequest

__all__ = [
    "CATALOGUE",
    "LATENCY_BUCKETS_S",
    "LOAD_FAILURE_CAUSES",
    "RESERVED_LABELS",
    "STORE_FAILURE_CAUSES",
    "LabelledMetrics",
    "MeteredPool",
    "MetricKind",
    "MetricSpec",
    "MetricWriter",
    "Observations",
    "PoolMetrics",
    "TransferCounters",
    "create_parents",
    "record",
]

#: Why blocks did not load: not in the store, the store failed on the object, the load as a whole
#: failed (timeout, store unreachable, an error).
LOAD_FAILURE_CAUSES = ("miss", "error", "aborted")
#: Why owned blocks were not stored: the store was full, the store failed, or a load of the same
#: step failed (their KV may rest on blocks that did not load).
STORE_FAILURE_CAUSES = ("no_space", "error", "load_failed")

LATENCY_BUCKETS_S = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)


@attrs.frozen
class TransferCounters:
    """What one pool's user moved since it started (or in one interval: :meth:`minus`).

    Lookups: ``lookups`` answered, ``lookup_hit_tokens`` found in the store and
    ``lookup_missed_tokens`` not, counting tokens of full blocks the engine did not hold itself.
    Loads: ``loaded_blocks``/``loaded_bytes`` arrived whole; ``load_missed_blocks`` were not in the
    store, ``load_error_blocks`` failed in the store, ``load_aborted_blocks`` belonged to a load
    that failed as a whole. Stores: ``stored_blocks``/``stored_bytes`` written by this rank,
    ``present_blocks`` already in the store, ``not_owned_blocks`` stored by another rank of this
    rank's replica group, ``store_no_space_blocks`` and ``store_error_blocks`` not written,
    ``dropped_save_blocks`` not stored because a load of the same step failed.
    """

    lookups: int = 0
    lookup_hit_tokens: int = 0
    lookup_missed_tokens: int = 0
    load_requests: int = 0
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    load_missed_blocks: int = 0
    load_error_blocks: int = 0
    load_aborted_blocks: int = 0
    store_requests: int = 0
    stored_blocks: int = 0
    stored_bytes: int = 0
    present_blocks: int = 0
    not_owned_blocks: int = 0
    store_no_space_blocks: int = 0
    store_error_blocks: int = 0
    dropped_save_blocks: int = 0

    @property
    def load_failed_blocks(self) -> int:
        """Blocks that did not load, whatever the cause (vLLM recomputes them)."""
        return self.load_missed_blocks + self.load_error_blocks + self.load_aborted_blocks

    @property
    def store_failed_blocks(self) -> int:
        """Owned blocks the store could not take (no space, a failure)."""
        return self.store_no_space_blocks + self.store_error_blocks

    def load_failures(self) -> dict[str, int]:
        """Blocks that did not load, by cause (:data:`LOAD_FAILURE_CAUSES`)."""
        return {
            "miss": self.load_missed_blocks,
            "error": self.load_error_blocks,
            "aborted": self.load_aborted_blocks,
        }

    def store_failures(self) -> dict[str, int]:
        """Blocks not stored, by cause (:data:`STORE_FAILURE_CAUSES`)."""
        return {
            "no_space": self.store_no_space_blocks,
            "error": self.store_error_blocks,
            "load_failed": self.dropped_save_blocks,
        }

    def with_lookup(self, hit_tokens: int, asked_tokens: int) -> TransferCounters:
        """One answered lookup: ``asked_tokens`` of full blocks asked for, ``hit_tokens`` found."""
        hit = max(0, min(hit_tokens, asked_tokens))
        return attrs.evolve(
            self,
            lookups=self.lookups + 1,
            lookup_hit_tokens=self.lookup_hit_tokens + hit,
            lookup_missed_tokens=self.lookup_missed_tokens + max(0, asked_tokens) - hit,
        )

    def with_load(self, result: RetrieveResult, block_nbytes: int = 0) -> TransferCounters:
        hits = sum(1 for s in result.statuses if s is GetStatus.HIT)
        missed = sum(1 for s in result.statuses if s is GetStatus.MISS)
        return attrs.evolve(
            self,
            load_requests=self.load_requests + 1,
            loaded_blocks=self.loaded_blocks + hits,
            loaded_bytes=self.loaded_bytes + hits * block_nbytes,
            load_missed_blocks=self.load_missed_blocks + missed,
            load_error_blocks=self.load_error_blocks + len(result.statuses) - hits - missed,
        )

    def with_failed_load(self, num_blocks: int) -> TransferCounters:
        return attrs.evolve(
            self,
            load_requests=self.load_requests + 1,
            load_aborted_blocks=self.load_aborted_blocks + num_blocks,
        )

    def with_store(self, result: StoreResult, block_nbytes: int = 0) -> TransferCounters:
        return attrs.evolve(
            self,
            store_requests=self.store_requests + 1,
            stored_blocks=self.stored_blocks + result.stored,
            stored_bytes=self.stored_bytes + result.stored * block_nbytes,
            present_blocks=self.present_blocks + result.present,
            not_owned_blocks=self.not_owned_blocks + result.not_owned,
            store_no_space_blocks=self.store_no_space_blocks + result.count(PutStatus.NO_SPACE),
            store_error_blocks=self.store_error_blocks + result.count(PutStatus.FAILED),
        )

    def with_failed_store(self, num_blocks: int) -> TransferCounters:
        return attrs.evolve(
            self,
            store_requests=self.store_requests + 1,
            store_error_blocks=self.store_error_blocks + num_blocks,
        )

    def with_dropped_saves(self, num_blocks: int) -> TransferCounters:
        return attrs.evolve(self, dropped_save_blocks=self.dropped_save_blocks + num_blocks)

    def fields(self) -> dict[str, int]:
        """The counted fields only (what :meth:`from_fields` takes back)."""
        return attrs.asdict(self)

    @classmethod
    def from_fields(cls, data: Mapping[str, object]) -> TransferCounters:
        """Counters from a mapping that holds (at least) some counted fields; other keys are ignored."""
        names = {a.name for a in attrs.fields(cls)}
        return cls(**{k: int(v) for k, v in data.items() if k in names and isinstance(v, int)})

    def as_dict(self) -> dict[str, int]:
        """The counted fields and the totals (``load_failed_blocks``, ``store_failed_blocks``)."""
        return {
            **self.fields(),
            "load_failed_blocks": self.load_failed_blocks,
            "store_failed_blocks": self.store_failed_blocks,
        }

    def plus(self, other: TransferCounters) -> TransferCounters:
        mine, theirs = self.fields(), other.fields()
        return TransferCounters(**{key: mine[key] + theirs[key] for key in mine})

    def minus(self, earlier: TransferCounters) -> TransferCounters:
        """The counts since ``earlier`` (a snapshot of the same counters)."""
        now, then = self.fields(), earlier.fields()
        return TransferCounters(**{key: now[key] - then[key] for key in now})

    @property
    def empty(self) -> bool:
        return not any(self.fields().values())


_SAMPLES = ("lookup_s", "load_s", "store_s")
_REACHABLE = "store_reachable"


def _floats(values: Iterable[float]) -> tuple[float, ...]:
    return tuple(float(v) for v in values)


def _states(values: Iterable[tuple[str, bool]]) -> tuple[tuple[str, bool], ...]:
    return tuple((str(client), bool(up)) for client, up in values)


@attrs.frozen
class Observations:
    """One interval of one or more pools' users.

    ``lookup_s``, ``load_s``, ``store_s``: seconds each lookup, load and store took.
    ``reachability``: ``(client, reachable)`` for each pool that reported, in this interval,
    whether it can reach its store (a client reports when that changes, not every interval).
    """

    counters: TransferCounters = TransferCounters()
    lookup_s: tuple[float, ...] = attrs.field(default=(), converter=_floats)
    load_s: tuple[float, ...] = attrs.field(default=(), converter=_floats)
    store_s: tuple[float, ...] = attrs.field(default=(), converter=_floats)
    reachability: tuple[tuple[str, bool], ...] = attrs.field(default=(), converter=_states)

    @property
    def store_reachable(self) -> bool | None:
        """Whether every client that reported can reach its store (None: none reported)."""
        return None if not self.reachability else all(up for _, up in self.reachability)

    @property
    def empty(self) -> bool:
        return self.counters.empty and not (self.lookup_s or self.load_s or self.store_s or self.reachability)

    def plus(self, other: Observations) -> Observations:
        return Observations(
            self.counters.plus(other.counters),
            self.lookup_s + other.lookup_s,
            self.load_s + other.load_s,
            self.store_s + other.store_s,
            self.reachability + other.reachability,
        )

    def to_data(self) -> dict[str, Any]:
        """Plain ints, lists of floats and a dict (vLLM serializes this between processes)."""
        data: dict[str, Any] = dict(self.counters.fields())
        data.update({name: list(getattr(self, name)) for name in _SAMPLES})
        data[_REACHABLE] = {client: int(up) for client, up in self.reachability}
        return data

    @classmethod
    def from_data(cls, data: Mapping[str, Any] | None) -> Observations:
        """The inverse of :meth:`to_data`; keys it does not know are ignored, missing ones are 0."""
        data = data or {}

        def samples(name: str) -> tuple[float, ...]:
            value = data.get(name)
            return tuple(float(v) for v in value) if isinstance(value, (list, tuple)) else ()

        states = data.get(_REACHABLE)
        reachability = [(str(k), bool(v)) for k, v in states.items()] if isinstance(states, dict) else []
        return cls(
            TransferCounters.from_fields(data),
            samples("lookup_s"),
            samples("load_s"),
            samples("store_s"),
            reachability,
        )


class MetricKind(enum.Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@attrs.frozen
class MetricSpec:
    """One metric: ``name`` without prefix (counters without ``_total``: Prometheus adds it), an
    extra ``label`` and its values, histogram ``buckets``."""

    name: str
    kind: MetricKind
    help: str
    label: str | None = None
    label_values: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


_C, _G, _H = MetricKind.COUNTER, MetricKind.GAUGE, MetricKind.HISTOGRAM

#: Every metric kvflow exports, in the order docs/operations.md lists them.
CATALOGUE: tuple[MetricSpec, ...] = (
    MetricSpec("lookups", _C, "Lookups answered (a request asked the store for its prefix)."),
    MetricSpec("lookup_hit_tokens", _C, "Tokens of full blocks a lookup found in the store."),
    MetricSpec("lookup_missed_tokens", _C, "Tokens of full blocks a lookup asked for and did not find."),
    MetricSpec("loaded_blocks", _C, "Blocks loaded from the store into the KV cache."),
    MetricSpec("loaded_bytes", _C, "Bytes loaded from the store into the KV cache."),
    MetricSpec("stored_blocks", _C, "Blocks written to the store (by the rank that owns them)."),
    MetricSpec("stored_bytes", _C, "Bytes written to the store."),
    MetricSpec("present_blocks", _C, "Blocks a store found already in the store (not written again)."),
    MetricSpec(
        "load_failed_blocks",
        _C,
        "Blocks that did not load (recomputed), by cause.",
        "cause",
        LOAD_FAILURE_CAUSES,
    ),
    MetricSpec(
        "store_failed_blocks",
        _C,
        "Blocks that were not stored, by cause.",
        "cause",
        STORE_FAILURE_CAUSES,
    ),
    MetricSpec(
        "lookup_seconds", _H, "Seconds from a lookup's start to its answer.", buckets=LATENCY_BUCKETS_S
    ),
    MetricSpec("load_seconds", _H, "Seconds a load took (one request's blocks).", buckets=LATENCY_BUCKETS_S),
    MetricSpec(
        "store_seconds", _H, "Seconds a store took (one request's blocks).", buckets=LATENCY_BUCKETS_S
    ),
    MetricSpec(
        "store_reachable",
        _G,
        "1 while the client can reach the KV store, 0 while it cannot (set when it changes).",
        "client",
    ),
)


class MetricWriter(Protocol):
    """Where :func:`record` writes: by metric name (no prefix) and extra label value."""

    def inc(self, name: str, amount: float, label: str | None = None) -> None: ...

    def observe(self, name: str, value: float) -> None: ...

    def set(self, name: str, value: float, label: str | None = None) -> None: ...


def record(observations: Observations, out: MetricWriter) -> None:
    """Write one interval into ``out``: counters incremented, samples observed, the gauge set."""
    c = observations.counters
    for name in ("lookups", "lookup_hit_tokens", "lookup_missed_tokens", "loaded_blocks", "loaded_bytes"):
        out.inc(name, getattr(c, name))
    for name in ("stored_blocks", "stored_bytes", "present_blocks"):
        out.inc(name, getattr(c, name))
    for cause, n in c.load_failures().items():
        out.inc("load_failed_blocks", n, cause)
    for cause, n in c.store_failures().items():
        out.inc("store_failed_blocks", n, cause)
    for name in ("lookup", "load", "store"):
        for seconds in getattr(observations, f"{name}_s"):
            out.observe(f"{name}_seconds", seconds)
    for client, up in observations.reachability:
        out.set("store_reachable", 1.0 if up else 0.0, client)


#: ``make(spec, full_name, labelnames)`` -> a prometheus_client-like metric with ``.labels()``.
MetricFactory = Callable[[MetricSpec, str, list[str]], Any]


@attrs.define(eq=False)
class LabelledMetrics:
    """The catalogue's metrics with fixed label values: a :class:`MetricWriter`.

    Made from parent metrics (one set per process, possibly shared by several engines) and this
    writer's label values. Every child with fixed label values (each cause) exists from the start,
    so a scrape shows those series at 0 before anything moved; a gauge's child per client appears
    with the client's first report.
    """

    _parents: Mapping[str, Any]
    _values: list[str]
    _children: dict[tuple[str, str | None], Any] = attrs.field(factory=dict)

    @classmethod
    def create(cls, parents: Mapping[str, Any], labelvalues: Sequence[object]) -> LabelledMetrics:
        metrics = cls(parents, [str(v) for v in labelvalues])
        for spec in CATALOGUE:
            for value in spec.label_values if spec.label else (None,):
                metrics._child(spec.name, value)
        return metrics

    def _child(self, name: str, label: str | None) -> Any:
        child = self._children.get((name, label))
        if child is None:
            values = [*self._values, *([label] if label is not None else [])]
            parent = self._parents[name]
            child = self._children[name, label] = parent.labels(*values) if values else parent
        return child

    def inc(self, name: str, amount: float, label: str | None = None) -> None:
        if amount:
            self._child(name, label).inc(amount)

    def observe(self, name: str, value: float) -> None:
        self._child(name, None).observe(value)

    def set(self, name: str, value: float, label: str | None = None) -> None:
        self._child(name, label).set(value)


#: Label names the catalogue's metrics use themselves (and ``le``, a histogram's buckets): a
#: user's label of that name would collide with them.
RESERVED_LABELS: frozenset[str] = frozenset({"le", *(spec.label for spec in CATALOGUE if spec.label)})


_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_METRIC_PREFIX = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)?")


def _check_labelnames(labelnames: Iterable[str]) -> None:
    """Refuse label names that Prometheus does not take (a client would rewrite them, and the
    queries written for them would find nothing) or that are also kvflow's own
    (:data:`RESERVED_LABELS`), with ConfigError."""
    bad = sorted(n for n in labelnames if not _LABEL_NAME.fullmatch(n) or n.startswith("__"))
    if bad:
        raise ConfigError(
            f"metric label name(s) {bad} are not Prometheus label names ([a-zA-Z_][a-zA-Z0-9_]*, not "
            "starting with __): rename them"
        )
    taken = sorted(RESERVED_LABELS.intersection(labelnames))
    if taken:
        raise ConfigError(
            f"metric label name(s) {taken} collide with the labels of kvflow's own metrics "
            f"(reserved: {sorted(RESERVED_LABELS)}): choose other label names"
        )


def create_parents(make: MetricFactory, prefix: str, labelnames: Sequence[str]) -> dict[str, Any]:
    """One parent metric per catalogue entry, named ``prefix + name``; ConfigError for a label
    name that is kvflow's own (:data:`RESERVED_LABELS`) or not a Prometheus name, and for a prefix
    that does not make Prometheus metric names."""
    if not _METRIC_PREFIX.fullmatch(prefix):
        raise ConfigError(
            f"metric prefix {prefix!r} does not make Prometheus metric names ([a-zA-Z_:][a-zA-Z0-9_:]*): "
            "use letters, digits, _ and :"
        )
    _check_labelnames(labelnames)
    parents = {}
    for spec in CATALOGUE:
        names = [*labelnames, *([spec.label] if spec.label else [])]
        parents[spec.name] = make(spec, prefix + spec.name, names)
    return parents


#: Parent metrics made in each registry, by prefix and label names: a registry takes a name once.
_PARENTS: weakref.WeakKeyDictionary[Any, dict[tuple[str, tuple[str, ...]], dict[str, Any]]] = (
    weakref.WeakKeyDictionary()
)


def _prometheus_client() -> Any | None:
    try:
        return importlib.import_module("prometheus_client")
    except ImportError:
        return None


def _register(registry: Any, make: MetricFactory, prefix: str, labelnames: list[str]) -> dict[str, Any]:
    """:func:`create_parents` in ``registry``, all or nothing: prometheus_client refusing one (a
    name the registry already holds from outside kvflow, a label name it does not take) is a
    ConfigError, and none of kvflow's metrics stay registered."""
    made: list[Any] = []

    def make_one(spec: MetricSpec, name: str, names: list[str]) -> Any:
        made.append(make(spec, name, names))
        return made[-1]

    try:
        return create_parents(make_one, prefix, labelnames)
    except ConfigError:
        raise
    except ValueError as exc:  # prometheus_client: "Duplicated timeseries in CollectorRegistry"
        for metric in made:
            registry.unregister(metric)
        raise ConfigError(
            f"cannot register kvflow's {prefix}* metrics with label names {labelnames}: {exc}. If "
            "another metric in this registry already uses the name, pass another registry= or "
            "prefix= to PoolMetrics"
        ) from exc


@attrs.define(eq=False, init=False)
class PoolMetrics:
    """kvflow's metrics in a ``prometheus_client`` registry (the default one unless ``registry``),
    named ``prefix + name`` and labelled with ``labels``. Without prometheus_client, a no-op.

    Several (one per model, say) share a registry when they have the same label names: they
    share its metrics, each writing its own label values. Other label names under the same
    prefix in one registry, a label name kvflow uses itself (:data:`RESERVED_LABELS`), or
    names the registry already holds from elsewhere raise ConfigError.
    """

    enabled: bool
    _writer: LabelledMetrics | None

    def __init__(
        self,
        *,
        labels: Mapping[str, str] | None = None,
        registry: Any = None,
        prefix: str = "kvflow_",
    ) -> None:
        client = _prometheus_client()
        self.enabled = client is not None
        self._writer = None
        if client is None:
            return
        labels = dict(labels or {})
        target = registry if registry is not None else client.REGISTRY

        def make(spec: MetricSpec, name: str, labelnames: list[str]) -> Any:
            if spec.kind is MetricKind.COUNTER:
                return client.Counter(name, spec.help, labelnames, registry=target)
            if spec.kind is MetricKind.GAUGE:
                return client.Gauge(name, spec.help, labelnames, registry=target)
            return client.Histogram(name, spec.help, labelnames, registry=target, buckets=spec.buckets)

        shared = _PARENTS.setdefault(target, {})
        key = (prefix, tuple(sorted(labels)))
        if key not in shared:
            _check_labelnames(labels)
            others = [names for p, names in shared if p == prefix]
            if others:
                raise ConfigError(
                    f"PoolMetrics with label names {sorted(labels)}: this registry already holds "
                    f"kvflow's {prefix}* metrics with label names {list(others[0])}; label names must "
                    "match within a registry and prefix: use the same names, or another registry= "
                    "or prefix="
                )
            shared[key] = _register(target, make, prefix, sorted(labels))
        self._writer = LabelledMetrics.create(shared[key], [labels[name] for name in sorted(labels)])

    def record(self, observations: Observations) -> None:
        """Add one interval (counters are deltas)."""
        if self._writer is not None:
            record(observations, self._writer)

    def looked_up(self, hit_tokens: int, asked_tokens: int, seconds: float) -> None:
        self.record(
            Observations(TransferCounters().with_lookup(hit_tokens, asked_tokens), lookup_s=(seconds,))
        )

    def loaded(
        self, result: RetrieveResult | None, num_blocks: int, seconds: float, block_nbytes: int
    ) -> None:
        """A load of ``num_blocks`` (``result`` None: it failed as a whole)."""
        counters = TransferCounters()
        counters = (
            counters.with_failed_load(num_blocks)
            if result is None
            else counters.with_load(result, block_nbytes)
        )
        self.record(Observations(counters, load_s=(seconds,)))

    def stored(self, result: StoreResult | None, num_blocks: int, seconds: float, block_nbytes: int) -> None:
        """A store of ``num_blocks`` (``result`` None: it failed as a whole)."""
        counters = TransferCounters()
        counters = (
            counters.with_failed_store(num_blocks)
            if result is None
            else counters.with_store(result, block_nbytes)
        )
        self.record(Observations(counters, store_s=(seconds,)))

    def set_reachable(self, reachable: bool, client: str = "pool") -> None:
        self.record(Observations(reachability=[(client, reachable)]))


#: What the pool raises for a call it refused before anything moved (a bad request or timeout, a
#: closed pool): :class:`MeteredPool` counts nothing for it.
_REFUSED = (RequestError, ConfigError, PoolClosedError)


@attrs.define(eq=False)
class MeteredPool:
    """A :class:`kvflow.KVPool` whose ``lookup``, ``store``, ``store_many``, ``retrieve`` and
    ``retrieve_many`` are recorded in ``metrics``; they take the pool's arguments and return its
    results. Call it from the pool's event loop; it owns nothing (close the pool yourself).

    A call the pool refuses before anything moved (RequestError, ConfigError, PoolClosedError)
    counts nothing. A store or load that raises anything else, or is cancelled, counts as failed
    as a whole (a store: the blocks this rank owns; a load: all its blocks), with its seconds, and
    the exception or cancellation goes on. ``store_many`` and ``retrieve_many`` record each request
    as ``store`` and ``retrieve`` do, each with the call's seconds.
    """

    pool: KVPool
    metrics: PoolMetrics

    async def lookup(self, request: KVRequest, *, timeout_s: float | None = None) -> int:
        started = time.monotonic()
        hit = await self.pool.lookup(request, timeout_s=timeout_s)
        block = self.pool.format.block_size
        if request.block_hashes is not None:  # one per hash_tokens tokens
            full = len(request.block_hashes) * (self.pool.config.hash_tokens or block) // block
        else:
            full = len(request.tokens or ()) // block
        held = request.block_offset * block
        self.metrics.looked_up(hit - held, full * block - held, time.monotonic() - started)
        return hit

    async def store(
        self,
        request: KVRequest,
        *,
        after: DeviceEvent | None = None,
        on_released: Callable[[], None] | None = None,
        timeout_s: float | None = None,
    ) -> StoreResult:
        """:meth:`kvflow.KVPool.store`, recorded."""
        results = await self.store_many([request], after=after, on_released=on_released, timeout_s=timeout_s)
        return results[0]

    async def store_many(
        self,
        requests: Sequence[KVRequest],
        *,
        after: DeviceEvent | None = None,
        on_released: Callable[[], None] | None = None,
        timeout_s: float | None = None,
    ) -> list[StoreResult]:
        """:meth:`kvflow.KVPool.store_many`, each request recorded."""
        started = time.monotonic()
        try:
            results = await self.pool.store_many(
                requests, after=after, on_released=on_released, timeout_s=timeout_s
            )
        except _REFUSED:  # refused before anything moved: no store failed
            raise
        except BaseException:  # an error or a cancellation: blocks may have moved, none is known stored
            seconds = time.monotonic() - started
            for request in requests:
                self.metrics.stored(None, self._owned_blocks(request), seconds, 0)
            raise
        seconds, nbytes = time.monotonic() - started, self._block_nbytes()
        for request, result in zip(requests, results):
            self.metrics.stored(result, self._owned_blocks(request), seconds, nbytes)
        return results

    async def retrieve(
        self, request: KVRequest, *, after: DeviceEvent | None = None, timeout_s: float | None = None
    ) -> RetrieveResult:
        """:meth:`kvflow.KVPool.retrieve`, recorded."""
        return (await self.retrieve_many([request], after=after, timeout_s=timeout_s))[0]

    async def retrieve_many(
        self,
        requests: Sequence[KVRequest],
        *,
        after: DeviceEvent | None = None,
        timeout_s: float | None = None,
    ) -> list[RetrieveResult]:
        """:meth:`kvflow.KVPool.retrieve_many`, each request recorded."""
        started = time.monotonic()
        try:
            results = await self.pool.retrieve_many(requests, after=after, timeout_s=timeout_s)
        except _REFUSED:  # refused before anything moved: no load failed
            raise
        except BaseException:  # an error or a cancellation: blocks may have been written, none is known
            seconds = time.monotonic() - started
            for request in requests:
                self.metrics.loaded(None, len(request.block_ids), seconds, 0)
            raise
        seconds, nbytes = time.monotonic() - started, self._block_nbytes()
        for request, result in zip(requests, results):
            self.metrics.loaded(result, len(request.block_ids), seconds, nbytes)
        return results

    def _owned_blocks(self, request: KVRequest) -> int:
        """How many of the request's blocks this rank stores (another rank of its replica group
        stores the rest), as a store that works counts them."""
        return len(owned(range(request.block_offset, request.end_block), self.pool.parallel))

    def _block_nbytes(self) -> int:
        layout = self.pool.layout
        return 0 if layout is None else layout.block_nbytes
