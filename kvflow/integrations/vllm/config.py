"""The connector's settings, read from vLLM's ``kv_connector_extra_config``.

Pure: imports neither vLLM nor torch, so it can be checked before an engine starts::

    ConnectorConfig.from_extra_config({"backend": "local://", "model_id": "llama-3-8b"})

Keys (all optional; docs/vllm.md has the same table with examples):

``backend``             store URL; default ``local://`` (``/dev/shm/kvflow-<uid>``, private to the
                        user running vLLM: docs/security.md). ``memory://`` is refused: the
                        scheduler side and the workers are separate objects (and usually processes),
                        so they could never see each other's blocks.
``lookup_backend``      store URL the scheduler side looks up in; default ``backend``. For Mooncake,
                        the same master with ``segment=0``, so the scheduler process lends no memory.
``model_id``            the model name in every key; default vLLM's ``served_model_name``. Set it to
                        share a store between engines that load the same weights from different paths.
``load_async``          load hits between engine steps (vLLM's asynchronous loading) instead of
                        before the step's forward. Default: true when vLLM schedules asynchronously
                        (its default), false otherwise: :func:`sync_load_warning` says why.
``load_early``          start a step's loads when vLLM hands the step to the worker
                        (``handle_preemptions``), so they run while vLLM prepares the step's inputs:
                        ``auto`` (default), ``true`` or ``false``. ``auto`` does unless kvflow runs
                        inside another connector and is not the last child of a ``MultiConnector``,
                        whose later children may still read the reused blocks there
                        (:mod:`.wrapping`).
``layerwise``           one object per block and layer: stores put each layer as soon as the forward
                        wrote it, loads fetch layer l+1 while layer l computes (default false). A
                        store written in one mode is not seen by the other.
``layerwise_depth``     layers a layerwise load keeps in flight ahead of the forward (default 2).
``timeout_s``           bound of each store and retrieve (default 30).
``lookup_timeout_s``    bound of one lookup (default 2); on timeout or error the request is computed
                        as if nothing were cached.
``lookup_wait_s``       how long, per engine step, the scheduler thread may wait for lookups before
                        telling vLLM "ask again next step" (default 0.05); lookups keep running.
``load_wait_s``         with ``load_async``: how long, per engine step, a worker may wait for a pending
                        load to end before reporting the step (default 0.002). While a request waits
                        for its load vLLM runs steps back to back; without this wait they hold the
                        GIL and starve kvflow's loop thread (docs/benchmarks.md). 0: never wait.
``load_idle_wait_s``    the same in a step that computes nothing (every request waits): up to this
                        long for the first pending load to end (default 0.05), so that a request
                        whose load ends within it runs in the next step instead of one later. A new
                        request arriving meanwhile waits as long.
``max_inflight_bytes``  bytes in backend calls at once per process (size text or int; default 1GiB).
``save_decode_blocks``  also store blocks completed while decoding (default false: prompt blocks only).
``staging``             move blocks through host staging buffers: ``auto`` (a GPU/NPU cache over a
                        backend that cannot reach device memory), ``always``, ``never`` (default auto).
``staging_bytes``       the staging buffers of each worker (size text or int; default 256MiB).

Two settings come from vLLM's own configuration, not from the extra config: ``role``
(``kv_transfer_config.kv_role``: a ``kv_producer`` stores and never looks up or loads, a
``kv_consumer`` looks up and loads and never stores, ``kv_both`` does both) and ``kv_events``
(``kv_events_config.enable_kv_cache_events``: report the blocks it stores to KV-aware routers).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from typing import Any

import attrs

from kvflow.config import PoolConfig, parse_size, split_url
from kvflow.errors import ConfigError

__all__ = ["DEFAULT_BACKEND", "ConnectorConfig", "KVRole", "sync_load_warning", "weak_hash_warning"]

DEFAULT_BACKEND = "local://"

_MAX_SECONDS = 86400.0  # a wait or bound longer than a day is a mistake (and overflows some waits)
_FLOATS = ("timeout_s", "lookup_timeout_s", "lookup_wait_s", "load_wait_s", "load_idle_wait_s")
_FLAGS = ("load_async", "layerwise", "save_decode_blocks")
_TEXTS = ("backend", "lookup_backend", "model_id", "staging")
_SETTINGS = ("load_early",)  # auto, true or false (true and false also as booleans)
_SIZES = ("max_inflight_bytes", "staging_bytes")
_KEYS = frozenset({*_FLOATS, *_FLAGS, *_TEXTS, *_SETTINGS, *_SIZES, "layerwise_depth"})


def _positive(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if value <= 0:
        raise ConfigError(f"kv_connector_extra_config[{attribute.name!r}] must be > 0, got {value}")


def _not_negative(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if value < 0:
        raise ConfigError(f"kv_connector_extra_config[{attribute.name!r}] must be >= 0, got {value}")


def _positive_int(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value <= 0:
        raise ConfigError(f"kv_connector_extra_config[{attribute.name!r}] must be > 0, got {value}")


def _choice(*choices: str) -> Any:
    def check(_: object, attribute: attrs.Attribute[str], value: str) -> None:
        if value not in choices:
            allowed = ", ".join(choices)
            key = f"kv_connector_extra_config[{attribute.name!r}]"
            raise ConfigError(f"{key} must be one of {allowed}, got {value!r}")

    return check


def _shared_backend(_: object, attribute: attrs.Attribute[str], url: str) -> None:
    scheme = split_url(url).scheme
    if scheme == "memory":
        raise ConfigError(
            f"kv_connector_extra_config[{attribute.name!r}] is memory://, which vLLM's scheduler and "
            f"workers cannot share; use a shared store such as {DEFAULT_BACKEND} or mooncake://host:port"
        )
    if not scheme:
        raise ConfigError(f"kv_connector_extra_config[{attribute.name!r}] must be a URL, got {url!r}")


class KVRole(enum.Enum):
    """vLLM's ``kv_role``: what this engine does with the store."""

    BOTH = "kv_both"
    PRODUCER = "kv_producer"  # a prefill engine: stores, never looks up or loads
    CONSUMER = "kv_consumer"  # a decode engine: looks up and loads, never stores

    @property
    def stores(self) -> bool:
        return self is not KVRole.CONSUMER

    @property
    def loads(self) -> bool:
        return self is not KVRole.PRODUCER

    @classmethod
    def of(cls, kv_role: str | None) -> KVRole:
        """vLLM's ``kv_role`` (None, as vLLM allows without a connector, means ``kv_both``)."""
        if kv_role is None:
            return cls.BOTH
        try:
            return cls(kv_role)
        except ValueError:
            allowed = ", ".join(repr(r.value) for r in cls)
            raise ConfigError(
                f"kv_role must be one of {allowed} for KVFlowConnector, got {kv_role!r}"
            ) from None


