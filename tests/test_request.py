"""KVRequest and the transfer layer's plan: bad input is refused before anything moves."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from kvflow import KVLayout, KVRequest, RequestError
from kvflow.keys import hash_blocks
from kvflow.transfer import BlockPlan, Hashing

FORMAT = Hashing(block_size=16, hash_tokens=16)
TOKENS = list(range(16 * 5))


def test_block_ids_are_checked_against_the_cache_and_for_type() -> None:
    layout = KVLayout.from_kv_caches({"a": torch.zeros(4, 2, 16, 8)})
    plan = BlockPlan.build(
        [KVRequest(block_ids=[0, 3], tokens=TOKENS)],
        Hashing(layout.block_size, layout.block_size),
        layout.num_blocks,
    )
    assert plan.block_ids == [0, 3] and plan.indices == [0, 1]
    with pytest.raises(RequestError, match="out of range"):
        BlockPlan.build(
            [KVRequest(block_ids=[4], tokens=TOKENS)],
            Hashing(layout.block_size, layout.block_size),
            layout.num_blocks,
        )
    for bad, message in (
        ([-1], ">= 0"),
        ([True], "integer"),
        ([1.0], "integer"),
        (["2"], "integer"),
        ([0, 4, -3, 2], "got -3"),  # anywhere in the list, named
        ([0, 1, False], "got False"),
        ([np.int64(1), -2], "got -2"),
    ):
        with pytest.raises(RequestError, match=message):
            KVRequest(block_ids=bad, tokens=TOKENS)


def test_duplicate_block_ids_are_refused_with_the_ids_named() -> None:
    with pytest.raises(RequestError, match=r"block ids \[5, 7\] appear more than once"):
        KVRequest(block_ids=[5, 7, 5, 5, 7, 1], tokens=TOKENS)


def test_numpy_and_torch_integers_become_ints() -> None:
    request = KVRequest(block_ids=np.array([3, 1]), tokens=TOKENS, block_offset=np.int64(2))
    assert request.block_ids == (3, 1) and all(type(b) is int for b in request.block_ids)
    assert request.block_offset == 2 and type(request.block_offset) is int
    assert KVRequest(block_ids=torch.tensor([4, 5]), tokens=TOKENS).block_ids == (4, 5)


def test_a_request_names_its_prompt_and_pickles() -> None:
    with pytest.raises(RequestError, match="tokens or block_hashes"):
        KVRequest(block_ids=[0])
    for hashes, named in (([b""], "b''"), ([b"a", "b"], "'b'"), ([b"a", b"b", b""], "b''")):
        with pytest.raises(RequestError, match=f"non-empty bytes, got {named}"):
            KVRequest(block_hashes=hashes)

    class Digest(bytes):
        pass

    assert KVRequest(block_hashes=[Digest(b"a"), b"b"]).block_hashes == (b"a", b"b")  # a subclass is bytes
    with pytest.raises(RequestError, match="token ids"):
        KVRequest(tokens="hello")  # type: ignore[arg-type]
    request = KVRequest(
        block_ids=[2, 3], block_hashes=hash_blocks(TOKENS, 16), block_offset=1, request_id="r"
    )
    assert pickle.loads(pickle.dumps(request)) == request
    assert request.end_block == 3


def test_the_plan_refuses_blocks_past_the_prompt_and_disagreeing_hashes() -> None:
    with pytest.raises(RequestError, match=r"blocks 4..5 of the prompt requested, but it has 5"):
        BlockPlan.build([KVRequest(block_ids=[0, 1], tokens=TOKENS, block_offset=4)], FORMAT, 8)
    with pytest.raises(RequestError, match="4 block hashes but 80 tokens"):
        BlockPlan.build([KVRequest(tokens=TOKENS, block_hashes=hash_blocks(TOKENS, 16)[:4])], FORMAT, 8)
    with pytest.raises(RequestError, match="appears twice in one batch"):
        BlockPlan.build([KVRequest(block_ids=[0], tokens=TOKENS, request_id="a")] * 2, FORMAT, 8)


def test_a_plan_flattens_a_batch_in_order() -> None:
    hashes = hash_blocks(TOKENS, 16)
    plan = BlockPlan.build(
        [
            KVRequest(block_ids=[7, 6], tokens=TOKENS, block_offset=3, request_id="a"),
            KVRequest(block_ids=[1], block_hashes=hashes, request_id="b"),
        ],
        FORMAT,
        8,
    )
    assert plan.spans == ((0, 2), (2, 3)) and plan.request_ids == ("a", "b")
    assert plan.hashes == [hashes[3], hashes[4], hashes[0]]
    assert plan.block_ids == [7, 6, 1] and plan.indices == [3, 4, 0]
    assert plan.origins == [0, 0, 1] and plan.fine == (hashes, hashes)


def test_the_plans_errors_name_what_is_wrong() -> None:
    with pytest.raises(RequestError, match=r"^expected a kvflow.KVRequest, got list$"):
        BlockPlan.build([[0, 1]], FORMAT, 8)  # type: ignore[list-item]
    with pytest.raises(
        RequestError, match=r"^expected a sequence of kvflow.KVRequest \(a list\), got KVRequest$"
    ):
        BlockPlan.build(KVRequest(tokens=TOKENS), FORMAT, 8)  # type: ignore[arg-type]
    with pytest.raises(RequestError, match=r"^block_ids must be a sequence of integers, got 3$"):
        KVRequest(tokens=TOKENS, block_ids=3)  # type: ignore[arg-type]
    with pytest.raises(
        RequestError, match=r"block id 8 is out of range: the KV cache has 8 blocks \(0..7\)$"
    ):
        BlockPlan.build([KVRequest(block_ids=[8], tokens=TOKENS)], FORMAT, 8)
    with pytest.raises(RequestError, match=r"^4 block hashes but 80 tokens make 5 full blocks of 16$"):
        BlockPlan.build([KVRequest(tokens=TOKENS, block_hashes=hash_blocks(TOKENS, 16)[:4])], FORMAT, 8)


def test_requests_read_once_from_any_iterable_plan_as_from_a_list() -> None:
    """A generator or a dict's values are read once, as a list would be."""
    requests = {
        "a": KVRequest(block_ids=[7, 6], tokens=TOKENS, request_id="a"),
        "b": KVRequest(block_ids=[1], tokens=TOKENS[:16], request_id="b"),
    }
    listed = BlockPlan.build(list(requests.values()), FORMAT, 8)
    for given in (requests.values(), (r for r in requests.values())):
        plan = BlockPlan.build(given, FORMAT, 8)  # type: ignore[arg-type]
        assert (plan.spans, plan.hashes, plan.block_ids) == (listed.spans, listed.hashes, listed.block_ids)


