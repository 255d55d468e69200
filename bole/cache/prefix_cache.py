"""Prefix cache for hybrid models: shared full-attention KV blocks plus GDN state checkpoints.

A radix tree over fixed-size token blocks: a node is one full KV block of ``block_size`` tokens,
its children are keyed by their block's token ids, so a root-to-node path spells a prefix.

Full-attention layers. Only full blocks whose every position is committed (< num_computed) are
published. The engine never writes below num_computed (prefill, decode, the verify step's tree
K/V and the commit all write at positions >= num_computed), so a published block is immutable and
is shared by reference count. A request's block table is its chain of cached blocks
(``Request.prefix_nodes``, one reference each) followed by private blocks.

GDN layers keep a running state, not per-position entries, so a prefix is restorable only where a
copy of the state was kept: a *checkpoint* (ssm + conv of every GDN layer) in its own pool and
budget, hung on the node at whose end it was taken. Checkpoints sit at multiples of
``interval`` tokens and are taken
  * in prefill: the scheduler ends a chunk at the last boundary it crosses (``align_chunk``);
  * after decode / verify commits: when the committed length lands on a boundary, by copying the
    request's slot; when a speculative commit jumps over one, the accepted path cut at that
    boundary is materialised into the checkpoint slot (``bole.engine.acceptance``), so
    only accepted tokens ever reach a checkpoint. A commit crossing several boundaries keeps the
    deepest (one per request and step). ``bole.cache.checkpoints`` plans those slots.
A match is cut back to the deepest node holding a checkpoint and leaves at least one token to run
(the request needs logits), so every position a restored request writes lies in private blocks.

MTP drafter KV uses the same block ids, so a cached block also carries the drafter entries of its
positions once its *writer* (the request that computed the block) has run the drafter over them
(``mtp_computed`` >= block end): ``mtp_complete``. Speculative modes match only complete chains.
The entry at a block's last position pairs with the writer's next token; a request branching
exactly at that boundary drafts with it, which can lower draft acceptance but never changes
outputs (verification is lossless).

A finished request's last blocks lack drafter entries (its final commit is never drafted over), so
in a speculative mode their checkpoints are freed when it is released (``release``): the restore
point of its conversation's next turn is the deepest checkpoint on a complete block.

Eviction: LRU over unreferenced leaves (a running request references every node of its chain, so
nothing it uses is evicted), leaves without a checkpoint first (nothing restores into them).
KV blocks (``allocator``) and checkpoint slots (``checkpoints``) are separate budgets; a cached block
stays allocated until evicted. When the checkpoint pool is full, the victim is the least recently
used checkpoint of the first class that has one (``_victim_order``):
  1. *superseded*: the block has one child and a deeper checkpoint lies below it (``below``). A
     conversation's next turn extends the previous prompt and answer, so it restores from that
     path's deepest checkpoint; the ones above it (the previous prompt's end, the answer's earlier
     boundaries) serve only a request that leaves the path between them. Under plain LRU they crowded
     out the deepest checkpoints of conversations waiting for a running slot, and those turns hit little
     or nothing (the queued-conversation tests of tests/cache/test_prefix_cache*.py).
  2. every other checkpoint: a leaf-most one, or a branch point (a block with several children, such
     as a shared prefix that requests left in different directions), least recently used first.

Routing summary: each node carries the chain hash of ``bole.cache.block_hash`` (blake2b of the
previous digest and the block's ids; the router hashes prompts with it), so ``summary()`` is the
replica's cached-prefix set.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Collection, Sequence

import torch

from bole.cache.block_hash import CHAIN_SEED, chain_hash, digest_int
from bole.cache.kv_cache import BlockAllocator
from bole.cache.state_pool import StatePool


@dataclass(eq=False)
class CachedBlock:
    tokens: tuple[int, ...]
    block: int                       # KV block id (target and MTP caches)
    parent: CachedBlock | None
    end: int                         # prefix length up to and including this block
    digest: bytes
    writer: str | None = None        # request whose drafter entries fill this block
    children: dict = field(default_factory=dict)
    ref: int = 0                     # running requests whose chain includes this block
    last_use: int = 0
    checkpoint: int | None = None    # checkpoint slot: the GDN state after ``end`` tokens
    mtp_complete: bool = False
    below: int = 0                   # checkpoints strictly below this block (in its subtree)

    @property
    def hash(self) -> int:
        return digest_int(self.digest)


def boundary_cut(start, n, interval: int):
    """``PrefixCache.path_cut`` for ints or (on the device, inside a CUDA graph) int tensors: the
    path nodes of a commit of [start, start + n) up to the last multiple of ``interval`` inside it."""
    cut = (start + n - 1) // interval * interval - start
    return cut.clamp(min=0) if isinstance(cut, torch.Tensor) else max(cut, 0)


def _count_below(node: CachedBlock, delta: int) -> None:
    """A checkpoint hung on (``delta`` 1) or taken off (-1) ``node``: its ancestors' ``below``."""
    node = node.parent
    while node is not None:
        node.below += delta
        node = node.parent


