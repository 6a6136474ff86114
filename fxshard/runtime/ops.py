"""The marker ops: where a parameter's full value is needed (``unshard``) and where its gradient leaves the full
shape (``reduce_grad``).

They are opaque custom ops so that Dynamo and AOT autograd carry them through tracing and partitioning as single
nodes; the passes lower them to ``_c10d_functional`` collectives afterwards. Their eager implementations do the
real work, so a prepared model also runs uncompiled.

The ops do not know the ZeRO stage; their arguments say how the parameter is laid out, and each stage is a choice
of layout made by ``prepare``:

- ``layout`` (a ``MarkerLayout`` value, ``fxshard/runtime/sharding.py``) says how: ``"gather"`` (stage 3: ``local``
  is the flat shard, gathered per use, the gradient reduce-scattered), ``"resident"`` (stage 2: ``resident`` is a
  full copy kept between steps, ``local`` the flat shard), ``"replicated"`` (stage 0: ``local`` is the full
  parameter, its gradient all-reduced) or ``"kept_local"`` (stage 0 under ``no_sync``: the gradient stays here);
- ``local`` is what this rank trains; ``resident`` the full copy (``"resident"``), else None;
- ``fqn`` names the parameter at its use site (``"blocks.0.attn.qkv.weight"``): the passes group markers into
  units by its module part. A tied parameter used by two modules gets one marker per use site;
- ``replicate_group_name`` (hybrid sharding on a 2-D mesh, else ""): after the reduce-scatter over the shard group
  (``group_name``), each rank's gradient shard is averaged over this group of the ranks that hold the same shard;
  ``replicate_size`` is its size;
- ``compute_dtype`` (mixed precision) is the dtype the full value is computed in: a shard is cast before it is
  gathered, so the all-gather moves compute-dtype bytes; ``reduce_dtype`` is the dtype a gradient is reduced in,
  and the reduced gradient comes back in ``grad_dtype``, the dtype of what this rank trains (the fp32 master).
  None means "the tensor's own dtype": no cast.
"""

from __future__ import annotations

import math

import torch

from fxshard.torch_compat import c10d_functional as _c10d

from .groups import peer_failures_explained, scatters_by_all_to_all
from .sharding import MarkerLayout, chunk_size


def flat_padded(full: torch.Tensor, world_size: int) -> torch.Tensor:
    """``full`` flattened and zero-padded to ``world_size`` row-aligned chunks (``chunk_size``): the layout a
    reduce-scatter splits."""
    flat = full.reshape(-1)
    padding = world_size * chunk_size(full.shape, world_size) - flat.numel()
    return torch.nn.functional.pad(flat, (0, padding)) if padding else flat.contiguous()