def test_given_hashes_may_come_with_a_partial_block_of_tokens() -> None:
    """Tokens past the last full block have no hash: 85 tokens agree with 5 hashes of 16."""
    hashes = hash_blocks(TOKENS, 16)
    plan = BlockPlan.build(
        [KVRequest(block_ids=[0], tokens=[*TOKENS, 1, 2, 3, 4, 5], block_hashes=hashes)], FORMAT, 8
    )
    assert plan.hashes == hashes[:1]


def test_a_store_plan_refuses_one_engine_block_named_for_two_prompt_blocks_and_names_both() -> None:
    """Each engine block holds one block of one prompt. Two requests of one store naming engine
    block 1 as block 1 of prompt A and block 0 of prompt B would publish A's bytes under B's key
    (a wrong hit for every later reader of B): the plan refuses it, naming the block and both
    requests. One engine block two requests name under one hash (a shared prefix) is fine."""
    other = list(range(9000, 9000 + 16 * 3))
    with pytest.raises(
        RequestError,
        match=r"^block id 1 is named as block 1 of request 'a' and as block 0 of request 'b', which hold "
        "different KV",
    ):
        BlockPlan.build(
            [
                KVRequest(block_ids=[0, 1], tokens=TOKENS, request_id="a"),
                KVRequest(block_ids=[1], tokens=other, request_id="b"),
            ],
            FORMAT,
            8,
        )
    with pytest.raises(
        RequestError, match=r"block 0 of request #0 of the batch and as block 2 of request #1"
    ):
        BlockPlan.build(
            [
                KVRequest(block_ids=[5], tokens=TOKENS),
                KVRequest(block_ids=[5], tokens=TOKENS, block_offset=2),
            ],
            FORMAT,
            8,
        )
    shared = [*TOKENS[:16], *other[:16]]  # the same first block, then another prompt
    plan = BlockPlan.build(
        [KVRequest(block_ids=[0, 1], tokens=TOKENS), KVRequest(block_ids=[0, 2], tokens=shared)], FORMAT, 8
    )
    assert plan.block_ids == [0, 1, 0, 2] and plan.hashes[0] == plan.hashes[2]
