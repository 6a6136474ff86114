"""A model built on the meta device, materialised and initialised one unit at a time into this rank's shards.

``with torch.device("meta"): model = build()`` allocates nothing; ``prepare`` then makes one unit's parameters and
buffers real on the CPU at a time, initialises them, hands each parameter's full value to the layout (which keeps
this rank's shard at stage 3) and frees it before the next unit. A unit is one of the model's repeated blocks (a
transformer layer, as ``bucket="auto"`` finds them), or else one module. So a rank never holds more than its share
plus one unit's full parameters (two where a tied parameter's owners meet).

The initialisation contract (bit for bit):

- every rank starts from the first rank's CPU random state (broadcast), so ranks agree whatever they were seeded;
- modules are visited children first, in registration order, as ``model.apply(fn)`` visits them; each module that
  owns meta tensors, and every module inside a block, gets ``param_init_fn(module)`` when given, else
  ``module.reset_parameters()`` (what torch's layers call in their constructors). An init may write the tensors of
  its module and, inside a block, of the block's other modules (GPT-2 re-initialises ``c_proj`` from its parent);
- a parameter shared by several modules (a tied embedding and LM head) takes the values of its first owner's init;
  a later owner's init outside that unit runs on a scratch copy, drawing the same random numbers and changing
  nothing, as in a model initialised whole and tied afterwards.

So the values equal a normal CPU build with the same seed wherever the model's initialisation is per module in that
order (torch's layers; a model built from them); and, with ``param_init_fn=model._init_weights``, a HuggingFace
model's own meta-device initialisation (``to_empty`` then ``init_weights()``).

Nothing is left uninitialised: floating tensors are filled with NaN before the init and checked when their unit is
done; other dtypes (masks, position ids) are initialised twice from two different fills and must agree. A tensor the
init did not write raises FxShardError naming it and the fix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from fxshard.errors import FxShardError
from fxshard.torch_compat import own_buffers, own_parameters

InitFn = Callable[[nn.Module], None]


def born_on_meta(model: nn.Module) -> bool:
    """Whether ``model`` was built on the meta device: every parameter there (buffers may be real), or none."""
    params = list(model.named_parameters())
    on_meta = [name for name, p in params if p.is_meta]
    if not on_meta:
        if any(b.is_meta for b in model.buffers()):
            name = next(n for n, b in model.named_buffers() if b.is_meta)
            raise FxShardError(f"buffer {name} is on the meta device but the parameters are not: build the whole "
                               'model under torch.device("meta"), or none of it')
        return False
    real = [name for name, p in params if not p.is_meta]
    if real:
        raise FxShardError(f"parameters {on_meta[:2]} are on the meta device and {real[:2]} are not: build the whole "
                           'model under torch.device("meta"), or none of it')
    return True


def default_device(group) -> torch.device:
    """Where a meta-born model's shards live: the current CUDA device for an NCCL group, else the CPU."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def share_random_state(groups, device: torch.device) -> None:
    """Every rank takes the first rank's CPU random state (over each group in turn, as the broadcast of a built
    model's values goes), so that their inits draw the same numbers."""
    state = torch.get_rng_state()
    for group in groups:
        moved = state.to(device)
        dist.broadcast(moved, src=dist.get_global_rank(group, 0), group=group)
        state = moved.cpu()
    torch.set_rng_state(state)


def _run_init(module: nn.Module, init: InitFn | None) -> None:
    if init is not None:
        init(module)
    elif callable(getattr(module, "reset_parameters", None)):
        module.reset_parameters()


def _fill(tensor: torch.Tensor, first: bool) -> None:
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.fill_(float("nan"))
    else:
        tensor.fill_(0 if first else 1)


@dataclasses.dataclass
class _Slot:
    """One meta tensor of a module, real while its unit is being initialised."""

    module: nn.Module
    path: str  # the tensor's qualified name
    name: str
    meta: torch.Tensor
    real: torch.Tensor
    is_param: bool
    keeps: bool  # a parameter's first owner: its value is kept (a later owner's copy is scratch)


@torch.no_grad()
def materialise_unit_by_unit(model: nn.Module, init: InitFn | None,
                             keep: Callable[[nn.Parameter, torch.Tensor], None], device: torch.device,
                             blocks: tuple[str, ...] = ()) -> dict[str, int]:
    """Materialise and initialise ``model``'s meta tensors unit by unit (see the module's docstring): a unit is one of
    ``blocks`` (module names: every module inside initialises with the block's tensors real, so an init that reaches
    into a child, as GPT-2's scaled ``c_proj`` init does, sees it), or else one module. Each parameter's full value
    (on ``device``) goes to ``keep(meta_param, full)`` once, when its first owner's unit is done, and is dropped
    after; the modules keep their meta parameters (prepare lays them out). Buffers become real on ``device``. On
    FxShardError the model is left as it was (on meta). Returns {unit: parameter elements it held real at once}
    for the units that own parameters (a tied parameter's later owner holds a scratch copy: counted there too)."""
    held: dict[str, int] = {}
    pending: list[_Slot] = []
    kept: set[int] = set()
    replaced_buffers: list[tuple[nn.Module, str, torch.Tensor]] = []
    try:
        for unit, modules in _units(model, blocks):
            for path, module in modules:
                pending.extend(_materialised(module, path, pending, kept))
            in_block = unit in blocks
            initialised = [m for _, m in modules if in_block or any(s.module is m for s in pending)]
            if initialised:
                _initialise(initialised, pending, init)
            elements = sum({id(s.real): s.real.numel() for s in pending if s.is_param}.values())
            if elements:
                held[unit] = elements
            _finish_unit(pending, init, keep, device, replaced_buffers)
            pending.clear()
    except BaseException:
        for slot in pending:
            (own_parameters(slot.module) if slot.is_param else own_buffers(slot.module))[slot.name] = slot.meta
        for module, name, meta in replaced_buffers:
            own_buffers(module)[name] = meta
        raise
    return held


