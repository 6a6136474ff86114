"""Which modules share one collective: the blocks behind ``bucket="block"`` and ``bucket="auto"``.

The passes see parameter names only, never modules, so the backend turns what the user named (module names or
classes, ``blocks=[...]``) or what it found itself (``bucket="auto"``) into module-name prefixes before it builds the
``PassContext``; ``bucket_pass`` then gives each parameter the innermost block that holds it.

``bucket="auto"`` finds what a FSDP2 user wraps with ``fully_shard`` by hand: the *repeated blocks* of the model,
i.e. the children of a ``ModuleList``, ``Sequential`` or ``ModuleDict`` whose class at least one sibling shares and
which hold parameters (a transformer's layers, a ResNet stage's blocks), at any depth, plus the model itself, which
takes every parameter no repeated block holds (embeddings, final norm, head: FSDP2's ``fully_shard(model)``). A
repeated block inside another one is a block of its own. A model with no repeated block is grouped per layer: one
block for the whole model would gather all of it at once, which is no ZeRO-3 at all.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

from torch import nn

from fxshard.errors import FxShardError

ROOT = ""  # the model itself as a block: it holds what no inner block does
_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def block_prefixes(model: nn.Module | None, blocks: Iterable[str | type]) -> tuple[str, ...]:
    """Module names for ``blocks``: names are checked against ``model``, classes become the names of their instances.

    Raises FxShardError for a name that is no module of ``model``, a class with no instance in it, or a class when
    there is no prepared model to look it up in.
    """
    blocks = tuple(blocks)
    if model is None:
        classes = [b.__name__ for b in blocks if isinstance(b, type)]
        if classes:
            raise FxShardError(f"blocks={classes} names module classes, which need the model: call "
                               "backend.prepare(model) before torch.compile, or pass module names (\"blocks.0\")")
        return blocks
    modules = dict(model.named_modules())
    prefixes: list[str] = []
    for block in blocks:
        if isinstance(block, type):
            names = [name for name, module in modules.items() if isinstance(module, block)]
            if not names:
                raise FxShardError(f"blocks: no submodule of {type(model).__name__} is a {block.__name__}; "
                                   "pass module classes the model uses, or module names")
            prefixes.extend(names)
        elif isinstance(block, str) and block in modules:
            prefixes.append(block)
        else:
            known = ", ".join(list(n for n in modules if n)[:8])
            raise FxShardError(f"blocks: {block!r} is no submodule of {type(model).__name__} (its modules: "
                               f"{known}, ...); pass module names or classes")
    return tuple(dict.fromkeys(prefixes))


def repeated_blocks(model: nn.Module) -> tuple[str, ...]:
    """The names of ``model``'s repeated blocks, in module order, and ``ROOT`` after them; () if it has none."""
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, _CONTAINERS):
            continue
        children = [(child_name, child) for child_name, child in module.named_children()
                    if any(True for _ in child.parameters())]
        classes = collections.Counter(type(child) for _, child in children)
        found += [f"{name}.{child_name}" if name else child_name
                  for child_name, child in children if classes[type(child)] > 1]
    return (*found, ROOT) if found else ()


def describe_grouping(bucket: str | int, blocks: tuple[str, ...]) -> str:
    """One line for the report: how the backend groups parameters into collectives (``blocks`` resolved)."""
    if isinstance(bucket, int):
        return f"grouping: consecutive layers up to {bucket} bytes per collective"
    inner = [b for b in blocks if b != ROOT]
    if bucket == "layer" or not blocks:
        return f'grouping: bucket="{bucket}", one collective per layer' + (" (no repeated blocks found)"
                                                                          if bucket == "auto" else "")
    shown = ", ".join(inner) if len(inner) <= 4 else f"{inner[0]}, {inner[1]}, ..., {inner[-1]}"
    rest = " + the model itself (unit root)" if ROOT in blocks else ", other parameters per layer"
    return f'grouping: bucket="{bucket}", {len(inner)} blocks ({shown}){rest}'
