"""Pure block arithmetic of the connector: what to load, what to store. No vLLM, no I/O.

All counts are tokens or block indices of one request; ``block_size`` is vLLM's block size, which is
also the granularity of ``request.block_hashes``.
"""

from __future__ import annotations

__all__ = ["external_tokens", "load_range", "save_range"]


def external_tokens(hit_tokens: int, num_computed_tokens: int, num_tokens: int) -> int:
    """Tokens vLLM may take from the store beyond its own ``num_computed_tokens``.

    ``hit_tokens`` is the store's leading hit (whole blocks). vLLM must compute at least the last
    token itself to sample the next one, so a hit is capped at ``num_tokens - 1``.
    """
    usable = min(hit_tokens, num_tokens - 1)
    return max(0, usable - num_computed_tokens)


def load_range(num_computed_tokens: int, num_external_tokens: int, block_size: int) -> tuple[int, int]:
    """Block indices ``[first, end)`` to load for an external hit.

    ``num_computed_tokens`` (vLLM's local hit) is block-aligned. The last loaded block may be only
    partly needed (a hit capped at ``num_tokens - 1``); it is loaded whole: the token vLLM recomputes
    rewrites its slot with the same values.
    """
    if num_computed_tokens % block_size:
        raise ValueError(f"the local hit {num_computed_tokens} is not a multiple of {block_size}")
    first = num_computed_tokens // block_size
    end = -(-(num_computed_tokens + num_external_tokens) // block_size)
    return first, end


def save_range(saved_upto: int, computed_tokens: int, num_hashes: int, block_size: int) -> tuple[int, int]:
    """Block indices ``[start, end)`` that are full, computed and not yet stored.

    ``saved_upto``: blocks below it are stored, loaded or already being stored. ``computed_tokens``:
    tokens whose KV will be in the cache after this step (the caller caps it at the prompt when only
    prompt blocks are stored). ``num_hashes``: full blocks vLLM has hashed so far.
    """
    end = min(computed_tokens // block_size, num_hashes)
    start = min(saved_upto, end)
    return start, end