def reduce_scatter_mean(flat: torch.Tensor, world_size: int, group_name: str,
                        replicate_group_name: str = "") -> torch.Tensor:
    """This rank's slice of the average over the ranks of ``flat`` (of ``world_size`` equal slices), waited for: a
    reduce-scatter, or on gloo an all-to-all of the slices and their sum here (``scatters_by_all_to_all``); on a
    hybrid mesh then averaged over the ranks that hold the same slice (``replicate_group_name``)."""
    if scatters_by_all_to_all(group_name):
        slices = [flat.numel() // world_size] * world_size
        received = _c10d.wait_tensor(_c10d.all_to_all_single(flat, slices, slices, group_name))
        reduced = received.view(world_size, -1).sum(0).div_(world_size)
    else:
        reduced = _c10d.wait_tensor(_c10d.reduce_scatter_tensor(flat, "avg", world_size, group_name))
    if replicate_group_name:
        reduced = _c10d.wait_tensor(_c10d.all_reduce(reduced, "avg", replicate_group_name))
    return reduced


def cast_to(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``tensor`` in ``dtype``; itself when ``dtype`` is None or already its dtype."""
    return tensor if dtype is None or tensor.dtype == dtype else tensor.to(dtype)


@torch.library.custom_op("fxshard::unshard", mutates_args=())
def unshard(
    local: torch.Tensor,
    resident: torch.Tensor | None,
    full_shape: list[int],
    world_size: int,
    group_name: str,
    fqn: str,
    layout: str,
    compute_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    replicate_size: int = 1,
    replicate_group_name: str = "",
) -> torch.Tensor:
    """The parameter in its full shape: the resident copy, the full ``local`` itself, or the gathered shards."""
    if MarkerLayout(layout).reads_resident:
        return cast_to(resident, compute_dtype).clone()
    if not MarkerLayout(layout).gathers:
        return cast_to(local, compute_dtype).clone()
    shard = cast_to(local, compute_dtype).contiguous()
    with peer_failures_explained(f"the all-gather of {fqn}"):
        gathered = _c10d.wait_tensor(_c10d.all_gather_into_tensor(shard, world_size, group_name))
    return gathered[: math.prod(full_shape)].view(full_shape).clone()


@unshard.register_fake
def _(local, resident, full_shape, world_size, group_name, fqn, layout, compute_dtype=None, reduce_dtype=None,
      replicate_size=1, replicate_group_name=""):
    return local.new_empty(full_shape, dtype=compute_dtype or (resident if MarkerLayout(layout).reads_resident
                                                               else local).dtype)


@torch.library.custom_op("fxshard::reduce_grad", mutates_args=())
def reduce_grad(
    full_grad: torch.Tensor,
    world_size: int,
    group_name: str,
    fqn: str,
    layout: str,
    reduce_dtype: torch.dtype | None = None,
    grad_dtype: torch.dtype | None = None,
    replicate_size: int = 1,
    replicate_group_name: str = "",
) -> torch.Tensor:
    """Average a full-shape gradient over the ranks: this rank's flat shard of it (averaged over the shard group,
    then over the replicas of the shard), or all of it (or keep it local), as ``layout`` says."""
    grad = cast_to(full_grad, reduce_dtype)
    collective = MarkerLayout(layout).gradient_collective
    if collective is None:
        return cast_to(grad.contiguous().clone(), grad_dtype)
    with peer_failures_explained(f"the gradient reduction of {fqn}"):
        if collective == "all_reduce":
            reduced = _c10d.wait_tensor(_c10d.all_reduce(grad.contiguous(), "avg", group_name))
        else:
            reduced = reduce_scatter_mean(flat_padded(grad, world_size), world_size, group_name, replicate_group_name)
    return cast_to(reduced, grad_dtype)


@reduce_grad.register_fake
def _(full_grad, world_size, group_name, fqn, layout, reduce_dtype=None, grad_dtype=None, replicate_size=1,
      replicate_group_name=""):
    dtype = grad_dtype or reduce_dtype or full_grad.dtype
    if MarkerLayout(layout).gradient_collective != "reduce_scatter":
        return torch.empty_like(full_grad, dtype=dtype, memory_format=torch.contiguous_format)
    return full_grad.new_empty(chunk_size(full_grad.shape, world_size), dtype=dtype)


def _unshard_setup_context(ctx, inputs, output):
    (local, _, _, ctx.world_size, ctx.group_name, ctx.fqn, ctx.layout, _, ctx.reduce_dtype,
     ctx.replicate_size, ctx.replicate_group_name) = inputs
    ctx.local_dtype = local.dtype


def _unshard_backward(ctx, grad_full):
    grad_local = reduce_grad(grad_full, ctx.world_size, ctx.group_name, ctx.fqn, ctx.layout,
                             ctx.reduce_dtype, ctx.local_dtype, ctx.replicate_size, ctx.replicate_group_name)
    return grad_local, None, None, None, None, None, None, None, None, None, None


unshard.register_autograd(_unshard_backward, setup_context=_unshard_setup_context)

UNSHARD = torch.ops.fxshard.unshard.default
REDUCE_GRAD = torch.ops.fxshard.reduce_grad.default
