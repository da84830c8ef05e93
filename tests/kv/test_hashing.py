from __future__ import annotations

import subprocess
import sys

from pagedserve.kv.hashing import ROOT_HASH, BlockHasher, hash_block, hash_block_tokens

TOKENS = list(range(100, 164))  # 4 blocks of 16


def test_chain_matches_manual() -> None:
    hashes = hash_block_tokens(TOKENS, 16)
    assert len(hashes) == 4
    parent = None
    for i, h in enumerate(hashes):
        expect = hash_block(parent, TOKENS[16 * i : 16 * (i + 1)])
        assert h == expect and len(h) == 32
        parent = h
    assert hash_block(None, TOKENS[:16]) == hash_block(ROOT_HASH, TOKENS[:16])


def test_incremental_hashes_only_new_full_blocks() -> None:
    hasher = BlockHasher(16)
    out: list[bytes] = []
    assert hasher.extend(out, TOKENS[:15]) == 0 and out == []
    assert hasher.extend(out, TOKENS[:33]) == 2
    first_two = list(out)
    assert hasher.extend(out, TOKENS[:33]) == 0
    assert hasher.extend(out, TOKENS) == 2
    assert out[:2] == first_two
    assert out == hash_block_tokens(TOKENS, 16)


def test_salt_changes_every_block_and_only_first_carries_it() -> None:
    plain = hash_block_tokens(TOKENS, 16)
    salted = hash_block_tokens(TOKENS, 16, cache_salt="tenant-a")
    other = hash_block_tokens(TOKENS, 16, cache_salt="tenant-b")
    assert all(a != b for a, b in zip(plain, salted, strict=True))
    assert all(a != b for a, b in zip(salted, other, strict=True))
    # The salt sits on block 0 only; later blocks differ purely through the chain.
    assert salted[0] == hash_block(None, TOKENS[:16], [("salt", "tenant-a")])
    assert salted[1] == hash_block(salted[0], TOKENS[16:32])


def test_extra_keys_are_domain_separated() -> None:
    toks = TOKENS[:16]
    salt_x = hash_block(None, toks, [("salt", "x")])
    lora_x = hash_block(None, toks, [("lora", "x")])
    mm_x = hash_block(None, toks, [("mm", "x", 0)])
    mm_x_shift = hash_block(None, toks, [("mm", "x", 3)])
    assert len({salt_x, lora_x, mm_x, mm_x_shift, hash_block(None, toks)}) == 5


def test_extra_keys_fn_is_called_per_block() -> None:
    seen: list[tuple[int, int, int]] = []

    def keys(i: int, start: int, end: int):  # type: ignore[no-untyped-def]
        seen.append((i, start, end))
        return [("mm", "img", 0)] if i == 1 else None

    out = hash_block_tokens(TOKENS, 16, extra_keys_fn=keys)
    assert seen == [(0, 0, 16), (1, 16, 32), (2, 32, 48), (3, 48, 64)]
    plain = hash_block_tokens(TOKENS, 16)
    assert out[0] == plain[0] and out[1] != plain[1] and out[3] != plain[3]


def test_hashes_agree_across_processes() -> None:
    code = (
        "from pagedserve.kv.hashing import hash_block_tokens;"
        "print(hash_block_tokens(list(range(100, 164)), 16, 's')[-1].hex())"
    )
    a = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert a.stdout.strip() == hash_block_tokens(TOKENS, 16, "s")[-1].hex()
