"""The paged KV pool's bookkeeping (llm_core.engine.kv_pool): allocation, reference counts, prefix keys chained over
full blocks, eviction order, exhaustion. Pure Python: no model, no torch."""

from __future__ import annotations

import pytest

from llm_core.engine.kv_pool import BlockPool, PoolExhausted, block_key

BS = 4


def _run(pool: BlockPool, prompt: list[int], reply: list[int], budget: int = 8):
    """A whole reply: start, write prompt + reply, finish. Returns the table as it was before finish."""
    table = pool.start(prompt, len(prompt) + budget)
    pool.commit(table, prompt + reply)
    seen = (list(table.block_ids), table.cached_tokens)
    pool.finish(table)
    return seen


def test_a_new_sequence_gets_blocks_for_its_prompt_and_reply_budget() -> None:
    pool = BlockPool(10, BS)
    table = pool.start(list(range(6)), 6 + 5)  # 11 tokens -> 3 blocks
    assert len(table.block_ids) == 3 and len(set(table.block_ids)) == 3
    assert pool.free_blocks == 7
    assert all(pool.ref_count(b) == 1 for b in table.block_ids)
    assert table.slot(0) == table.block_ids[0] * BS and table.slot(9) == table.block_ids[2] * BS + 1


def test_finish_returns_every_block() -> None:
    pool = BlockPool(10, BS)
    table = pool.start(list(range(6)), 11)
    pool.finish(table)
    assert pool.free_blocks == 10 and table.block_ids == []


def test_the_next_turn_takes_back_the_full_blocks_of_the_previous_one() -> None:
    pool = BlockPool(16, BS)
    turn1 = list(range(100, 110))  # 10 prompt tokens
    reply1 = [7, 8, 9]
    blocks1, cached1 = _run(pool, turn1, reply1)
    assert cached1 == 0
    assert pool.cached_blocks == 3  # 13 tokens written -> 3 full blocks keyed
    turn2 = turn1 + reply1 + [55, 56, 57, 58]  # history + the new message
    table = pool.start(turn2, len(turn2) + 8)
    assert table.cached_tokens == 12 and table.block_ids[:3] == blocks1[:3]
    assert table.tokens == 12


def test_the_last_prompt_token_is_always_recomputed() -> None:
    pool = BlockPool(8, BS)
    prompt = list(range(8))  # exactly two blocks
    _run(pool, prompt, [])
    table = pool.start(prompt, 12)  # the same prompt again (a Regenerate)
    assert table.cached_tokens == 4  # not 8: the logits of token 7 must be computed


def test_a_changed_early_token_breaks_the_chain_from_that_block_on() -> None:
    pool = BlockPool(16, BS)
    prompt = list(range(20))
    _run(pool, prompt, [])
    changed = list(prompt)
    changed[5] = 999  # second block differs
    assert len(pool.match(changed)) == 1
    assert len(pool.match(prompt)) == 5


def test_keys_chain_so_equal_blocks_after_different_prefixes_differ() -> None:
    a = block_key(None, [1, 2, 3, 4], "m")
    b = block_key(None, [9, 9, 9, 9], "m")
    assert block_key(a, [5, 6, 7, 8], "m") != block_key(b, [5, 6, 7, 8], "m")
    assert block_key(None, [1, 2, 3, 4], "m") != block_key(None, [1, 2, 3, 4], "other-kv-format")


def test_two_users_with_one_system_prompt_share_its_blocks() -> None:
    pool = BlockPool(16, BS)
    system = list(range(50, 58))  # two full blocks
    alice = pool.start(system + [1, 2, 3], 16)
    pool.commit(alice, system + [1, 2, 3])
    bob = pool.start(system + [4, 5], 16)
    assert bob.block_ids[:2] == alice.block_ids[:2] and bob.cached_tokens == 8
    assert [pool.ref_count(b) for b in alice.block_ids[:2]] == [2, 2]
    pool.finish(alice)
    assert [pool.ref_count(b) for b in bob.block_ids[:2]] == [1, 1]
    pool.finish(bob)
    assert pool.free_blocks == 16


def test_exhaustion_raises_and_holds_nothing() -> None:
    pool = BlockPool(4, BS)
    held = pool.start(list(range(8)), 12)  # 3 blocks
    with pytest.raises(PoolExhausted):
        pool.start(list(range(100, 104)), 8)  # needs 2, 1 free
    assert pool.free_blocks == 1 and all(pool.ref_count(b) == 1 for b in held.block_ids)
    pool.finish(held)
    assert pool.start(list(range(100, 104)), 8).block_ids  # after the wait it fits


def test_a_lone_sequence_can_use_the_whole_pool() -> None:
    pool = BlockPool(8, BS)
    table = pool.start(list(range(30)), 32)
    assert len(table.block_ids) == 8 and pool.free_blocks == 0


def test_free_blocks_are_used_before_cached_ones_and_cached_ones_oldest_first() -> None:
    pool = BlockPool(6, BS)
    old, _ = _run(pool, list(range(8)), [], budget=0)  # 2 keyed blocks, released first
    new, _ = _run(pool, list(range(20, 28)), [], budget=0)  # 2 keyed blocks, released later
    assert pool.cached_blocks == 4 and pool.free_blocks == 6
    first = pool.start([1000, 1001, 1002], 4)  # one block: a never-keyed one
    assert first.block_ids[0] not in old + new
    second = pool.start([2000, 2001, 2002], 8)  # one more free one, then the oldest cached (the old tail first)
    assert second.block_ids[0] not in old + new and second.block_ids[1] == old[1]
    assert pool.match(list(range(8)) + [0]) == [old[0]]  # the old turn's first block is still found
    assert pool.match(list(range(20, 28)) + [0]) == new  # the newer turn is intact


def test_eviction_forgets_the_key() -> None:
    pool = BlockPool(2, BS)
    _run(pool, list(range(8)), [], budget=0)
    assert pool.cached_blocks == 2
    pool.start([5, 5, 5, 5, 5], 8)  # takes both
    assert pool.cached_blocks == 0 and pool.match(list(range(8)) + [0]) == []


def test_grow_extends_a_table_or_raises() -> None:
    pool = BlockPool(3, BS)
    table = pool.start([1, 2], 4)
    pool.grow(table, 9)
    assert len(table.block_ids) == 3
    with pytest.raises(PoolExhausted):
        pool.grow(table, 13)


def test_forget_and_caching_off_find_nothing() -> None:
    pool = BlockPool(8, BS)
    _run(pool, list(range(12)), [])
    pool.forget()
    assert pool.match(list(range(12))) == []
    off = BlockPool(8, BS, caching=False)
    _run(off, list(range(12)), [])
    assert off.cached_blocks == 0 and off.start(list(range(12)), 16).cached_tokens == 0


def test_an_identical_block_written_twice_keeps_the_first_copy_findable() -> None:
    pool = BlockPool(8, BS)
    a = pool.start([1, 2, 3, 4, 5], 8)
    b = pool.start([1, 2, 3, 4, 6], 8)  # started before a committed: no sharing yet
    pool.commit(a, [1, 2, 3, 4, 5])
    pool.commit(b, [1, 2, 3, 4, 6])
    assert pool.match([1, 2, 3, 4, 9]) == [a.block_ids[0]]
    pool.finish(a)
    pool.finish(b)
    assert pool.free_blocks == 8
