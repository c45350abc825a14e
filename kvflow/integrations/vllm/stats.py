"""What the connector moved, in the two forms vLLM's stats pipeline takes.

Each worker (and the scheduler side, for its lookups) hands vLLM one interval's
:class:`kvflow.metrics.Observations` as a :class:`KVFlowConnectorStats` every engine step in which
something happened. vLLM sums them over workers and the scheduler (:meth:`~KVFlowConnectorStats.aggregate`),
then gives them to its two stats loggers: the interval log line (``KV Transfer metrics: ...``,
:meth:`~KVFlowConnectorStats.reduce`) and Prometheus (:class:`KVFlowPromMetrics`, which records the
metrics of :data:`kvflow.metrics.CATALOGUE` as ``vllm:kvflow_*`` with vLLM's ``model_name`` and
``engine`` labels). ``KVFlowConnector.counters()`` gives a worker's running totals.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvflow.metrics import (
    LabelledMetrics,
    MetricKind,
    MetricSpec,
    Observations,
    TransferCounters,
    create_parents,
    record,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["PROM_PREFIX", "KVFlowConnectorStats", "KVFlowPromMetrics", "TransferCounters"]

#: vLLM names its metrics ``vllm:<name>``; kvflow's are ``vllm:kvflow_<name>``.
PROM_PREFIX = "vllm:kvflow_"


class KVFlowConnectorStats(KVConnectorStats):
    """One interval's :class:`~kvflow.metrics.Observations` of one or more workers (``data`` holds
    its :meth:`~kvflow.metrics.Observations.to_data` form: vLLM moves it between processes)."""

    @classmethod
    def of(cls, observations: Observations | TransferCounters) -> KVFlowConnectorStats:
        if isinstance(observations, TransferCounters):
            observations = Observations(observations)
        return cls(data=observations.to_data())

    @property
    def observations(self) -> Observations:
        return Observations.from_data(self.data)

    def reset(self) -> None:
        self.data = Observations().to_data()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.data = self.observations.plus(Observations.from_data(other.data)).to_data()
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval log line: counts, latencies (milliseconds, mean and max) and, when a pool
        reported it, whether the store was reachable."""
        observed = self.observations
        summary: dict[str, int | float] = dict(observed.counters.as_dict())
        for name in ("lookup", "load", "store"):
            samples = getattr(observed, f"{name}_s")
            if samples:
                summary[f"{name}_ms_mean"] = round(1000 * sum(samples) / len(samples), 3)
                summary[f"{name}_ms_max"] = round(1000 * max(samples), 3)
        if observed.store_reachable is not None:
            summary["store_reachable"] = int(observed.store_reachable)
        return summary

    def is_empty(self) -> bool:
        return self.observations.empty

    @classmethod
    def from_data(cls, data: dict[str, Any] | None) -> KVFlowConnectorStats:
        return cls(data=dict(data or {}))


class KVFlowPromMetrics(KVConnectorPromMetrics):
    """kvflow's metrics registered through vLLM's per-connector Prometheus hook.

    vLLM creates one in its front-end process (``KVFlowConnector.build_prom_metrics``) and calls
    :meth:`observe` with every step's aggregated stats and the engine's index.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter: Any = self._counter_cls  # vLLM's classes (prometheus_client's, or Ray's wrappers)
        gauge: Any = self._gauge_cls
        histogram: Any = self._histogram_cls

        def make(spec: MetricSpec, name: str, names: list[str]) -> Any:
            if spec.kind is MetricKind.COUNTER:
                return counter(name=name, documentation=spec.help, labelnames=names)
            if spec.kind is MetricKind.GAUGE:
                return gauge(
                    name=name, documentation=spec.help, labelnames=names, multiprocess_mode="mostrecent"
                )
            return histogram(name=name, documentation=spec.help, labelnames=names, buckets=list(spec.buckets))

        parents = create_parents(make, PROM_PREFIX, labelnames)
        self._engines = {
            index: LabelledMetrics.create(parents, values) for index, values in per_engine_labelvalues.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        writer = self._engines.get(engine_idx)
        if writer is not None:
            record(Observations.from_data(transfer_stats_data), writer)
