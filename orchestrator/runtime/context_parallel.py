"""Context parallelism: each rank of a `cp` group holds a share of every sequence.

The sequence of T tokens is cut into 2 x cp equal chunks and rank r of the group keeps chunks
r and 2cp-1-r (head-tail, or zigzag, sharding): under a causal mask an early chunk attends to
few keys and a late one to many, so every rank gets one of each and the same work.

Attention sees the whole sequence in one of two ways (`choices.CpAttention`, chosen and priced
by the planner):

- `allgather_kv` (:class:`ZigzagShard`), as torchtitan does: the queries stay sharded, each rank
  attends its 2 chunks of queries to the whole sequence's keys, gathered from the group, under
  the causal mask of their positions, and the all-gather's backward reduce-scatters dK and dV,
  so every rank gets the sum of all queries' gradients for its own keys. It runs on any
  attention kernel that takes an explicit mask, CPU included, at any head count.
- `ulysses` (:class:`UlyssesShard`), DeepSpeed-Ulysses' head all-to-all: q, k and v trade
  sequence shards for heads, so each rank holds H / cp heads of the whole sequence and runs
  plain causal attention on them; a fourth all-to-all gives the output back by sequence. Each
  all-to-all moves (cp-1)/cp of a rank's tensor, whatever cp is, where the K/V all-gather
  grows with cp; it needs the rank's heads to divide by cp.

The rank's share enters the model through the sequence hook (`workloads/sequence.py`):
:func:`apply_context_parallel` sets every module's ``sequence_layout`` to the rank's
:class:`ZigzagShard`, and the trainer gives the model the same chunks of inputs and labels
(:meth:`ZigzagShard.take`). Labels are shifted before sharding, so the label of a chunk's last
token is the next chunk's first token whichever rank holds that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import _functional_collectives as functional
from torch.distributed.device_mesh import DeviceMesh

from orchestrator.choices import CpAttention
from orchestrator.errors import PlanError
from orchestrator.sequence_split import sequence_split_problem, ulysses_kv_heads, ulysses_problem
from orchestrator.workloads.hf_sequence import declare_sequence_hooks, is_hugging_face
from orchestrator.workloads.models import attention_of, block_slots
from orchestrator.workloads.sequence import HOOK, WholeSequence

# The autograd all-gather (its backward reduce-scatters): torch 2.13 renames it, the floor has the old name.
_all_gather = getattr(functional, "all_gather_single_autograd", None) or functional.all_gather_tensor_autograd
# Its backward is the reverse all-to-all, so a Ulysses attention's gradients go home the way they came.
_all_to_all = functional.all_to_all_single_autograd


def chunk_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The positions in a sequence of `seq_len` tokens that rank `rank` of `cp` holds, in the
    order it holds them: chunk `rank`, then chunk 2cp-1-rank, of 2cp equal chunks."""
    problem = sequence_split_problem(cp, seq_len)
    if problem:
        raise ValueError(problem)
    if cp == 1:
        return torch.arange(seq_len)
    chunk = seq_len // (2 * cp)
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def gathered_order(seq_len: int, cp: int) -> torch.Tensor:
    """Indices that put the group's shards, concatenated in rank order, back in sequence order."""
    return torch.argsort(torch.cat([chunk_positions(seq_len, cp, r) for r in range(cp)]))


@dataclass(frozen=True)
class ZigzagShard(WholeSequence):
    """This rank's share of every sequence under context parallelism, as the sequence hook."""

    cp_mesh: DeviceMesh
    """The 1-D mesh of the cp group (the ranks sharing each sequence)."""

    @property
    def size(self) -> int:
        return self.cp_mesh.size()

    @property
    def rank(self) -> int:
        return self.cp_mesh.get_local_rank()

    def positions(self, length: int, device: torch.device) -> torch.Tensor:
        """The positions of the `length` tokens this rank holds, in the whole sequence."""
        return chunk_positions(length * self.size, self.size, self.rank).to(device)

    def take(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's chunks of `tokens` [B, T] (inputs or already shifted labels): [B, T / cp]."""
        return tokens[:, chunk_positions(tokens.shape[1], self.size, self.rank).to(tokens.device)]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout_p: float = 0.0,
               scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
        """Causal attention of this rank's queries q [B, H, T/cp, D] over the whole sequence's
        keys and values, gathered from the group's k, v [B, H_kv, T/cp, D]."""
        local = q.shape[2]
        seq_len = local * self.size
        order = gathered_order(seq_len, self.size).to(q.device)
        # The gathered shards come in rank order, each zigzagged: back in sequence order, so the
        # keys lie as an unsharded run's do and any kernel sees the usual layout.
        k_all = _all_gather(k.contiguous(), 2, self.cp_mesh).index_select(2, order)
        v_all = _all_gather(v.contiguous(), 2, self.cp_mesh).index_select(2, order)
        query_positions = self.positions(local, q.device)
        causal = query_positions[:, None] >= torch.arange(seq_len, device=q.device)[None, :]
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=causal, dropout_p=dropout_p,
                                              scale=scale, enable_gqa=enable_gqa)