@attrs.frozen
class ConnectorConfig:
    """What the vLLM connector was told to do. Build it with :meth:`from_extra_config`."""

    backend: str = attrs.field(default=DEFAULT_BACKEND, validator=_shared_backend)
    lookup_backend: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(_shared_backend)
    )
    model_id: str | None = None
    load_async: bool = False
    load_early: str = attrs.field(default="auto", validator=_choice("auto", "true", "false"))
    layerwise: bool = False
    layerwise_depth: int = attrs.field(default=2, validator=_positive_int)
    timeout_s: float = attrs.field(default=30.0, validator=_positive)
    lookup_timeout_s: float = attrs.field(default=2.0, validator=_positive)
    lookup_wait_s: float = attrs.field(default=0.05, validator=_positive)
    load_wait_s: float = attrs.field(default=0.002, validator=_not_negative)
    load_idle_wait_s: float = attrs.field(default=0.05, validator=_not_negative)
    max_inflight_bytes: int = attrs.field(default=1 << 30, validator=_positive_int)
    save_decode_blocks: bool = False
    staging: str = attrs.field(default="auto", validator=_choice("auto", "always", "never"))
    staging_bytes: int = attrs.field(default=256 << 20, validator=_positive_int)
    role: KVRole = KVRole.BOTH
    kv_events: bool = False

    @classmethod
    def from_extra_config(
        cls,
        extra: Mapping[str, object] | None,
        *,
        role: KVRole = KVRole.BOTH,
        kv_events: bool = False,
        async_scheduling: bool = False,
    ) -> ConnectorConfig:
        """Parse vLLM's ``kv_connector_extra_config``; raise ConfigError naming any bad key.
        ``role``, ``kv_events`` and ``async_scheduling`` come from vLLM's ``kv_role``, KV events and
        scheduler settings; ``load_async`` defaults to ``async_scheduling``."""
        extra = extra or {}
        unknown = set(extra) - _KEYS
        if unknown:
            raise ConfigError(
                f"unknown kv_connector_extra_config key(s) {sorted(unknown)} for KVFlowConnector; "
                f"allowed: {sorted(_KEYS)}"
            )
        kwargs: dict[str, object] = {key: _text(extra, key) for key in _TEXTS if key in extra}
        kwargs.update({key: _number(extra, key) for key in _FLOATS if key in extra})
        kwargs.setdefault("load_async", async_scheduling)
        kwargs.update({key: _flag(extra, key) for key in _FLAGS if key in extra})
        kwargs.update({key: _setting(extra, key) for key in _SETTINGS if key in extra})
        if "layerwise_depth" in extra:
            kwargs["layerwise_depth"] = _integer(extra, "layerwise_depth")
        for key in _SIZES:
            if key in extra:
                value = extra[key]
                if not isinstance(value, (str, int)) or isinstance(value, bool):
                    raise ConfigError(
                        f"kv_connector_extra_config[{key!r}] must be a size like 1GiB or 4096, got {value!r}"
                    )
                kwargs[key] = parse_size(value)
        return cls(**kwargs, role=role, kv_events=kv_events)  # type: ignore[arg-type]

    def pool_config(self, model: str) -> PoolConfig:
        """The :class:`kvflow.PoolConfig` of a worker's pool; ``model``: the keys' model field
        (:meth:`EngineShape.key_model`, ``model_id`` applied)."""
        return PoolConfig(
            backend=self.backend,
            model=model,
            max_inflight_bytes=self.max_inflight_bytes,
            timeout_s=self.timeout_s,
            layerwise=self.layerwise,
            staging=self.staging,
            staging_bytes=self.staging_bytes,
        )

    def lookup_pool_config(self, model: str) -> PoolConfig:
        """The :class:`kvflow.PoolConfig` of the scheduler side's lookup-only pool."""
        return attrs.evolve(
            self.pool_config(model),
            backend=self.lookup_backend or self.backend,
            timeout_s=self.lookup_timeout_s,
        )


