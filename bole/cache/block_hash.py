"""The prefix-block chain hash: the wire contract between the prefix cache and the router.

Block i's digest is blake2b(digest_{i-1}, the block's token ids), seeded by ``CHAIN_SEED``, so it names
the whole prefix up to that block. The cache keys its nodes by it (``PrefixCache.summary``); the
router hashes prompts with the same function (``deployments.routing_policy``). Changing the seed or the
encoding changes the contract on both sides at once.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

CHAIN_SEED = b"bole-prefix-v1"


def chain_hash(prev: bytes, tokens: Sequence[int]) -> bytes:
    """Digest of a block given the previous block's digest (``CHAIN_SEED`` for the first)."""
    h = hashlib.blake2b(prev, digest_size=8)
    h.update(b",".join(str(int(t)).encode() for t in tokens))
    return h.digest()


def digest_int(digest: bytes) -> int:
    """A digest as the signed 64-bit int the routing summaries carry."""
    return int.from_bytes(digest, "little", signed=True)


def prefix_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chain hashes (64-bit ints) of the prompt's full blocks: hash_i = H(hash_{i-1}, block_i)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    out, prev = [], CHAIN_SEED
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev = chain_hash(prev, token_ids[start:start + block_size])
        out.append(digest_int(prev))
    return out
