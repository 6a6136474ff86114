"""The marker ops: where a parameter's full value is needed (``unshard``) and where its gradient leaves the full
shape (``reduce_grad``).

They are opaque custom ops so that Dynamo and AOT autograd carry them through tracing and partitioning as single
nodes; the passes lower them to ``_c10d_functional`` collectives afterwards. Their eager implementations do the
real work, so a prepared model also runs uncompiled.

The ops do not know the ZeRO stage; their arguments say how the parameter is laid out, and each stage is a choice
of layout made by ``prepare``:

- ``local`` is what this rank trains: the flat shard (``grad_reduction="reduce_scatter"``, stages 2 and 3) or the
  full parameter (``"all_reduce"``, stage 0; ``"none"`` under ``no_sync``, where gradients accumulate locally);
- ``resident`` is a full copy kept between steps (stage 2), or None when the full value must be gathered from
  the shards (stage 3) or is ``local`` itself (stage 0);
- ``fqn`` names the parameter at its use site (``"blocks.0.attn.qkv.weight"``): the passes group markers into
  units by its module part. A tied parameter used by two modules gets one marker per use site.
"""

from __future__ import annotations

import math

import torch

_c10d = torch.ops._c10d_functional

GRAD_REDUCTIONS = ("reduce_scatter", "all_reduce", "none")


def _flat_padded(full: torch.Tensor, world_size: int) -> torch.Tensor:
    flat = full.reshape(-1)
    padding = -flat.numel() % world_size
    return torch.nn.functional.pad(flat, (0, padding)) if padding else flat.contiguous()


@torch.library.custom_op("fxshard::unshard", mutates_args=())
def unshard(
    local: torch.Tensor,
    resident: torch.Tensor | None,
    full_shape: list[int],
    world_size: int,
    group_name: str,
    fqn: str,
    grad_reduction: str,
) -> torch.Tensor:
    """The parameter in its full shape: the resident copy, the full ``local`` itself, or the gathered shards."""
    if resident is not None:
        return resident.clone()
    if grad_reduction != "reduce_scatter":
        return local.clone()
    gathered = _c10d.wait_tensor(_c10d.all_gather_into_tensor(local.contiguous(), world_size, group_name))
    return gathered[: math.prod(full_shape)].view(full_shape).clone()


@unshard.register_fake
def _(local, resident, full_shape, world_size, group_name, fqn, grad_reduction):
    return local.new_empty(full_shape)


@torch.library.custom_op("fxshard::reduce_grad", mutates_args=())
def reduce_grad(full_grad: torch.Tensor, world_size: int, group_name: str, fqn: str, grad_reduction: str) -> torch.Tensor:
    """Average a full-shape gradient over the ranks: this rank's flat shard of it, or all of it (or keep it local)."""
    if grad_reduction == "none":
        return full_grad.contiguous().clone()
    if grad_reduction == "all_reduce":
        return _c10d.wait_tensor(_c10d.all_reduce(full_grad.contiguous(), "avg", group_name))
    flat = _flat_padded(full_grad, world_size)
    return _c10d.wait_tensor(_c10d.reduce_scatter_tensor(flat, "avg", world_size, group_name))


@reduce_grad.register_fake
def _(full_grad, world_size, group_name, fqn, grad_reduction):
    if grad_reduction != "reduce_scatter":
        return torch.empty_like(full_grad, memory_format=torch.contiguous_format)
    return full_grad.new_empty(-(-full_grad.numel() // world_size))


def _unshard_setup_context(ctx, inputs, output):
    _, _, _, ctx.world_size, ctx.group_name, ctx.fqn, ctx.grad_reduction = inputs


def _unshard_backward(ctx, grad_full):
    grad_local = reduce_grad(grad_full, ctx.world_size, ctx.group_name, ctx.fqn, ctx.grad_reduction)
    return grad_local, None, None, None, None, None, None


unshard.register_autograd(_unshard_backward, setup_context=_unshard_setup_context)

UNSHARD = torch.ops.fxshard.unshard.default
REDUCE_GRAD = torch.ops.fxshard.reduce_grad.default
