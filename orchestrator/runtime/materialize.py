"""Build a model without memory, then give each rank its own shards of one initialisation.

A rank builds the model with its parameters on the meta device (buffers stay real: rotary
tables and the like are computed by the constructor and cannot be recomputed later), the
runtime splits and shards the meta model (pipeline, tensor parallelism, FSDP2), and only then
does each rank allocate its own shards (``to_empty``) and fill them. No rank ever holds the
whole model, so a model runs whenever its shards fit.

The values do not depend on the plan: every parameter is initialised by the module that owns
it, whole, from a seed of its own (the job's seed and the module's name), and each rank keeps
its slice of that whole value (``distribute_tensor`` without communication). ddp, zero3,
tp=2, pp=2 and one process all hold the same full weights. Generating a module's whole value
costs one module's memory at a time, less than FSDP gathers anyway.

A module is initialised as its constructor would: its own ``reset_parameters()`` (torch's
layers), then the model's hook for it: ``model.init_module(module, name)`` (the built-in GPT
and Llama), or a Hugging Face model's ``_init_weights(module)``. A model with a module that
holds parameters but has neither is built whole on each rank's host, as before, and the
runtime says so: it cannot be initialised one module at a time.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torch.distributed.tensor import DTensor, distribute_tensor

from ..config import ModelConfig
from ..errors import ConfigError
from ..workloads.models import build_model
from .state_names import tied_aliases

WRAPPER_PARTS = (_CHECKPOINT_PREFIX.rstrip("."), "_fsdp_wrapped_module", "_orig_mod")
"""Module names wrapping inserts into parameter names (activation checkpointing, FSDP1,
torch.compile)."""


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Parameters registered inside go to the meta device; everything else stays where it is
    created. (``torch.device("meta")`` would put buffers there too, and a rotary table's
    values exist only in the constructor.)"""
    register = nn.Module.register_parameter

    plain = set(torch.empty(0).__dict__) | {"_is_param"}

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            # The parameter's own class where it has one; under fake mode (a rehearsal) a new
            # parameter is a FakeTensor marked as one, whose __dict__ is the fake mode's.
            cls = type(param) if issubclass(type(param), nn.Parameter) else nn.Parameter
            extra = {k: v for k, v in param.__dict__.items() if k not in plain}
            param = cls(param.to("meta"), requires_grad=param.requires_grad)
            param.__dict__.update(extra)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def clean_name(name: str) -> str:
    """A parameter's name as the unwrapped model registers it."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_PARTS)


def _seed_of(seed: int, module_name: str) -> int:
    """A seed for one module: stable across processes and Python runs (unlike `hash` of a str)."""
    digest = hashlib.blake2b(f"{seed}:{module_name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


def _model_hook(model: nn.Module) -> Callable[[nn.Module, str], None] | None:
    """The model's own per-module initialisation, if it has one."""
    hook = getattr(model, "init_module", None)
    if callable(hook):
        return hook
    hf = getattr(model, "_init_weights", None)
    if callable(hf) and hasattr(model, "config"):
        return lambda module, _name: hf(module)
    return None


@dataclass
class InitRecipe:
    """How to compute the whole initial value of every parameter, from the whole meta model."""

    seed: int
    """The job's `train.seed`; each module's seed derives from it and the module's name."""
    owners: dict[str, tuple[str, str]]
    """Canonical parameter name -> (owning module's name, the parameter's name in it)."""
    stand_ins: dict[str, nn.Module]
    """Owning module's name -> a meta copy of it (the model's own modules are split and
    wrapped by the time values are needed)."""
    hook: Callable[[nn.Module, str], None] | None
    """The model's per-module initialisation, called after the module's reset_parameters."""
    _cache: tuple[str, dict[str, torch.Tensor]] | None = field(default=None, init=False, repr=False)

    def full_value(self, name: str, device: torch.device) -> torch.Tensor:
        """The whole initial value of the canonical parameter `name` on `device`."""
        module_name, local = self.owners[name]
        if self._cache is None or self._cache[0] != module_name:
            # A module's parameters come one after another, so one module's values are kept.
            self._cache = (module_name, self._initialise(module_name, device))
        return self._cache[1][local]

    def _initialise(self, module_name: str, device: torch.device) -> dict[str, torch.Tensor]:
        stand_in = copy_module(self.stand_ins[module_name]).to_empty(device=device, recurse=False)
        values = dict(stand_in.named_parameters(recurse=False))
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            for p in values.values():
                if p.is_floating_point():
                    p.fill_(float("nan"))  # what no initialisation touched stays NaN
            torch.manual_seed(_seed_of(self.seed, module_name))
            if callable(getattr(stand_in, "reset_parameters", None)):
                stand_in.reset_parameters()
            if self.hook is not None:
                self.hook(stand_in, module_name)
        for name, p in values.items():
            if p.is_floating_point() and not is_fake(p) and bool(torch.isnan(p).all()):
                raise ConfigError(
                    f"key 'model.factory': nothing initialises {_join(module_name, name)} of "
                    f"{type(stand_in).__name__}: neither its reset_parameters() nor the model's "
                    f"init_module(module, name) sets it")
        return {n: p.detach() for n, p in values.items()}

    def clear(self) -> None:
        self._cache = None