def _text(extra: Mapping[str, object], key: str) -> str:
    value = extra[key]
    if not isinstance(value, str) or not value:
        raise ConfigError(f"kv_connector_extra_config[{key!r}] must be a non-empty string, got {value!r}")
    return value


def _number(extra: Mapping[str, object], key: str) -> float:
    """A number of seconds: finite and at most a day (JSON lets NaN and Infinity through)."""
    value = extra[key]
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigError(f"kv_connector_extra_config[{key!r}] must be a number, got {value!r}")
    if not math.isfinite(value) or not -_MAX_SECONDS <= value <= _MAX_SECONDS:
        raise ConfigError(
            f"kv_connector_extra_config[{key!r}] must be a finite number of seconds up to "
            f"{_MAX_SECONDS:.0f}, got {value!r}"
        )
    return float(value)


def _integer(extra: Mapping[str, object], key: str) -> int:
    value = extra[key]
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"kv_connector_extra_config[{key!r}] must be an integer, got {value!r}")
    return value


def _flag(extra: Mapping[str, object], key: str) -> bool:
    value = extra[key]
    if not isinstance(value, bool):
        raise ConfigError(f"kv_connector_extra_config[{key!r}] must be true or false, got {value!r}")
    return value


def _setting(extra: Mapping[str, object], key: str) -> str:
    """``auto``, ``true`` or ``false``; JSON's true and false too."""
    value = extra[key]
    if isinstance(value, bool):
        return "true" if value else "false"
    if not isinstance(value, str):
        raise ConfigError(
            f"kv_connector_extra_config[{key!r}] must be one of auto, true, false, got {value!r}"
        )
    return value  # (the field's validator names the allowed values)


