"""Draft trees and packed forests.

A draft tree of T nodes is given by its parent list in topological order: ``parents[i]`` is the
local index of node i's parent, or -1 when i is a child of the committed prefix (the root). Every
parent precedes its child, so the list is acyclic by construction and "ancestor" is a strict
lower-triangular relation.

A verification step packs the trees of all requests into one flat node list (a *forest*):
per request an offset (``cu_seqlens``, as flash-linear-attention's variable-length kernels use),
per node its local parent, its depth (1 for children of the root), its ancestor chain
``anc[i, l]`` (the local index of i's ancestor at depth l+1, -1 past depth(i)), and a compact
ancestor bitmask (bit j of node i set iff j is an ancestor of i or i itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import torch

from kernels.limits import MAX_TREE_NODES

DEFAULT_MAX_DEPTH = 16
# MAX_TREE_NODES, nodes of one request's verified tree, root included, is the Triton verifier's limit;
# every backend and the engine keep to it, so a step's trees (and so its tokens) are the same on every
# device.

DEFAULT_TREE_SIZES = (8, 16, 32, 64, 128, 256)


def tree_widths(lookahead: int, sizes: Sequence[int] = DEFAULT_TREE_SIZES) -> list[int]:
    """The tree widths a verify forward pads to (nodes per request, root included; the verify graphs'
    captured widths): ``sizes`` up to the lookahead, and the lookahead itself (the widest tree the
    engine can verify)."""
    return sorted({int(t) for t in sizes if 2 <= int(t) < lookahead} | {int(lookahead)})


def feasible_capacities(capture_set, batch: int) -> list[int]:
    """The capacities N (draft nodes for the whole batch) whose even split over ``batch`` requests keeps
    every tree, root included, within MAX_TREE_NODES."""
    return [n for n in capture_set if 1 + -(-n // batch) <= MAX_TREE_NODES]


def _as_parent_list(parents) -> list[int]:
    if isinstance(parents, torch.Tensor):
        if parents.dim() != 1:
            raise ValueError(f"parents must be 1-D, got shape {tuple(parents.shape)}")
        return [int(p) for p in parents.tolist()]
    return [int(p) for p in parents]


def validate_parents(parents: Sequence[int], max_depth: int = DEFAULT_MAX_DEPTH) -> list[int]:
    """Check a parent list and return the depth of every node (1-based).

    Raises ``ValueError`` naming the first bad entry: a parent that does not precede its child
    (which also rules out cycles and self-loops), a parent below -1, or a depth over ``max_depth``.
    """
    parents = _as_parent_list(parents)
    if len(parents) == 0:
        raise ValueError("a draft tree needs at least one node")
    depth: list[int] = []
    for i, p in enumerate(parents):
        if p < -1:
            raise ValueError(f"node {i}: parent {p} is invalid (use -1 for the committed root)")
        if p >= i:
            kind = "a cycle / self-loop" if p == i else "a parent that does not precede its child"
            raise ValueError(f"node {i}: parent {p} >= {i} ({kind}); nodes must be in topological order")
        d = 1 if p == -1 else depth[p] + 1
        if d > max_depth:
            raise ValueError(f"node {i}: depth {d} exceeds the limit max_depth={max_depth}")
        depth.append(d)
    return depth


@dataclass(frozen=True)
class DraftTree:
    """One request's draft tree (parent list in topological order), validated on construction."""

    parents: tuple[int, ...]
    max_depth: int = DEFAULT_MAX_DEPTH

    def __init__(self, parents, max_depth: int = DEFAULT_MAX_DEPTH):
        plist = _as_parent_list(parents)
        validate_parents(plist, max_depth)
        object.__setattr__(self, "parents", tuple(plist))
        object.__setattr__(self, "max_depth", max_depth)

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @cached_property
    def depths(self) -> list[int]:
        return validate_parents(self.parents, self.max_depth)

    @property
    def depth(self) -> int:
        return max(self.depths)

    def path_to(self, i: int) -> list[int]:
        """Nodes from the first level down to node i (inclusive)."""
        if not 0 <= i < self.num_nodes:
            raise ValueError(f"node {i} is not in a tree of {self.num_nodes} nodes")
        path = []
        while i != -1:
            path.append(i)
            i = self.parents[i]
        return path[::-1]

    def ancestor_mask(self, include_self: bool = True) -> torch.Tensor:
        """Dense [T, T] bool mask: M[i, j] iff j is a strict ancestor of i (or j == i)."""
        T = self.num_nodes
        m = torch.zeros(T, T, dtype=torch.bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                m[i] = m[p]
                m[i, p] = True
        if include_self:
            m |= torch.eye(T, dtype=torch.bool)
        return m

    @staticmethod
    def chain(n: int) -> "DraftTree":
        return DraftTree(list(range(-1, n - 1)), max_depth=max(n, DEFAULT_MAX_DEPTH))


@dataclass(frozen=True)
class PackedForest:
    """The trees of one verification step packed into one node list.

    Attributes (all on ``device``):
        cu_seqlens: int32 [B+1]: request b owns nodes cu_seqlens[b]:cu_seqlens[b+1].
        parents:    int32 [N]: local parent index, -1 = committed root.
        depth:      int32 [N]: 1 for children of the root.
        anc:        int32 [N, max_depth]: anc[i, l] = local index of the ancestor of i at depth l+1
                    (anc[i, depth[i]-1] == local index of i), -1 past depth[i].
        anc_bits:   int64 [N, W]: bit j of word j // 64 set iff local node j is an ancestor of i or i.
        request_ids: int32 [N]: the request each node belongs to.
    """

    cu_seqlens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    anc: torch.Tensor
    anc_bits: torch.Tensor
    request_ids: torch.Tensor
    max_nodes: int
    max_depth: int

    @staticmethod
    def from_trees(trees: Sequence[DraftTree | Sequence[int]], device=None,
                   max_depth: int | None = None) -> "PackedForest":
        if len(trees) == 0:
            raise ValueError("a forest needs at least one tree")
        trees = [t if isinstance(t, DraftTree) else DraftTree(t) for t in trees]
        depth_cap = max(t.depth for t in trees)
        if max_depth is not None:
            if depth_cap > max_depth:
                raise ValueError(f"tree depth {depth_cap} exceeds max_depth={max_depth}")
            depth_cap = max_depth
        max_nodes = max(t.num_nodes for t in trees)
        words = (max_nodes + 63) // 64
        cu, parents, depth, anc, bits, rid = [0], [], [], [], [], []
        for b, t in enumerate(trees):
            cu.append(cu[-1] + t.num_nodes)
            chains: list[list[int]] = []
            for i, p in enumerate(t.parents):
                chain = (chains[p] if p >= 0 else []) + [i]
                chains.append(chain)
                parents.append(p)
                depth.append(len(chain))
                anc.append(chain + [-1] * (depth_cap - len(chain)))
                w = [0] * words
                for j in chain:
                    w[j // 64] |= 1 << (j % 64)
                # store as signed int64
                bits.append([x - (1 << 64) if x >= (1 << 63) else x for x in w])
                rid.append(b)
        i32 = dict(dtype=torch.int32, device=device)
        return PackedForest(
            cu_seqlens=torch.tensor(cu, **i32),
            parents=torch.tensor(parents, **i32),
            depth=torch.tensor(depth, **i32),
            anc=torch.tensor(anc, **i32).reshape(len(parents), depth_cap),
            anc_bits=torch.tensor(bits, dtype=torch.int64, device=device).reshape(len(parents), words),
            request_ids=torch.tensor(rid, **i32),
            max_nodes=max_nodes,
            max_depth=depth_cap,
        )

    @staticmethod
    def from_padded(parents: torch.Tensor, num_nodes: torch.Tensor, max_depth: int) -> "PackedForest":
        """The forest of padded per-request parent lists, built with tensor ops on their device.

        The engine's fast path (``from_trees`` walks Python lists): parents int [B, T], local parent
        of each node (-1 = root), entries past ``num_nodes[b]`` ignored; max_depth: a bound on every
        tree's depth (it sizes ``anc`` and is what the kernels take as the series length). One host
        sync (the total node count). Raises ``ValueError`` if a parent does not precede its child
        or a depth exceeds max_depth.
        """
        B, T = parents.shape
        dev = parents.device
        D = int(max_depth)
        idx = torch.arange(T, device=dev)
        valid = idx[None] < num_nodes.to(dev).long()[:, None]
        par = torch.where(valid, parents.long(), -1)
        if bool(((par >= idx[None]) | (par < -1)).any()):
            raise ValueError("from_padded: a parent does not precede its child")
        chain, depth, anc, bits = _padded_layout(par, valid, D)
        if bool((chain >= 0).any()):
            raise ValueError(f"from_padded: a tree is deeper than max_depth={D}")
        counts = valid.sum(1)
        cu = torch.zeros(B + 1, dtype=torch.int32, device=dev)
        cu[1:] = counts.cumsum(0)
        rid = torch.arange(B, device=dev)[:, None].expand(B, T)
        i32 = lambda t: t[valid].to(torch.int32)
        return PackedForest(cu_seqlens=cu, parents=i32(par), depth=i32(depth), anc=anc[valid].to(torch.int32),
                            anc_bits=bits[valid], request_ids=i32(rid), max_nodes=T, max_depth=D)

    @staticmethod
    def full_padded(parents: torch.Tensor, max_depth: int, out: "PackedForest | None" = None) -> "PackedForest":
        """The forest of B trees of exactly T nodes each (parents int [B, T], all valid), with no host
        sync and no validation: what a CUDA-graph verify step builds inside the graph (its draft trees
        are padded to a fixed T with extra children of the root, ``bole.engine.verify_graphs``).

        ``out``: a forest of the same layout whose tensors are overwritten in place (static buffers).
        The caller guarantees parents precede children and depths stay within ``max_depth``.
        """
        B, T = parents.shape
        dev = parents.device
        valid = torch.ones(B, T, dtype=torch.bool, device=dev)
        _, depth, anc, bits = _padded_layout(parents.long(), valid, int(max_depth))
        if out is None:
            rid = torch.arange(B, device=dev, dtype=torch.int32)[:, None].expand(B, T).reshape(-1)
            return PackedForest(cu_seqlens=torch.arange(0, B * T + 1, T, dtype=torch.int32, device=dev),
                                parents=parents.reshape(-1).to(torch.int32), depth=depth.reshape(-1).to(torch.int32),
                                anc=anc.reshape(B * T, -1).to(torch.int32), anc_bits=bits.reshape(B * T, -1),
                                request_ids=rid.contiguous(), max_nodes=T, max_depth=int(max_depth))
        out.parents.copy_(parents.reshape(-1))
        out.depth.copy_(depth.reshape(-1))
        out.anc.copy_(anc.reshape(B * T, -1))
        out.anc_bits.copy_(bits.reshape(B * T, -1))
        return out

    @property
    def num_requests(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def num_nodes(self) -> int:
        return self.parents.numel()

    @property
    def device(self) -> torch.device:
        return self.parents.device

    def to(self, device) -> "PackedForest":
        return PackedForest(*(getattr(self, f).to(device) for f in
                              ("cu_seqlens", "parents", "depth", "anc", "anc_bits", "request_ids")),
                            max_nodes=self.max_nodes, max_depth=self.max_depth)

    def tree(self, b: int) -> DraftTree:
        s, e = int(self.cu_seqlens[b]), int(self.cu_seqlens[b + 1])
        return DraftTree(self.parents[s:e].tolist(), max_depth=max(self.max_depth, 1))

    def global_parents(self) -> torch.Tensor:
        """int64 [N]: parent as a global node index, -1 for children of the root."""
        start = self.cu_seqlens[:-1].long()[self.request_ids.long()]
        p = self.parents.long()
        return torch.where(p >= 0, p + start, p)

    def ancestor_mask(self, b: int, include_self: bool = True) -> torch.Tensor:
        """Dense [T_b, T_b] bool mask of request b, from the packed chains."""
        s, e = int(self.cu_seqlens[b]), int(self.cu_seqlens[b + 1])
        anc = self.anc[s:e].long()
        T = e - s
        m = torch.zeros(T, T, dtype=torch.bool, device=anc.device)
        rows = torch.arange(T, device=anc.device)[:, None].expand_as(anc)
        ok = anc >= 0
        m[rows[ok], anc[ok]] = True
        if not include_self:
            m &= ~torch.eye(T, dtype=torch.bool, device=anc.device)
        return m

    def accepted_path_nodes(self, accepted: "Sequence[int] | torch.Tensor") -> torch.Tensor:
        """Global node indices of each request's accepted path.

        ``accepted[b]`` is the local index of the deepest accepted node of request b, or -1 when
        nothing was accepted. Returns int32 [B, max_depth] on the forest's device, padded with -1
        (root first). A host list is validated against the tree sizes (one host read of the offsets);
        a device tensor (the acceptance's own output) is used as is, with no host sync.
        """
        if len(accepted) != self.num_requests:
            raise ValueError(f"accepted has {len(accepted)} entries for {self.num_requests} requests")
        if not isinstance(accepted, torch.Tensor):
            cu = self.cu_seqlens.tolist()
            for b, a in enumerate(accepted):
                T = cu[b + 1] - cu[b]
                if not -1 <= int(a) < T:
                    raise ValueError(f"request {b}: accepted node {int(a)} is not in its tree of {T} nodes")
            accepted = torch.tensor([int(a) for a in accepted], dtype=torch.long)
        a = accepted.to(self.device).long()
        start = self.cu_seqlens[:-1].long()
        chain = self.anc.long()[(start + a.clamp(min=0)).clamp(max=max(self.num_nodes - 1, 0))]   # [B, D]
        out = torch.where((chain >= 0) & (a >= 0)[:, None], chain + start[:, None], -1)
        return out.to(torch.int32)


def path_prefixes(paths: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The first ``keep[b]`` nodes of each accepted path (``PackedForest.accepted_path_nodes``, [B, D],
    -1 padded), the rest -1: what a prefix-cache checkpoint commits. Device ops only."""
    cols = torch.arange(paths.shape[1], device=paths.device)
    return torch.where(cols[None] < keep.to(paths.device)[:, None], paths, -1)


def _padded_layout(par: torch.Tensor, valid: torch.Tensor, D: int):
    """Device-side layout of padded trees (no host sync): par int64 [B, T] (-1 = root and on padding).

    Returns (chain_D, depth, anc, bits): chain_D [B, T] the D-th ancestor (>= 0 only for a node deeper
    than D, which the caller may reject), depth [B, T], anc [B, T, D] local ancestor chains root first
    (-1 padded), bits [B, T, W] int64 ancestor-or-self bitmasks.
    """
    B, T = par.shape
    dev = par.device
    idx = torch.arange(T, device=dev)
    # chain[k] = k-th ancestor of each node (0: itself), -1 past the root
    chain = [torch.where(valid, idx[None].expand(B, T), -1)]
    for _ in range(D):
        prev = chain[-1]
        chain.append(torch.where(prev >= 0, par.gather(1, prev.clamp(min=0)), -1))
    chains = torch.stack(chain[:D], -1)                                  # [B, T, D]
    depth = (chains >= 0).sum(-1)                                        # [B, T]
    lvl = torch.arange(D, device=dev)
    back = (depth[..., None] - 1 - lvl).clamp(min=0)                     # anc[l] = chain[depth-1-l]
    anc = torch.where(lvl < depth[..., None], chains.gather(2, back), -1)
    W = (T + 63) // 64
    member = torch.zeros(B, T, W * 64, dtype=torch.int64, device=dev)
    member.scatter_add_(2, anc.clamp(min=0), (anc >= 0).long())  # -1 entries add 0
    weights = torch.ones(64, dtype=torch.int64, device=dev) << torch.arange(64, device=dev)
    bits = (member.view(B, T, W, 64) * weights).sum(-1)                  # distinct powers: an OR
    return chain[D], depth, anc, bits

def random_tree(num_nodes: int, max_depth: int, generator: torch.Generator | None = None,
                max_children: int = 4) -> DraftTree:
    """An EAGLE-like random draft tree: nodes appended breadth first, each under a random open parent.

    Depth never exceeds ``max_depth``; the first node is always a child of the root. Used by tests
    and benchmarks (the shapes of real drafts: a few wide top levels thinning with depth).
    """
    if num_nodes < 1 or max_depth < 1:
        raise ValueError(f"num_nodes={num_nodes} and max_depth={max_depth} must be >= 1")
    parents, depth, nchild = [], [], []
    root_children = 0
    for i in range(num_nodes):
        open_nodes = [j for j in range(i) if depth[j] < max_depth and nchild[j] < max_children]
        choices = len(open_nodes) + (1 if root_children < max_children or not open_nodes else 0)
        r = int(torch.randint(choices, (1,), generator=generator))
        if r >= len(open_nodes):
            p = -1
            root_children += 1
        else:
            # prefer deeper, later nodes half of the time so trees reach their depth
            if torch.rand(1, generator=generator).item() < 0.5:
                p = open_nodes[-1 - int(torch.randint(min(3, len(open_nodes)), (1,), generator=generator))]
            else:
                p = open_nodes[r]
            nchild[p] += 1
        parents.append(p)
        depth.append(1 if p < 0 else depth[p] + 1)
        nchild.append(0)
    return DraftTree(parents, max_depth=max(max_depth, 1))