def _units(model: nn.Module, blocks: tuple[str, ...]) -> list[tuple[str, list[tuple[str, nn.Module]]]]:
    """The units in the order they are materialised: (name, [(path, module), ...] children first), a block with
    every module inside it, any other module alone."""
    paths = {id(m): path for path, m in model.named_modules()}
    units: list[tuple[str, list[tuple[str, nn.Module]]]] = []
    for module in _children_first(model):
        path = paths[id(module)]
        unit = next((b for b in blocks if path == b or path.startswith(b + ".")), path)
        if units and units[-1][0] == unit:  # a block's modules come one after another, children first
            units[-1][1].append((path, module))
        else:
            units.append((unit, [(path, module)]))
    return units


def _children_first(model: nn.Module) -> list[nn.Module]:
    """Every module once, children before their parent, as ``nn.Module.apply`` visits them."""
    order, seen = [], set()

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if id(child) not in seen:
                seen.add(id(child))
                visit(child)
        order.append(module)

    visit(model)
    return order


def _materialised(module: nn.Module, path: str, pending: list[_Slot], kept: set[int]) -> list[_Slot]:
    """``module``'s own meta tensors made real (empty) and installed in it. A parameter tied to one of the unit's
    pending slots shares its real tensor; one whose first owner's unit is done gets a scratch copy."""
    prefix = f"{path}." if path else ""
    slots = []
    for is_param, tensors in ((True, own_parameters(module)), (False, own_buffers(module))):
        for name, meta in list(tensors.items()):
            if meta is None or not meta.is_meta:
                continue
            shared = next((s for s in pending if s.is_param and s.meta is meta), None) if is_param else None
            real = shared.real if shared is not None else torch.empty(meta.shape, dtype=meta.dtype)
            keeps = is_param and shared is None and id(meta) not in kept
            if keeps:
                kept.add(id(meta))
            slots.append(_Slot(module, prefix + name, name, meta, real, is_param, keeps))
            tensors[name] = nn.Parameter(real, requires_grad=meta.requires_grad) if is_param else real
    return slots


def _initialise(modules: list[nn.Module], slots: list[_Slot], init: InitFn | None) -> None:
    """Fill the unit's ``slots`` (NaN, or a first value where a dtype has none) and run each of ``modules``' init in
    turn. Tensors without NaN are initialised twice, from two fills and the same random state, and must come out
    alike: checked once the whole unit ran, as a block's module may write another's tensors."""
    plain = [s for s in slots if not (s.real.is_floating_point() or s.real.is_complex())]
    second = None
    if plain:
        state = torch.get_rng_state()
        for slot in slots:
            _fill(slot.real, first=False)
        for module in modules:
            _run_init(module, init)
        second = [s.real.clone() for s in plain]
        torch.set_rng_state(state)
    for slot in slots:
        _fill(slot.real, first=True)
    for module in modules:
        _run_init(module, init)
    for slot, other in zip(plain, second or ()):
        if not torch.equal(slot.real, other):
            raise _unwritten(slot, init)


def _finish_unit(slots: list[_Slot], init: InitFn | None, keep, device, replaced_buffers: list) -> None:
    for slot in slots:  # a later owner's scratch copy of a tied parameter is not checked: nothing keeps it
        checked = not slot.is_param or slot.keeps
        if checked and (slot.real.is_floating_point() or slot.real.is_complex()) and bool(slot.real.isnan().any()):
            raise _unwritten(slot, init)
    for slot in slots:
        if slot.is_param:
            own_parameters(slot.module)[slot.name] = slot.meta
            if slot.keeps:
                keep(slot.meta, slot.real.to(device))
        else:
            own_buffers(slot.module)[slot.name] = slot.real.to(device)
            replaced_buffers.append((slot.module, slot.name, slot.meta))


def _unwritten(slot: _Slot, init: InitFn | None) -> FxShardError:
    module = type(slot.module).__name__
    if init is not None:
        why = f"param_init_fn({module}) left it unwritten"
    elif callable(getattr(slot.module, "reset_parameters", None)):
        why = f"{module}.reset_parameters() left it unwritten"
    else:
        why = f"{module} has no reset_parameters()"
    return FxShardError(
        f"{'parameter' if slot.is_param else 'buffer'} {slot.path} (shape {list(slot.real.shape)}) of a model built "
        f"on the meta device was not initialised: {why}. Give {module} a reset_parameters() that initialises every "
        "tensor it owns, or pass backend.prepare(..., param_init_fn=fn) where fn(module) does (HuggingFace: "
        "param_init_fn=model._init_weights); a buffer computed in __init__ (a causal mask, a rotary table) must be "
        "computed there too"
    )
