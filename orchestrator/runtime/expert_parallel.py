"""Expert parallelism and the experts' load balancing, as torchtitan runs them.

The expert mesh is a second factorisation of the job's ranks (`Mesh.expert_shape` over
`EXPERT_AXES`: pp, dp_replicate, efsdp, ep), built beside the dense one. Each rank of an `ep`
group holds `E / ep` of every MoE layer's routed experts, as DTensors `Shard(0)` on `ep`, so a
checkpoint names them by their whole, canonical names and DCP reshards them to any other `ep`.

A forward through one layer's experts (`GroupedExperts`, rows sorted by expert and the count of
each) becomes, per `ep` group: the counts exchanged (an even all-to-all), the rows sent to the
ranks holding their experts (an uneven all-to-all with autograd), the received rows permuted
from rank-major to expert-major, this rank's experts, and the reverse. An expert that gets no
rows, or a rank that gets them all, is only a split of zero or of everything. The ranks of a
tensor-parallel group hold the same tokens: each dispatches its share of them (`_Dispatch`).

The experts are then FSDP2-sharded over `efsdp` (and `dp_replicate` under HSDP) while the rest
of each block stays on the dense mesh; their gradients are divided by all data-parallel ranks,
not by the `efsdp` ranks FSDP2 reduces over, since the tokens of every data-parallel rank reach
every expert through the all-to-all (torchtitan's `gradient_divide_factor`).

With `ep = 1` the experts are ordinary parameters, FSDP-sharded with their block.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor

from orchestrator.errors import PlanError
from orchestrator.planning.mesh import EXPERT_AXES
from orchestrator.planning.resolve import Execution
from orchestrator.workloads.moe import GroupedExperts, moe_layers


def expert_parallel_mesh(ex: Execution, device_type: str) -> DeviceMesh | None:
    """The expert mesh over the same ranks as the dense one, for `ex.mesh.ep > 1` (None at
    ep=1): `ep` innermost, so an expert-parallel group is adjacent ranks, as placement lays
    them on one NVLink island. PlanError for what the runtime does not compose with it."""
    mesh = ex.mesh
    if mesh.ep == 1:
        return None
    if ex.ddp_reduces:
        raise PlanError(f"key 'parallel.ep': ep={mesh.ep} needs an FSDP2 strategy (zero2, zero3, hsdp); "
                        f"{ex.strategy} replicates whole parameters, which expert parallelism splits")
    return init_device_mesh(device_type, mesh.expert_shape, mesh_dim_names=EXPERT_AXES)


class _Dispatch:
    """Dispatch and combine of one layer's experts over an `ep` group (torchtitan's
    AllToAllTokenDispatcher); what dispatch learnt of the splits is kept for combine.

    Under tensor parallelism the ranks of a `tp` group hold the same tokens (and route them
    alike, so the router's gradient stays whole on each): each dispatches only its `1/tp`
    share of the sorted rows, and the experts' outputs are gathered back whole over `tp`
    (a DTensor Replicate -> Shard(0) and back, whose backward takes the share and gathers
    its gradient), so every row reaches its expert once."""

    def __init__(self, ep_mesh: DeviceMesh, tp_mesh: DeviceMesh | None) -> None:
        self.ep = ep_mesh.size()
        self.group = ep_mesh.get_group()
        self.tp_mesh = tp_mesh
        self.input_splits: list[int] = []
        self.output_splits: list[int] = []
        self.order = torch.empty(0, dtype=torch.long)
        self.whole_rows = 0

    def _share(self, rows: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This tp rank's chunk of the rows (torch.chunk's split, as Shard(0)'s) and the count
        of each expert's rows in it."""
        assert self.tp_mesh is not None
        tp, rank = self.tp_mesh.size(), self.tp_mesh.get_local_rank()
        self.whole_rows = rows.shape[0]
        size = -(-self.whole_rows // tp)
        start, end = min(rank * size, self.whole_rows), min((rank + 1) * size, self.whole_rows)
        ends = torch.cumsum(counts, 0)
        share = (torch.clamp(ends, max=end) - torch.clamp(ends - counts, min=start)).clamp(min=0)
        local = DTensor.from_local(rows, self.tp_mesh, [Replicate()]).redistribute(self.tp_mesh, [Shard(0)])
        return local.to_local(), share

    def dispatch(self, _module: nn.Module, inputs: tuple[torch.Tensor, torch.Tensor], _mesh: DeviceMesh) -> Any:
        rows, counts = inputs
        if self.tp_mesh is not None:
            rows, counts = self._share(rows, counts)
        with torch.no_grad():
            # counts[e]: this rank's rows for global expert e; received[r * L + l]: rank r's for
            # local expert l.
            received = funcol.all_to_all_single(counts, None, None, self.group)
            received = funcol.wait_tensor(received) if isinstance(received, funcol.AsyncCollectiveTensor) else received
            self.input_splits = counts.view(self.ep, -1).sum(1).tolist()
            self.output_splits = received.view(self.ep, -1).sum(1).tolist()
        rows = funcol.all_to_all_single_autograd(rows, self.output_splits, self.input_splits, self.group)
        by_rank = received.view(self.ep, -1)
        self.order = _expert_major(by_rank)
        return rows[self.order], by_rank.sum(0)

    def combine(self, _module: nn.Module, output: torch.Tensor, _mesh: DeviceMesh) -> torch.Tensor:
        back = torch.empty_like(output).index_copy_(0, self.order, output)
        mine = funcol.all_to_all_single_autograd(back, self.input_splits, self.output_splits, self.group)
        if self.tp_mesh is None:
            return mine
        whole = torch.Size([self.whole_rows, *mine.shape[1:]])
        shared = DTensor.from_local(mine, self.tp_mesh, [Shard(0)], shape=whole, stride=_contiguous(whole))
        return shared.redistribute(self.tp_mesh, [Replicate()]).to_local()


def _contiguous(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _expert_major(by_rank: torch.Tensor) -> torch.Tensor:
    """Row indices that reorder received rows from (source rank, local expert) blocks to
    (local expert, source rank) blocks; `by_rank[r, l]` is block (r, l)'s length."""
    lengths = by_rank.reshape(-1)
    starts = torch.cumsum(lengths, 0) - lengths
    blocks = torch.arange(lengths.numel(), device=lengths.device).view_as(by_rank).t().reshape(-1)
    new_lengths = lengths[blocks]
    new_starts = torch.cumsum(new_lengths, 0) - new_lengths
    shift = torch.repeat_interleave(starts[blocks] - new_starts, new_lengths)
    return torch.arange(int(lengths.sum()), device=lengths.device) + shift


def check_splittable(model: nn.Module) -> None:
    """PlanError where `model` holds routed experts other than the built-in family's
    (`GroupedExperts`, whose rows and counts the dispatch reads): a Hugging Face MoE runs its
    experts FSDP-sharded with their blocks, at ep=1."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "experts" and not isinstance(module, GroupedExperts):
            raise PlanError(f"key 'parallel.ep': expert parallelism splits the built-in MoE family's experts "
                            f"(orchestrator.workloads.moe); {name} is a {type(module).__name__}; use ep=1")


def apply_expert_parallel(model: nn.Module, expert_mesh: DeviceMesh, tp_mesh: DeviceMesh | None = None) -> int:
    """Hold `1/ep` of every MoE layer's experts on each rank and route their rows through the
    all-to-all, each rank of `tp_mesh` (ranks holding the same tokens; None without tensor
    parallelism) its share of them; returns the layers done. PlanError when `ep` does not
    divide the expert count."""
    check_splittable(model)
    ep_mesh = expert_mesh["ep"]
    ep = ep_mesh.size()
    layers = moe_layers(model)
    for layer in layers:
        experts = layer.cfg.num_experts
        if experts % ep:
            raise PlanError(f"key 'parallel.ep': ep={ep} must divide the model's {experts} experts per MoE layer "
                            f"(model.args.num_experts): each rank holds a whole share of them")

        def shard(_name: str, module: nn.Module, mesh: DeviceMesh) -> None:
            for name, p in list(module.named_parameters(recurse=False)):
                # Every rank holds the same whole value (or none yet, on meta): no communication.
                sharded = distribute_tensor(p.data, mesh, [Shard(0)], src_data_rank=None)
                module.register_parameter(name, nn.Parameter(sharded, requires_grad=p.requires_grad))

        route = _Dispatch(ep_mesh, tp_mesh if tp_mesh is not None and tp_mesh.size() > 1 else None)
        distribute_module(layer.experts, ep_mesh, shard, input_fn=route.dispatch, output_fn=route.combine)
    return len(layers)


def shard_experts(model: nn.Module, expert_mesh: DeviceMesh, replicate: bool, reshard_after_forward: bool,
                  policy: MixedPrecisionPolicy, data_parallel: int) -> None:
    """FSDP2 over the experts' own data-parallel ranks (`efsdp`, with `dp_replicate` as HSDP's
    replicas when `replicate`, else flattened into one shard group), before the blocks are
    wrapped on the dense mesh; gradients divided by all `data_parallel` ranks."""
    replicas = expert_mesh["dp_replicate"].size()
    if replicas == 1:
        mesh = expert_mesh["efsdp"]
    elif replicate:
        mesh = expert_mesh["dp_replicate", "efsdp"]
    else:
        mesh = expert_mesh["dp_replicate", "efsdp"]._flatten("expert_dp")
    shard_ranks = expert_mesh["efsdp"].size() * (1 if replicate else replicas)
    for layer in moe_layers(model):
        local_experts = layer.cfg.num_experts // expert_mesh["ep"].size()
        # More shard ranks than local experts would leave ranks empty: shard the width instead.
        dim = 1 if shard_ranks > local_experts else 0
        fully_shard(layer.experts, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy,
                    shard_placement_fn=lambda _p, dim=dim: Shard(dim))
        layer.experts.set_gradient_divide_factor(float(data_parallel))  # type: ignore[operator]
        if mesh.device_type == "cpu" and shard_ranks > 1:
            # gloo has no PREMUL_SUM, which a divide factor of its own reduce-scatters with:
            # FSDP2 then divides after a plain sum. (Over one shard rank it reduce-scatters
            # nothing and divides already; forcing the sum there would divide twice.)
            layer.experts.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]


def loss_group(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """The ranks that share this rank's loss: its pipeline stage's (all ranks without a pipeline)."""
    if mesh["pp"].size() == 1:
        return None
    return mesh["dp_replicate", "dp_shard", "cp", "tp"]._flatten("loss").get_group()


def install_load_balancing(model: nn.Module, optimizer: torch.optim.Optimizer,
                           group: dist.ProcessGroup | None, copies: int = 1) -> int:
    """DeepSeek-V3's bias update before every optimizer step, from the tokens each expert got in
    the step summed over `group` (the ranks that share the loss; None: the world, or this
    process alone without torch.distributed), where `copies` ranks route each token (the
    tensor-parallel ones). Returns the layers balanced; a model (or stage) with no MoE layer
    gets no hook and no collective."""
    layers = moe_layers(model)
    if not layers:
        return 0

    def balance(*_: object) -> None:
        counts = torch.stack([layer.step_counts() for layer in layers])
        if dist.is_initialized():
            dist.all_reduce(counts, group=group)
        counts /= copies
        for layer, c in zip(layers, counts):
            layer.balance(c)

    optimizer.register_step_pre_hook(balance)
    return len(layers)


def expert_load(modules: Iterable[nn.Module]) -> dict[str, Any] | None:
    """The last step's load of the MoE layers in `modules` (this rank's, all of a stage's under
    a pipeline), for the step's metrics row: `expert_tokens`, tokens per expert per layer over
    the ranks sharing the loss, and `expert_imbalance`, per layer the most tokens an expert got
    over the mean. None without MoE layers or before their first step."""
    loads = [m.last_load for module in modules for m in moe_layers(module) if m.last_load is not None]
    if not loads:
        return None
    imbalance = [float(c.max() / c.mean()) if float(c.sum()) > 0 else 1.0 for c in loads]
    return {"expert_tokens": [[int(n) for n in c.tolist()] for c in loads], "expert_imbalance": imbalance}
