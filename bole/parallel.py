"""Tensor parallelism: head sharding rules, the process group, and the all-reduce hook.

Design: SPMD engines. Every TP rank runs an identical ``LLMEngine`` holding its slice of the weights
(``load_model(path, tp_rank=, tp_size=)``) and caches sized for its local heads. The driver (a Serve
replica, ``deployments.tp``; or a test) sends every rank the same requests and the same ``step()``
calls. Each rank's forward ends every row-parallel projection (attention o_proj, GDN out_proj, MLP /
expert down_proj) with an all-reduce (``tp_reduce``), so after each decoder layer all ranks hold the
same hidden states; embedding and lm_head are replicated, so every rank computes the same full
logits. Scheduling is a deterministic function of the request stream, sampling uses those logits
and per-request seeds (the driver fixes the seed of unseeded requests before fan-out), so every rank
emits the same tokens and rank 0's outputs are returned. No tokens or logits travel between ranks;
the only collective is the all-reduce inside the forward.

Head sharding (``head_range``): a head count that divides over ``tp_size`` is split evenly. A head
count smaller than ``tp_size`` that divides it is *replicated* the way vLLM replicates KV heads:
rank r holds the single head ``r * n // tp_size`` (so e.g. 2 KV heads over 4 ranks: ranks 0, 1
hold head 0, ranks 2, 3 hold head 1). This applies to attention KV heads and GDN key heads (the
q / k segments of ``in_proj_qkv`` and the conv channels with them): every query / value head a rank
holds reads exactly that key head, because query heads and GDN value heads must divide evenly.
``local_model_config`` gives the per-rank shapes the runner sizes its KV cache, state pool and
factor buffers with.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass, replace
from typing import Callable

import torch

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------- sharding
def head_range(num_heads: int, tp_size: int, rank: int) -> tuple[int, int]:
    """(first head, head count) rank ``rank`` holds of ``num_heads`` heads (see the module docstring)."""
    if num_heads % tp_size == 0:
        n = num_heads // tp_size
        return rank * n, n
    if tp_size % num_heads == 0:
        return rank * num_heads // tp_size, 1  # replicated: tp_size / num_heads ranks share a head
    raise ValueError(f"{num_heads} heads neither divide over nor replicate across tp_size={tp_size}")


def local_heads(num_heads: int, tp_size: int) -> int:
    return head_range(num_heads, tp_size, 0)[1]


def split_heads(num_heads: int, tp_size: int, what: str) -> int:
    """Per-rank count of heads that must divide evenly (query heads, GDN value heads)."""
    if num_heads % tp_size:
        raise ValueError(f"{what}: {num_heads} heads do not divide over tp_size={tp_size}")
    return num_heads // tp_size


def local_model_config(cfg, tp_size: int):
    """``ModelConfig`` with the head counts one rank holds (derived dims such as conv_dim follow)."""
    if tp_size == 1:
        return cfg
    return replace(cfg,
                   num_attention_heads=split_heads(cfg.num_attention_heads, tp_size, "attention"),
                   num_key_value_heads=local_heads(cfg.num_key_value_heads, tp_size),
                   linear_num_key_heads=local_heads(cfg.linear_num_key_heads, tp_size),
                   linear_num_value_heads=split_heads(cfg.linear_num_value_heads, tp_size, "GDN value"))


# ------------------------------------------------------------------------------------ the group
@dataclass(frozen=True)
class TPGroup:
    """One rank's membership of a tensor-parallel group (``group`` None: the default world group)."""

    rank: int
    size: int
    group: object = None


def make_tp_reduce(group=None) -> Callable[[torch.Tensor], torch.Tensor]:
    """The ``tp_reduce`` hook of ``HybridForCausalLM``: sum a row-parallel output over the group.

    The output of a row-parallel projection is a fresh tensor, so reducing in place is safe.
    """
    import torch.distributed as dist

    def reduce(t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        return t

    return reduce


def init_tp_group(rank: int | None = None, world_size: int | None = None, master_addr: str | None = None,
                  master_port: int | None = None, device: str = "cpu", timeout_s: float = 120.0) -> TPGroup:
    """Join (or create) the process group of a TP group; gloo on CPU, NCCL on CUDA.

    Arguments left as None come from the usual environment variables (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR`` (default 127.0.0.1), ``MASTER_PORT``). One TP group per process: the group is
    the default world group of this process. On CUDA each process is expected to see its own GPU as
    the engine's ``device`` (Ray sets ``CUDA_VISIBLE_DEVICES`` per worker actor; elsewhere pass
    ``device="cuda:N"`` in the engine options).
    """
    import torch.distributed as dist

    rank = int(os.environ["RANK"]) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is not in [0, world_size={world_size})")
    if world_size == 1:
        return TPGroup(0, 1, None)
    master_addr = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
    master_port = int(master_port if master_port is not None else os.environ["MASTER_PORT"])
    backend = "nccl" if str(device).startswith("cuda") else "gloo"
    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise RuntimeError(f"this process already belongs to a process group "
                               f"(rank {dist.get_rank()} of {dist.get_world_size()})")
    else:
        dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
        logger.info("TP rank %d/%d joined %s group at %s:%d", rank, world_size, backend, master_addr,
                    master_port)
    return TPGroup(rank, world_size, dist.group.WORLD)


def destroy_tp_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def free_port(host: str = "127.0.0.1") -> int:
    """A port of ``host`` free right now, for a rendezvous (TP process group, a test's HTTP proxy).

    Drawn at random from 20000 up to the kernel's ephemeral range (Linux:
    /proc/sys/net/ipv4/ip_local_port_range, 32768-60999 by default) rather than by bind(0): every port
    Ray's processes bind for themselves and every outgoing connection comes from that range, so a
    bind(0) port can be taken by one of them in the seconds before the rendezvous binds it (CI saw
    "Failed to bind to address"). 20000 is above Ray's worker ports (10002-19999). Falls back to
    bind(0) where the range cannot be read or leaves no room below it."""
    import random
    import socket

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_lo = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_lo = 0
    for _ in range(200 if ephemeral_lo > 21000 else 0):
        port = random.randrange(20000, ephemeral_lo)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
