"""The marker ops: where a parameter's full value is needed (``unshard``) and where its gradient leaves the full
shape (``reduce_grad``).

They are opaque custom ops so that Dynamo and AOT autograd carry them through tracing and partitioning as single
nodes; the passes lower them to ``_c10d_functional`` collectives afterwards. Their eager implementations do the
real collectives, so a prepared model also runs uncompiled. They do not know the ZeRO stage: a stage is a lowering.

Both ops take ``fqn``, the fully qualified name of the parameter at its use site (``"blocks.0.attn.qkv.weight"``):
the passes group markers into units by the module part of that name. A tied parameter used by two modules gets
one marker per use site, each with its own ``fqn``.
"""

from __future__ import annotations

import math

import torch

_c10d = torch.ops._c10d_functional


def _flat_padded(full: torch.Tensor, world_size: int) -> torch.Tensor:
    flat = full.reshape(-1)
    padding = -flat.numel() % world_size
    return torch.nn.functional.pad(flat, (0, padding)) if padding else flat.contiguous()


@torch.library.custom_op("fxshard::unshard", mutates_args=())
def unshard(shard: torch.Tensor, full_shape: list[int], world_size: int, group_name: str, fqn: str) -> torch.Tensor:
    """All-gather the flat shards of one parameter and return it in its full shape (padding dropped)."""
    gathered = _c10d.wait_tensor(_c10d.all_gather_into_tensor(shard.contiguous(), world_size, group_name))
    return gathered[: math.prod(full_shape)].view(full_shape).clone()


@unshard.register_fake
def _(shard, full_shape, world_size, group_name, fqn):
    return shard.new_empty(full_shape)


@torch.library.custom_op("fxshard::reduce_grad", mutates_args=())
def reduce_grad(full_grad: torch.Tensor, world_size: int, group_name: str, fqn: str) -> torch.Tensor:
    """Average a full-shape gradient over the ranks and return this rank's flat shard of the result."""
    return _c10d.wait_tensor(_c10d.reduce_scatter_tensor(_flat_padded(full_grad, world_size), "avg", world_size, group_name))


@reduce_grad.register_fake
def _(full_grad, world_size, group_name, fqn):
    return full_grad.new_empty(-(-full_grad.numel() // world_size))


def _unshard_setup_context(ctx, inputs, output):
    _, _, ctx.world_size, ctx.group_name, ctx.fqn = inputs


def _unshard_backward(ctx, grad_full):
    return reduce_grad(grad_full, ctx.world_size, ctx.group_name, ctx.fqn), None, None, None, None


unshard.register_autograd(_unshard_backward, setup_context=_unshard_setup_context)

UNSHARD = torch.ops.fxshard.unshard.default
REDUCE_GRAD = torch.ops.fxshard.reduce_grad.default
