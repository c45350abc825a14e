"""What the connector needs to know about the engine, read from vLLM's config objects.

Both sides call :func:`describe_engine` in their constructor; workers add their own ranks with
:func:`worker_ranks`. Anything kvflow's connector does not support yet fails here, at engine start,
with a message that says what to change.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

import attrs

from kvflow.errors import ConfigError
from kvflow.ownership import ParallelConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["EngineShape", "check_layer_names", "describe_engine", "engine_variant", "worker_ranks"]


@attrs.frozen
class EngineShape:
    """The engine facts shared by the scheduler side and every worker."""

    model: str
    block_size: int
    tp_size: int
    pp_size: int
    total_num_kv_heads: int
    use_mla: bool
    pp_layers: tuple[int, ...] | None = None  # each stage's layers (vLLM's partition)
    #: a digest of what else changes the KV's bytes for the same tokens (:func:`engine_variant`)
    variant: str = ""

    def key_model(self, model_id: str | None = None) -> str:
        """The model field of every key: the model's name (``model_id`` if given) and the variant."""
        name = model_id or self.model
        return f"{name}#{self.variant}" if self.variant else name

    def parallel(self, tp_rank: int = 0, pp_rank: int = 0) -> ParallelConfig:
        """kvflow's view of one rank (the scheduler side uses rank 0: it only looks up)."""
        return ParallelConfig(
            tp_rank=tp_rank,
            tp_size=self.tp_size,
            num_kv_heads=self.total_num_kv_heads,
            use_mla=self.use_mla,
            pp_rank=pp_rank,
            pp_size=self.pp_size,
            pp_layers=self.pp_layers,
        )


