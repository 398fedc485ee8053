"""Which context-parallel degrees a sequence allows: head-tail sharding cuts every sequence into
2 x cp equal chunks (`runtime/context_parallel.py`), so cp must divide half the sequence.

Imports neither torch nor Ray: config validation and the planner ask it as the runtime does.
"""

from __future__ import annotations

ALLOWED_UP_TO = 64
"""The largest cp an error lists among the allowed degrees."""


def allowed_cps(seq_len: int, up_to: int = ALLOWED_UP_TO) -> list[int]:
    """The cp degrees up to `up_to` a sequence of `seq_len` tokens can be shared by."""
    return [cp for cp in range(1, up_to + 1) if sequence_split_problem(cp, seq_len) is None]


def sequence_split_problem(cp: int, seq_len: int) -> str | None:
    """What keeps a sequence of `seq_len` tokens from being shared by `cp` ranks, in words; None
    when it can be."""
    if cp < 1:
        return f"cp must be at least 1, got {cp}"
    if cp > 1 and seq_len % (2 * cp):
        return (f"cp={cp} needs a sequence length divisible by 2 x cp = {2 * cp} (each rank holds 2 of 2 x cp equal "
                f"chunks); model.block_size is {seq_len}")
    return None



def ulysses_problem(heads: int, kv_heads: int, cp: int) -> str | None:
    """Why a rank with `heads` query and `kv_heads` K/V heads (after tensor parallelism) cannot
    attend through a head all-to-all over `cp` ranks, in one line; None when it can. Each rank
    must get whole heads: the query heads divide by cp, and the K/V heads either divide by cp
    or are repeated to the query heads' count (grouped-query attention)."""
    if heads % cp:
        return f"ulysses attention needs the rank's {heads} attention heads to divide by cp={cp}"
    if kv_heads <= 0 or heads % kv_heads:
        return f"ulysses attention needs the {heads} attention heads to divide by the {kv_heads} K/V heads"
    return None


def ulysses_kv_heads(heads: int, kv_heads: int, cp: int) -> int:
    """The K/V heads a rank's Ulysses all-to-alls move: its own where they divide by cp, else
    repeated to its query heads' count."""
    return kv_heads if kv_heads % cp == 0 else heads