def sync_load_warning(config: ConnectorConfig, *, async_scheduling: bool, recompute: bool) -> str | None:
    """What to tell an operator who asked for loads before the forward (``load_async`` false) from
    an engine that schedules asynchronously and recomputes failed loads. vLLM (0.32) plans step N+1
    before step N's output arrives; when a load of step N fails, it rewinds the request to the
    failed block but still delivers the token its step N+1 computed from that block: a wrong token.
    An asynchronous load fails before any forward reads its blocks. None where this cannot happen."""
    if config.load_async or not async_scheduling or not recompute or not config.role.loads:
        return None
    return (
        "load_async=false with vLLM's asynchronous scheduling: when a load fails, vLLM recomputes "
        "the request but may still return one token computed from the failed blocks. Leave "
        "load_async unset (or true), or run vLLM with async_scheduling=False"
    )


def decode_saves_refusal(config: ConnectorConfig, *, async_scheduling: bool, recompute: bool) -> str | None:
    """Why ``save_decode_blocks`` cannot be served where :func:`sync_load_warning` warns: after a
    failed load vLLM discards the token its next step computed from the failed blocks, but the
    KV the step wrote for it stays in the block, which a decode save would store under the hash of
    the token vLLM kept. None where this cannot happen."""
    if not config.save_decode_blocks or not config.role.stores:
        return None
    if sync_load_warning(config, async_scheduling=async_scheduling, recompute=recompute) is None:
        return None
    return (
        "save_decode_blocks=true with load_async=false under vLLM's asynchronous scheduling: a "
        "failed load would leave a decode block holding KV of a token vLLM discarded, stored under "
        "the hash of the token it kept. Leave load_async unset (or true), run vLLM with "
        "async_scheduling=False, or leave save_decode_blocks off"
    )


def weak_hash_warning(hash_algo: str, *, seeded: bool) -> str | None:
    """What to tell an operator whose vLLM names blocks by a hash that is not collision resistant
    (``prefix_caching_hash_algo`` xxhash...): kvflow keys stored KV by those names, so in a store
    shared with other engines (or tenants) a prompt made to collide with another's block would load
    that block's KV. Without ``PYTHONHASHSEED`` (``seeded`` False) vLLM also seeds such hashes at
    random in every process: no other engine, nor this one restarted, finds what it stores. None
    for sha256."""
    if hash_algo.startswith("sha256"):
        return None
    shared = (
        ""
        if seeded
        else " Without PYTHONHASHSEED vLLM also seeds these hashes at random in each process, so no "
        "other engine (nor this one, restarted) finds the KV this one stores: set PYTHONHASHSEED to "
        "one value on every engine that shares the store."
    )
    return (
        f"prefix_caching_hash_algo={hash_algo!r} is not collision resistant, and kvflow names the KV it "
        "stores and loads by vLLM's block hashes: in a store other engines or users share, a prompt "
        "made to collide with another's block would load that block's KV. Use sha256 (vLLM's "
        "default) unless the store serves only engines you trust." + shared
    )
