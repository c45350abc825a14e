"""Build a tiny random-weight Llama checkpoint on local disk for vLLM tests.

No model can be downloaded where the tests run, so the tests make their own: 2 layers, hidden 128,
4 attention heads, 2 KV heads of size 32, vocabulary 512. Linear and embedding weights are drawn from
N(0, std) with a fixed seed (std 0.2 keeps greedy output varied instead of repeating one token);
norm weights stay 1. The same seed and dtype always give byte-identical safetensors.

Run as a script (``python tiny_model.py OUT_DIR [--dtype float32]``) so that the test process never
imports transformers; it prints the directory on success.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import attrs

__all__ = ["TinyLlamaSpec", "write_tiny_llama"]


@attrs.frozen
class TinyLlamaSpec:
    """The shape and weights of the tiny model. The defaults are what the vLLM tests rely on."""

    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    vocab_size: int = 512
    max_position_embeddings: int = 4096
    weight_std: float = 0.2
    dtype: str = attrs.field(
        default="float32", validator=attrs.validators.in_(("float32", "bfloat16", "float16"))
    )
    seed: int = 0

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V bytes one token occupies across all layers on one rank with TP 1."""
        itemsize = 4 if self.dtype == "float32" else 2
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


def write_tiny_llama(out_dir: Path, spec: TinyLlamaSpec = TinyLlamaSpec()) -> Path:
    """Write ``config.json`` and ``model.safetensors`` of a random Llama into ``out_dir``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        vocab_size=spec.vocab_size,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
    generator = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.copy_(torch.empty(param.shape).normal_(0.0, spec.weight_std, generator=generator))
    model = model.to(getattr(torch, spec.dtype))
    model.config.dtype = getattr(torch, spec.dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-kv-heads", type=int, default=2, help="1 makes TP=2 ranks replicas")
    args = parser.parse_args(argv)
    spec = TinyLlamaSpec(dtype=args.dtype, seed=args.seed, num_kv_heads=args.num_kv_heads)
    path = write_tiny_llama(args.out_dir, spec)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