def describe_engine(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> EngineShape:
    """Read the engine's shape; raise ConfigError for set-ups the connector does not handle."""
    parallel = vllm_config.parallel_config
    model_config = vllm_config.model_config
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(
            f"KVFlowConnector supports models with one KV cache group, this one has {len(groups)} "
            "(hybrid attention); run it without the connector"
        )
    _check_full_attention(groups[0].kv_cache_spec)
    if parallel.decode_context_parallel_size != 1 or parallel.prefill_context_parallel_size != 1:
        raise ConfigError(
            "KVFlowConnector does not support decode/prefill context parallelism yet; "
            "set decode_context_parallel_size=1 and prefill_context_parallel_size=1"
        )
    block_size = groups[0].kv_cache_spec.block_size
    hash_block_size = kv_cache_config.hash_block_size
    if hash_block_size not in (None, block_size):
        raise ConfigError(
            f"vLLM hashes blocks of {hash_block_size} tokens but the KV cache block is {block_size}; "
            "KVFlowConnector needs them equal"
        )
    pp_size = parallel.pipeline_parallel_size
    pp_layers = None
    if pp_size > 1:
        from vllm.distributed.utils import get_pp_indices

        total = model_config.get_total_num_hidden_layers()
        pp_layers = tuple(
            end - first for first, end in (get_pp_indices(total, r, pp_size) for r in range(pp_size))
        )
    return EngineShape(
        model=str(model_config.served_model_name or model_config.model),
        block_size=block_size,
        tp_size=parallel.tensor_parallel_size,
        pp_size=pp_size,
        total_num_kv_heads=model_config.get_total_num_kv_heads(),
        use_mla=bool(model_config.use_mla),
        pp_layers=pp_layers,
        variant=engine_variant(vllm_config, block_size, groups[0].kv_cache_spec),
    )


def _check_full_attention(spec: Any) -> None:
    """ConfigError unless every layer keeps the KV of every token of a request (full attention, or
    MLA). A sliding-window (or chunked-local, state-space, ...) group frees the blocks a window has
    left and hands their ids to other requests, and puts a shared null block in their place: a
    load into it, or a store of such a block read after its id was reused, moves wrong KV."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, UniformTypeKVCacheSpecs

    inner = spec.kv_cache_specs.values() if isinstance(spec, UniformTypeKVCacheSpecs) else (spec,)
    if any(getattr(s, "non_causal", False) for s in inner):
        raise ConfigError(
            "KVFlowConnector cannot reuse the KV of a model whose prefill attends both ways (a "
            "prefix LM, non_causal attention): a block's KV depends on the tokens after it, so a "
            "prompt prefix's KV differs between prompts; run the model without the connector"
        )
    other = sorted({type(s).__name__ for s in inner if type(s) not in (FullAttentionSpec, MLAAttentionSpec)})
    if other:
        raise ConfigError(
            f"KVFlowConnector stores the KV of full attention only; this model's KV cache is "
            f"{', '.join(other)} (a window frees older blocks, and vLLM reuses them for other "
            "requests). For a sliding-window model run vLLM with disable_sliding_window=True, or "
            "run the model without the connector"
        )


def engine_variant(vllm_config: VllmConfig, block_size: int, spec: Any) -> str:
    """A digest of what, beside the model's name, changes the KV an engine computes for a prompt
    or how its bytes lie, so that engines differing in it never share keys (a wrong hit):

    - the model's config as vLLM loaded it (overrides applied: rope scaling, head shape...; not
      its path), the weights' quantization and revision, and for a model with rotary factors
      chosen by the context length (long-rope), which ones this engine uses;
    - the KV cache dtype (fp8 variants are all stored as bytes), and for fp8 the platform's format
      (``float8_e4m3fn``, or ``fnuz`` on some ROCm GPUs), for TurboQuant the GPU's capability
      (its fp8 keys' format depends on it);
    - on a CPU, how vLLM's attention kernel lays out a block (it packs K per instruction set).

    TP size, pipeline split and block size are not in it: kvflow keys those itself."""
    model_config, cache_config = vllm_config.model_config, vllm_config.cache_config
    hf = model_config.hf_text_config
    config = {k: v for k, v in hf.to_dict().items() if not k.startswith("_") and k != "transformers_version"}
    facts: dict[str, object] = {
        "config": config,
        "quantization": model_config.quantization,
        "revision": model_config.revision,
        "cache_dtype": cache_config.cache_dtype,
    }
    if str(cache_config.cache_dtype).startswith("fp8"):  # ROCm's MI300 encodes e4m3 as fnuz
        facts["fp8_dtype"] = _platform_fact("fp8_dtype")
    if str(cache_config.cache_dtype).startswith("turboquant"):  # its fp8 keys' format follows the GPU
        facts["device_capability"] = _platform_fact("get_device_capability")
    original = getattr(hf, "original_max_position_embeddings", None)
    if original is not None:  # long-rope picks its factors by the context length
        facts["long_context"] = model_config.max_model_len > original
    device = vllm_config.device_config.device_type
    facts["device"] = device
    if device == "cpu":
        facts["cpu_block_encoding"] = _cpu_attention_isa(model_config.dtype, block_size, spec, cache_config)
    text = json.dumps(facts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _platform_fact(method: str) -> str:
    """What vLLM's platform answers to ``method()``: ``fp8_dtype`` (the format an ``fp8`` KV cache
    is held in as bytes: ``float8_e4m3fnuz`` read as ``float8_e4m3fn`` doubles every value) or
    ``get_device_capability`` (TurboQuant picks its keys' fp8 format by it)."""
    try:
        from vllm.platforms import current_platform

        return str(getattr(current_platform, method)())
    except Exception as exc:  # another vLLM: keyed apart from every engine that could say
        return f"unknown ({type(exc).__name__})"


def _cpu_attention_isa(dtype: Any, block_size: int, spec: Any, cache_config: Any) -> str:
    """How vLLM's CPU attention packs a block on this machine (``vec``, ``amx``, ...)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return str(_get_attn_isa(dtype, block_size, spec.head_size, cache_config.cache_dtype))
    except Exception as exc:  # another vLLM: keyed apart from every engine that could say
        return f"unknown ({type(exc).__name__})"


def worker_ranks() -> tuple[int, int]:
    """This worker's ``(tp_rank, pp_rank)``. Call from a worker only (after vLLM set up its groups)."""
    from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank(), get_pp_group().rank_in_group


def check_layer_names(names: list[str], stage: tuple[int, int]) -> None:
    """Check that the registered layers are the model layers ``stage`` ``(first, end)`` in order,
    where their names carry one layer number each (``model.layers.12.self_attn.attn``): keys name
    model layers, so a stage must know which ones it holds."""
    numbers = [[int(part) for part in name.split(".") if part.isascii() and part.isdigit()] for name in names]
    if any(len(n) != 1 for n in numbers):
        return  # names without one layer number: trust vLLM's partition
    found = [n[0] for n in numbers]
    if found != list(range(*stage)):
        raise ConfigError(
            f"this pipeline stage registered KV caches of layers {found[:3]}..{found[-3:]}, but vLLM's "
            f"layer partition gives it layers {stage[0]}..{stage[1] - 1}; KVFlowConnector keys KV by "
            "model layer and needs them to agree"
        )
