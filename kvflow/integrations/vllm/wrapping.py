"""Where vLLM runs the connector: alone, or as a child of another connector (``MultiConnector``);
whether a worker may therefore start a step's loads early (``load_early``).

A worker starts a step's loads in ``handle_preemptions`` when nothing else writes their blocks
before the forward (``KVFlowConnectorMetadata.load_early``). Under vLLM's ``MultiConnector`` the
children's ``handle_preemptions`` run in list order, and a later child (``OffloadingConnector``,
``SimpleCPUOffloadConnector``) may still be finishing stores that read the blocks this step reuses:
a load started before it would overwrite them, and the offload tier would keep kvflow's KV under the
previous request's hashes. ``start_load_kv`` runs after every child's ``handle_preemptions``.

``MultiConnector`` builds each child with its own copy of the ``VllmConfig``, so the child's config
does not show the wrapper; vLLM's workers build the connector inside
``set_current_vllm_config(<the engine's config>)``, whose ``kv_transfer_config`` does. The connector
reads it there (:meth:`Wrapping.of`); this module imports neither vLLM nor torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import attrs

__all__ = ["MULTI_CONNECTOR", "TransferConfigLike", "Wrapping"]

MULTI_CONNECTOR = "MultiConnector"


class TransferConfigLike(Protocol):
    """The fields of vLLM's ``KVTransferConfig`` read here."""

    @property
    def kv_connector(self) -> str | None: ...

    @property
    def kv_connector_module_path(self) -> str | None: ...

    @property
    def kv_connector_extra_config(self) -> Mapping[str, object]: ...


@attrs.frozen
class Wrapping:
    """The connector vLLM was configured with, when it is not kvflow itself.

    ``wrapper``: its name (None: kvflow runs alone, or nothing shows a wrapper); ``children``: the
    connectors a ``MultiConnector`` runs, in order (empty for another wrapper); ``ours``: the
    positions among them that are kvflow's connector."""

    wrapper: str | None = None
    children: tuple[str, ...] = ()
    ours: tuple[int, ...] = ()

    @classmethod
    def of(cls, current: TransferConfigLike | None, own: TransferConfigLike) -> Wrapping:
        """From the ``kv_transfer_config`` of the ``VllmConfig`` current while the connector is
        built (None: none is set, as in tests that build the connector directly) and the
        connector's own one. Worker thread, at construction."""
        if current is None or current is own or _identity(current) == _identity(own):
            return cls()
        wrapper = current.kv_connector or "an unnamed connector"
        listed = current.kv_connector_extra_config.get("connectors") if wrapper == MULTI_CONNECTOR else None
        if not isinstance(listed, Sequence) or isinstance(listed, str):
            return cls(wrapper)
        children = [child if isinstance(child, Mapping) else {} for child in listed]
        names = tuple(str(child.get("kv_connector")) for child in children)
        ours = tuple(i for i, child in enumerate(children) if _same_child(child, own))
        return cls(wrapper, names, ours)

    def early_loads(self, setting: str) -> bool:
        """Whether a worker may start loads in ``handle_preemptions`` under ``load_early``
        ``setting`` (``auto``, ``true``, ``false``)."""
        if setting != "auto":
            return setting == "true"
        return self.refusal() is None

    def refusal(self) -> str | None:
        """Why ``load_early=auto`` does not start loads early here (None: it does): another
        connector may run its ``handle_preemptions`` after kvflow's."""
        if self.wrapper is None:
            return None
        keep = "or set load_early=true if no connector after kvflow reads or writes KV blocks in it"
        if not self.children:
            return (
                f"kvflow runs inside {self.wrapper}, which may call another connector's "
                "handle_preemptions after kvflow's: loads start in start_load_kv, not early in "
                f"handle_preemptions. Run kvflow outside it, {keep}"
            )
        tail = tuple(range(len(self.children) - len(self.ours), len(self.children)))
        if self.ours and self.ours == tail:
            return None  # kvflow is last: every other child's handle_preemptions ran before
        after = [
            n for i, n in enumerate(self.children) if i > min(self.ours, default=-1) and i not in self.ours
        ]
        where = (
            f"before {', '.join(after)} in its connectors list"
            if self.ours
            else "where its connectors list does not name kvflow's connector"
        )
        return (
            f"kvflow runs inside {self.wrapper}, {where}, whose handle_preemptions may still read "
            "blocks this step reuses: loads start in start_load_kv, not early in handle_preemptions. "
            f"List kvflow last in the MultiConnector's connectors to keep early loads, {keep}"
        )


def _identity(config: TransferConfigLike) -> tuple[str | None, str | None]:
    """Which connector a transfer configuration names: its class name and module path."""
    return config.kv_connector, config.kv_connector_module_path


def _same_child(child: Mapping[object, object], own: TransferConfigLike) -> bool:
    """Whether a ``MultiConnector`` child's entry names the connector ``own`` names."""
    return (child.get("kv_connector"), child.get("kv_connector_module_path")) == _identity(own)