def init_recipe(model: nn.Module, seed: int) -> tuple[InitRecipe | None, str]:
    """The recipe for `model` (whole, on meta), or (None, why) when some module holding
    parameters has no initialisation of its own."""
    hook = _model_hook(model)
    aliases = tied_aliases(model)
    owners: dict[str, tuple[str, str]] = {}
    stand_ins: dict[str, nn.Module] = {}
    for module_name, module in model.named_modules():
        # The module owning a parameter is the one holding it under its canonical name.
        mine = [n for n, p in module._parameters.items() if p is not None and _join(module_name, n) not in aliases]
        if not mine:
            continue
        if hook is None and not callable(getattr(module, "reset_parameters", None)):
            return None, (f"{type(module).__name__} at '{module_name or '<root>'}' holds parameters but has no "
                          f"reset_parameters() and the model defines no init_module(module, name)")
        stand_ins[module_name] = copy_module(module)  # meta: copying costs no memory
        for n in mine:
            owners[_join(module_name, n)] = (module_name, n)
    return InitRecipe(seed, owners, stand_ins, hook), ""


def copy_module(module: nn.Module) -> nn.Module:
    """A deep copy of `module` whose fake tensors (a rehearsal builds the model in a fake mode)
    stay in their own fake mode. A plain deepcopy copies the mode with them, and with it the
    weak storage references the mode keeps for its constants, each of which both copies then
    free: the process's heap is corrupted, and it crashes later at any allocation."""
    memo: dict[int, object] = {}
    for t in [*module.parameters(), *module.buffers()]:
        mode = getattr(t, "fake_mode", None)
        if mode is not None:
            memo[id(mode)] = mode
    return copy.deepcopy(module, memo)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def allocate(module: nn.Module, device: torch.device) -> None:
    """Give `module`'s meta parameters (possibly DTensors sharded by FSDP2 or tensor
    parallelism) storage on `device`, uninitialised; real buffers move there as they are."""
    buffers = {name: b for name, b in module.named_buffers() if not b.is_meta}
    ties = _ties(module)
    module.to_empty(device=device)
    # to_empty gives each place a plain parameter sits its own new Parameter: tie them again.
    for holder, name, owner, owner_name in ties:
        holder._parameters[name] = owner._parameters[owner_name]
    for name, b in buffers.items():
        owner, _, leaf = name.rpartition(".")
        module.get_submodule(owner)._buffers[leaf] = b.to(device)


def materialize(module: nn.Module, recipe: InitRecipe, device: torch.device, aliases: dict[str, str]) -> None:
    """Allocate `module`'s parameters on `device` and fill each with this rank's slice of its
    whole initial value."""
    allocate(module, device)
    with torch.no_grad():
        for name, p in module.named_parameters():
            full = recipe.full_value(aliases.get(clean_name(name), clean_name(name)), device)
            if isinstance(p, DTensor):
                # Every rank computed the same whole value: slicing needs no communication.
                local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
                p.to_local().copy_(local)
            else:
                p.copy_(full)
    recipe.clear()


def _ties(module: nn.Module) -> list[tuple[nn.Module, str, nn.Module, str]]:
    """(module, name, first module, its name) for every parameter registered a second time."""
    first: dict[int, tuple[nn.Module, str]] = {}
    ties = []
    for _, mod in module.named_modules(remove_duplicate=False):
        for name, p in mod._parameters.items():
            if p is None:
                continue
            if id(p) in first:
                ties.append((mod, name, *first[id(p)]))
            else:
                first[id(p)] = (mod, name)
    return ties


def build_on_meta(m: ModelConfig, model_fn: Callable[..., nn.Module] | None = None) -> nn.Module:
    """The job's model with every parameter on the meta device."""
    with params_on_meta():
        return build_model(m, model_fn)


def build_initialised(m: ModelConfig, seed: int, device: torch.device | str = "cpu",
                      model_fn: Callable[..., nn.Module] | None = None) -> nn.Module:
    """The whole model in one process with exactly the values any plan's ranks hold between
    them: the reference a sharded run is compared with."""
    device = torch.device(device)
    model = build_on_meta(m, model_fn)
    recipe, why = init_recipe(model, seed)
    if recipe is None:
        raise ValueError(f"the model cannot be initialised module by module: {why}")
    materialize(model, recipe, device, tied_aliases(model))
    return model
