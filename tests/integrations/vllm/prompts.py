"""The prompts every vLLM test here uses, and what the tests expect of them.

Block size 32. Each prompt's full blocks (the only ones vLLM hashes and kvflow stores)::

    A       = SHARED + 45 tokens   365 tokens, 11 full blocks (blocks 0-9 are SHARED)
    B       = SHARED + 70 tokens   390 tokens, 12 full blocks (blocks 0-9 shared with A)
    C       = unrelated            200 tokens,  6 full blocks
    D       = unrelated            256 tokens,  8 full blocks and nothing more: every token hits,
                                   yet vLLM must compute the last one itself
    E       = unrelated            400 tokens, 12 full blocks
    E_HEAD  = E[:128] + 40 tokens  168 tokens,  5 full blocks (blocks 0-3 are E's)

Two patterns:

- one engine, vLLM's own prefix cache off (``ONE_ENGINE``): the first batch computes and stores,
  the second finds everything it shares with the first in kvflow only;
- two engines in two processes (``FIRST_ENGINE`` then ``SECOND_ENGINE``), vLLM's prefix cache on:
  the second engine loads what the first stored, and in its second batch combines vLLM's own
  prefix cache (blocks its first batch holds) with kvflow (the blocks after them).
"""

from __future__ import annotations

from tests.integrations.vllm.engine_harness import make_prompt

BLOCK = 32
MAX_TOKENS = 12

SHARED = make_prompt(1, 10 * BLOCK)
A = SHARED + make_prompt(2, 45)
B = SHARED + make_prompt(3, 70)
C = make_prompt(4, 200)
D = make_prompt(5, 8 * BLOCK)
E = make_prompt(6, 400)
E_HEAD = E[: 4 * BLOCK] + make_prompt(7, 40)

Batches = tuple[tuple[tuple[int, ...], ...], ...]

# -- one engine, vLLM prefix cache off --------------------------------------------------------------

ONE_ENGINE: Batches = ((A, C, D, E_HEAD), (B, A, D, E))
#: Tokens each second-batch prompt finds in kvflow: B and E share a prefix with A and E_HEAD, A
#: hits up to its last full block, D up to its last token but one (the last block is loaded whole).
ONE_ENGINE_CACHED = (10 * BLOCK, 11 * BLOCK, 8 * BLOCK - 1, 4 * BLOCK)
ONE_ENGINE_LOADED_BLOCKS = 10 + 11 + 8 + 4
#: Every full block of the first batch, then what the second computes: B's 10-11 and E's 4-11.
ONE_ENGINE_STORED_SPANS = (range(11), range(6), range(8), range(5), range(10, 12), range(4, 12))
ONE_ENGINE_STORED_BLOCKS = sum(len(span) for span in ONE_ENGINE_STORED_SPANS)

# -- two engines, vLLM prefix cache on -------------------------------------------------------------

FIRST_ENGINE: Batches = ((A, C, D, E),)
FIRST_ENGINE_STORED_BLOCKS = 11 + 6 + 8 + 12
SECOND_ENGINE: Batches = ((A, C, D, E_HEAD), (B, E))
#: Batch 1 from kvflow alone; batch 2: B from vLLM's prefix cache (A's blocks 0-9, nothing more in
#: kvflow), E from vLLM's cache for blocks 0-3 (E_HEAD's) plus kvflow for blocks 4-11.
SECOND_ENGINE_CACHED = (11 * BLOCK, 6 * BLOCK, 8 * BLOCK - 1, 4 * BLOCK, 10 * BLOCK, 12 * BLOCK)
#: Only what vLLM's own prefix cache does not hold: E's blocks 0-3 are not loaded again.
SECOND_ENGINE_LOADED_BLOCKS = 11 + 6 + 8 + 4 + 8
#: E_HEAD's block 4 and B's blocks 10-11 (B's blocks 0-9 came from vLLM's cache: already stored).
SECOND_ENGINE_STORED_BLOCKS = 1 + 2

# -- the reference: no connector, vLLM prefix cache on ----------------------------------------------

REFERENCE = ONE_ENGINE
#: vLLM's own prefix cache in the second batch: like kvflow's, but D stops at a whole block.
REFERENCE_CACHED = (0, 0, 0, 0, 10 * BLOCK, 11 * BLOCK, 7 * BLOCK, 4 * BLOCK)


def owned_by(rank: int, group_size: int) -> int:
    """How many of the ONE_ENGINE stored blocks TP rank ``rank`` stores, in a replica group of
    ``group_size`` ranks (block ``i`` of a request belongs to the rank with ``i % group_size``)."""
    return sum(1 for span in ONE_ENGINE_STORED_SPANS for i in span if i % group_size == rank % group_size)