@dataclass(frozen=True)
class UlyssesShard(ZigzagShard):
    """This rank's share of every sequence under context parallelism, attending through a head
    all-to-all (DeepSpeed-Ulysses): the same chunks, positions and inputs as :class:`ZigzagShard`."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout_p: float = 0.0,
               scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
        """Causal attention of this rank's queries q [B, H, T/cp, D]: q, k and v trade sequence
        for heads, H / cp heads of the whole sequence attend causally, and the output trades back."""
        cp, heads, kv_heads = self.size, q.shape[1], k.shape[1]
        problem = ulysses_problem(heads, kv_heads, cp)
        if problem:
            raise ValueError(problem)
        if ulysses_kv_heads(heads, kv_heads, cp) != kv_heads:
            # K/V heads that do not divide by cp: each rank takes the K/V heads its query heads read.
            k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        order = gathered_order(q.shape[2] * cp, cp).to(q.device)
        whole = [_sequence_to_heads(t, self.cp_mesh).index_select(2, order) for t in (q, k, v)]
        y = F.scaled_dot_product_attention(*whole, is_causal=True, dropout_p=dropout_p, scale=scale,
                                           enable_gqa=enable_gqa and whole[1].shape[1] != whole[0].shape[1])
        # Back to the group's shards in rank order (the inverse of `order`), then home by sequence.
        return _heads_to_sequence(y.index_select(2, torch.argsort(order)), self.cp_mesh)


def _sequence_to_heads(x: torch.Tensor, cp_mesh: DeviceMesh) -> torch.Tensor:
    """[B, H, S, D], this rank's sequence shard of every head, to [B, H/cp, cp x S, D]: its
    group of heads (rank r keeps heads r x H/cp onwards) over every rank's shard, in rank order."""
    cp = cp_mesh.size()
    b, h, s, d = x.shape
    # Dim 0 in cp equal parts, part j for rank j: the j-th group of heads.
    parts = x.reshape(b, cp, h // cp, s, d).transpose(0, 1).reshape(cp * b, h // cp, s, d).contiguous()
    got = _all_to_all(parts, None, None, cp_mesh)  # part i now holds rank i's shard of my heads
    return got.reshape(cp, b, h // cp, s, d).permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def _heads_to_sequence(y: torch.Tensor, cp_mesh: DeviceMesh) -> torch.Tensor:
    """The inverse of :func:`_sequence_to_heads`: [B, H/cp, cp x S, D] back to [B, H, S, D]."""
    cp = cp_mesh.size()
    b, h, length, d = y.shape
    s = length // cp
    parts = y.reshape(b, h, cp, s, d).permute(2, 0, 1, 3, 4).reshape(cp * b, h, s, d).contiguous()
    got = _all_to_all(parts, None, None, cp_mesh)  # part i now holds my shard of rank i's heads
    return got.reshape(cp, b, h, s, d).transpose(0, 1).reshape(b, cp * h, s, d)


def unhooked_block(model: nn.Module) -> str | None:
    """The first block of `model` with no module declaring the sequence hook, named by its
    attention (or itself where none is found), e.g. "_PlainAttention (block 0's self_attn)"; None
    when every block declares it. Such a block's attention would see only this rank's chunks."""
    for blocks, key in block_slots(model):
        block = blocks[key]
        if not any(_declares_hook(m) for m in block.modules()):
            found = attention_of(block)
            return f"{type(found[1]).__name__} (block {key}'s {found[0]})" if found else \
                f"{type(block).__name__} (block {key})"
    return None


def prepare_for_context_parallel(model: nn.Module, cp: int) -> str | None:
    """Opt `model` in where the runtime can (a Hugging Face decoder, through transformers'
    attention-function registry: `workloads/hf_sequence.py`) and say in one line why it cannot
    run at context-parallel degree `cp`; None when it can."""
    if is_hugging_face(model):
        why = declare_sequence_hooks(model)
        if why:
            return (f"context parallelism (cp={cp}) replaces a Hugging Face model's attention through transformers' "
                    f"attention-function registry; {why}; use cp=1")
    where = unhooked_block(model)
    if where is None:
        return None
    return (f"context parallelism (cp={cp}) needs every block's attention to declare the sequence hook '{HOOK}' "
            f"(docs/models.md); {where} declares none; use cp=1")


SHARDS: dict[CpAttention, type[ZigzagShard]] = {CpAttention.allgather_kv: ZigzagShard,
                                                CpAttention.ulysses: UlyssesShard}
"""The sequence hook of each context-parallel attention."""


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh,
                           attention: CpAttention = CpAttention.allgather_kv) -> ZigzagShard:
    """Give every module of `model` that declares the sequence hook this rank's share of the
    sequence, attending as `attention` does; PlanError where the model cannot run so
    (`prepare_for_context_parallel`)."""
    problem = prepare_for_context_parallel(model, cp_mesh.size())
    if problem:
        raise PlanError(problem)
    shard = SHARDS[CpAttention(attention)](cp_mesh)
    for module in model.modules():
        if _declares_hook(module):
            setattr(module, HOOK, shard)
    return shard


def _declares_hook(module: nn.Module) -> bool:
    return isinstance(getattr(module, HOOK, None), WholeSequence)


def gradient_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """A 1-D mesh over the ranks that average gradients and share model states: the data-parallel
    ranks and the cp ranks sharing their sequences (dp_replicate x dp_shard x cp, flattened)."""
    axes = [axis for axis in ("dp_replicate", "dp_shard", "cp") if mesh[axis].size() > 1]
    if len(axes) <= 1:
        return mesh[axes[0] if axes else "dp_replicate"]
    # Without cp the flattened mesh keeps the name it always had.
    return mesh[tuple(axes)]._flatten("dp" if "cp" not in axes else "_".join(axes))


def replicate_shard_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 2-D (dp_replicate, shard) mesh of hybrid sharding, the shard axis being dp_shard x cp:
    the cp ranks of a sequence shard model states with the dp_shard ranks, as torchtitan does."""
    if mesh["cp"].size() == 1:
        return mesh["dp_replicate", "dp_shard"]
    if mesh["dp_shard"].size() == 1:
        return mesh["dp_replicate", "cp"]
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    return mesh["dp_replicate", "dp_shard_cp"]
