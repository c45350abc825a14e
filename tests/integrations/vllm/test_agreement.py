"""Which vLLM engines plan saves that rest on loads not yet settled, and their workers' agreement
(the collective itself: tests/test_ranks.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvflow.integrations.vllm.agreement import plans_saves_after_loads
from kvflow.integrations.vllm.config import ConnectorConfig
from kvflow.integrations.vllm.topology import EngineShape
from kvflow.integrations.vllm.worker import WorkerSide


def _shape(tp: int, pp: int) -> EngineShape:
    return EngineShape("m", block_size=16, tp_size=tp, pp_size=pp, total_num_kv_heads=8, use_mla=False)


@pytest.mark.parametrize(
    ("tp", "pp", "layerwise", "planned"),
    [
        (1, 1, False, True),
        (1, 1, True, True),  # one worker knows its own loads, layer by layer too
        (4, 1, False, True),  # the ranks agree at the end of the step
        (4, 1, True, False),  # a layer is stored before the loads of the layers after it ended
        (1, 2, False, False),  # stages end the step at different times
        (2, 2, False, False),
    ],
)
def test_which_engines_plan_saves_resting_on_loads_not_yet_settled(
    tp: int, pp: int, layerwise: bool, planned: bool
) -> None:
    assert plans_saves_after_loads(_shape(tp, pp), layerwise) is planned


def test_a_tensor_parallel_worker_that_could_not_agree_is_refused(tmp_path: Path) -> None:
    """Alone, a rank whose own load arrived would store KV computed from another rank's failed load."""
    config = ConnectorConfig.from_extra_config({"backend": f"local://{tmp_path}/store"})
    with pytest.raises(ValueError, match="agreement"):
        WorkerSide(config, _shape(2, 1), 0, 0)
    WorkerSide(config, _shape(1, 1), 0, 0)  # one worker knows its own loads
    WorkerSide(config, _shape(2, 2), 0, 0)  # across stages the scheduler holds such saves back
