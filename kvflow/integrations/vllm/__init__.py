"""kvflow as a vLLM KV connector (vLLM 0.32, KV connector API v1).

Use it with::

    KVTransferConfig(
        kv_connector="KVFlowConnector",
        kv_connector_module_path="kvflow.integrations.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"backend": "local://"},
    )

docs/vllm.md lists the ``kv_connector_extra_config`` keys (default backend: the local shared-memory
store ``local://``, private to the user running vLLM) and how the connector works. Importing this
package imports vLLM; ``import kvflow`` alone never does.
"""

from __future__ import annotations

from kvflow.errors import MissingDependencyError

try:
    import vllm.distributed.kv_transfer.kv_connector.v1.base  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    if exc.name is None or not exc.name.startswith("vllm"):
        raise
    raise MissingDependencyError(
        "vllm",
        "kvflow's vLLM connector",
        "pip install vllm (GPU machines), or pip install 'kvflow[vllm]' for vLLM on CPU",
    ) from exc

from kvflow.integrations.vllm.connector import KVFlowConnector

__all__ = ["KVFlowConnector"]