def _victim_order(node: CachedBlock) -> tuple[bool, int]:
    """Checkpoint eviction order (module docstring): superseded first (one child, a deeper checkpoint
    below), then least recently used."""
    return (node.below == 0 or len(node.children) != 1, node.last_use)


class PrefixCache:
    def __init__(self, allocator: BlockAllocator, state_pool: StatePool, block_size: int,
                 checkpoint_interval_blocks: int = 1, num_checkpoint_slots: int = 32,
                 track_mtp: bool = False):
        if block_size < 1 or checkpoint_interval_blocks < 1:
            raise ValueError("block_size and checkpoint_interval_blocks must be >= 1")
        self.allocator, self.state_pool, self.block_size = allocator, state_pool, block_size
        self.interval = checkpoint_interval_blocks * block_size
        # one slot more than the budget: ``scratch_slot``, never a checkpoint (a CUDA graph's target for
        # rows that take no checkpoint; it is never written)
        self.checkpoints = StatePool.like(state_pool, num_checkpoint_slots + 1)
        self.scratch_slot = self.checkpoints.allocate(zero=False)
        self.checkpoint_budget = num_checkpoint_slots
        self.track_mtp = track_mtp
        self.root = CachedBlock((), -1, None, 0, CHAIN_SEED)
        self._nodes: dict[CachedBlock, None] = {}          # every cached block, least recently used first
        self._by_checkpoint: dict[int, CachedBlock] = {}
        self._clock = 0
        self.evicted_blocks = self.evicted_checkpoints = 0

    @property
    def num_cached_blocks(self) -> int:
        return len(self._nodes)

    @property
    def num_checkpoints(self) -> int:
        return len(self._by_checkpoint)

    def _touch(self, node: CachedBlock) -> None:
        self._clock += 1
        node.last_use = self._clock
        self._nodes.pop(node, None)
        self._nodes[node] = None

    # -- admission -------------------------------------------------------------------------------
    def match(self, token_ids: Sequence[int]) -> list[CachedBlock]:
        """The chain to restore: cached blocks of ``token_ids`` up to the deepest checkpoint,
        leaving at least one token to compute."""
        B, node, chain, best = self.block_size, self.root, [], 0
        for i in range((len(token_ids) - 1) // B):
            node = node.children.get(tuple(token_ids[i * B:(i + 1) * B]))
            if node is None or (self.track_mtp and not node.mtp_complete):
                break
            chain.append(node)
            if node.checkpoint is not None:
                best = len(chain)
        return chain[:best]

    def checkpointed(self, token_ids: Sequence[int]) -> CachedBlock | None:
        """The cached block ending ``token_ids`` (a whole number of blocks) if it holds a checkpoint."""
        B, node = self.block_size, self.root
        for i in range(len(token_ids) // B):
            node = node.children.get(tuple(token_ids[i * B:(i + 1) * B]))
            if node is None:
                return None
        return node if node is not self.root and node.checkpoint is not None else None

    def share(self, req, chain: list[CachedBlock]) -> None:
        """Start a fresh request on ``chain`` (a reference on each block); ``restore`` fills its state."""
        for node in chain:
            node.ref += 1
            self._touch(node)
        req.prefix_nodes, req.block_table = list(chain), [n.block for n in chain]
        req.num_computed = req.mtp_computed = chain[-1].end if chain else 0

    def restore(self, req) -> None:
        """Copy the checkpoint at the end of req's chain into its (fresh) state slot."""
        if req.prefix_nodes:
            self.checkpoints.copy_slot(req.prefix_nodes[-1].checkpoint, self.state_pool, req.state_slot)

    def release(self, req) -> None:
        """Drop req's references and free its private blocks; its cached blocks stay for reuse. In a
        speculative mode the checkpoints on its last blocks that it never drafted over are freed: no
        match gets past such a block, and nothing completes it (``mark_drafted`` is the writer's)."""
        n = len(req.prefix_nodes)
        for node in req.prefix_nodes:
            if node.ref <= 0:
                raise RuntimeError(f"cached block {node.block} released more often than shared")
            node.ref -= 1
        if self.track_mtp:
            for node in reversed(req.prefix_nodes):
                if node.mtp_complete:
                    break
                if node.checkpoint is not None and node.ref == 0 and node.writer == req.request_id:
                    self._drop_checkpoint(node)
        if req.block_table[n:]:
            self.allocator.free(req.block_table[n:])
        req.prefix_nodes, req.block_table = [], []

    # -- after a forward -------------------------------------------------------------------------
    def publish(self, req, token_ids: Sequence[int] | None = None) -> None:
        """Put req's newly committed full blocks in the tree (its chain grows) and mark MTP progress.

        ``token_ids``: req's tokens covering every committed position, when they are not all in
        ``all_token_ids`` yet (a speculative commit runs before its tokens are emitted).
        """
        B = self.block_size
        node = req.prefix_nodes[-1] if req.prefix_nodes else self.root
        tokens = req.all_token_ids if token_ids is None else token_ids
        if len(tokens) < req.num_computed:
            raise ValueError(f"{len(tokens)} token ids for {req.num_computed} committed positions")
        for i in range(len(req.prefix_nodes), req.num_computed // B):
            key, own = tuple(tokens[i * B:(i + 1) * B]), req.block_table[i]
            child = node.children.get(key)
            if child is None:
                child = CachedBlock(key, own, node, (i + 1) * B, chain_hash(node.digest, key), req.request_id)
                node.children[key] = child
            elif child.ref == 0:  # an idle copy (e.g. left MTP-incomplete): ours replaces its block
                self.allocator.free([child.block])
                child.block, child.writer, child.mtp_complete = own, req.request_id, False
            else:  # computed concurrently by a running request: share it, drop our copy
                self.allocator.free([own])
                req.block_table[i] = child.block
            child.ref += 1
            self._touch(child)
            req.prefix_nodes.append(child)
            node = child
        self.mark_drafted(req)

    def mark_drafted(self, req) -> None:
        """Flag req's blocks whose drafter entries it has written (block end <= mtp_computed)."""
        if not self.track_mtp:
            return
        # marking is monotone along a writer's chain: stop at the first block already complete
        for i in range(min(len(req.prefix_nodes), req.mtp_computed // self.block_size) - 1, -1, -1):
            node = req.prefix_nodes[i]
            if node.writer != req.request_id:
                continue
            if node.mtp_complete:
                break
            node.mtp_complete = True

    def is_boundary(self, length: int) -> bool:
        return length > 0 and length % self.interval == 0

    def align_chunk(self, start: int, n: int) -> int:
        """Tokens of a prefill chunk [start, start + n): cut at the last checkpoint boundary inside."""
        end = (start + n) // self.interval * self.interval
        return end - start if end > start else n

    def path_cut(self, start: int, n: int) -> int:
        """For a commit of [start, start + n): nodes of the path up to the deepest boundary strictly
        inside it (0 = none; a commit landing on a boundary is checkpointed by ``checkpoint``)."""
        return boundary_cut(start, n, self.interval)

    def reserve_checkpoint(self, evict: bool = True, keep: Collection[CachedBlock] = ()) -> int | None:
        """A free checkpoint slot (contents undefined), evicting a checkpoint if the pool is full
        (``evict``; in eviction order, never one on a block of ``keep``: those a caller found and counts
        on); None if none is free (or every slot is taken by this step's or ``keep``'s checkpoints).
        ``attach`` or free it."""
        if not self.checkpoints.can_allocate(1):
            victims = [n for n in self._by_checkpoint.values() if n not in keep] if evict else []
            if not victims:
                return None
            self._drop_checkpoint(min(victims, key=_victim_order))
            self.evicted_checkpoints += 1
        return self.checkpoints.allocate(zero=False)

    def new_checkpoint(self, state_slot: int) -> int | None:
        """A checkpoint slot holding a copy of ``state_slot`` (``reserve_checkpoint``, then the copy)."""
        slot = self.reserve_checkpoint()
        if slot is not None:
            self.state_pool.copy_slot(state_slot, self.checkpoints, slot)
        return slot

    def checkpoint_victims(self, k: int) -> list:
        """The first ``k`` checkpointed blocks in eviction order (fewer if there are fewer): tentative
        targets for a speculative step's checkpoints that may not happen (``take_checkpoint_slot``)."""
        return heapq.nsmallest(k, self._by_checkpoint.values(), key=_victim_order)

    def take_checkpoint_slot(self, node) -> int:
        """Detach ``node``'s checkpoint and hand its slot over (not freed): its state was overwritten."""
        slot = node.checkpoint
        self._detach(node)
        self.evicted_checkpoints += 1
        return slot

    def attach(self, req, end: int, slot: int) -> None:
        """Hang checkpoint ``slot`` (req's state after ``end`` tokens) on req's block ending at ``end``."""
        node = req.prefix_nodes[end // self.block_size - 1]
        if node.checkpoint is not None:
            self.checkpoints.free(slot)
            return
        node.checkpoint = slot
        self._by_checkpoint[slot] = node
        _count_below(node, 1)

    def checkpoint(self, req) -> None:
        """After ``publish``: checkpoint req's state if its committed length is a boundary."""
        n = req.num_computed
        if self.is_boundary(n) and req.prefix_nodes[n // self.block_size - 1].checkpoint is None:
            slot = self.new_checkpoint(req.state_slot)
            if slot is not None:
                self.attach(req, n, slot)

    # -- eviction --------------------------------------------------------------------------------
    def _detach(self, node: CachedBlock) -> None:
        del self._by_checkpoint[node.checkpoint]
        node.checkpoint = None
        _count_below(node, -1)

    def _drop_checkpoint(self, node: CachedBlock) -> None:
        slot = node.checkpoint
        self._detach(node)
        self.checkpoints.free(slot)

    def evict(self, num_blocks: int) -> int:
        """Free up to ``num_blocks`` KV blocks from unreferenced leaves; returns how many were freed."""
        key = lambda n: (n.checkpoint is not None, n.last_use, id(n))
        heap = [(key(n), n) for n in self._nodes if n.ref == 0 and not n.children]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_blocks:
            _, node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.tokens]
            del self._nodes[node]
            if node.checkpoint is not None:
                self._drop_checkpoint(node)
            self.allocator.free([node.block])
            freed += 1
            if parent is not self.root and parent.ref == 0 and not parent.children:
                heapq.heappush(heap, (key(parent), parent))
        self.evicted_blocks += freed
        return freed

    def clear(self) -> int:
        """Evict every block no running request uses (with its checkpoint); returns blocks freed."""
        return self.evict(len(self._nodes))

    # -- reporting -------------------------------------------------------------------------------
    def summary(self, limit: int | None = None) -> list[int]:
        """Chain hashes of the cached blocks, least recently used first (the last ``limit``).

        Safe to call from another thread than the engine loop's (one atomic copy of the node set).
        """
        nodes = list(self._nodes)
        return [n.hash for n in (nodes[-limit:] if limit else nodes)]

    def stats(self) -> dict:
        return {"cached_blocks": self.num_cached_blocks, "checkpoints": self.num_checkpoints,
                "referenced_blocks": sum(1 for n in list(self._nodes) if n.ref),
                "evicted_blocks": self.evicted_blocks, "evicted_checkpoints": self.evicted_checkpoints}
