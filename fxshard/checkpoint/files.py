"""Checkpoint directories a training loop saves and resumes from: ``save`` / ``load`` / ``latest``.

``save`` writes into ``<path>.partial`` and renames it to ``<path>`` once every rank finished, so a process killed
in the middle of a save leaves the previous checkpoint the newest complete one; ``load`` checks a checkpoint against
the model before anything changes (another model's checkpoint, a missing or truncated shard file: ``FxShardError``).
"""

from __future__ import annotations

import math
import os
import pathlib
import re

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fxshard.errors import FxShardError
from fxshard.torch_compat import dcp_flat_keys

from .state_dict import checkpoint_group, get_state_dict, is_first_rank, prepared_module, set_state_dict

# -- save / load / latest: a checkpoint directory per save -----------------------------------------------------------
_PARTIAL = ".partial"


def _validated_extra(extra_state: dict | None) -> dict:
    extra_state = dict(extra_state or {})
    for key, value in extra_state.items():
        if not isinstance(key, str) or "." in key or not (torch.is_tensor(value) or isinstance(value, (int, float, str, bytes))):
            raise FxShardError(
                f"extra_state[{key!r}] = {type(value).__name__}: extra_state takes names without dots mapped to "
                "tensors, ints, floats, strings or bytes (the same on every rank), e.g. {'step': 100}"
            )
    return extra_state


def save(model: nn.Module, optimizer: torch.optim.Optimizer, path: str | os.PathLike, *,
         extra_state: dict | None = None) -> pathlib.Path:
    """Write a sharded checkpoint of ``model``, ``optimizer`` and ``extra_state`` (step counters, data-loader
    state: the same on every rank) into the directory ``path``, each rank writing its shards. Every rank calls it.

    Crash safety: the files go to ``<path>.partial``, which the first rank renames to ``path`` after every rank
    finished writing, so ``path`` exists only complete, and a process killed during the save leaves the previous
    checkpoint the newest complete one (``latest``). A ``<path>.partial`` left by a killed save is written over.
    """
    path = pathlib.Path(path)
    module = prepared_module(model)
    group = checkpoint_group(module)
    extra = _validated_extra(extra_state)
    if path.exists():
        raise FxShardError(f"{path} exists; save each checkpoint into a new directory (e.g. one per step)")
    partial = path.with_name(path.name + _PARTIAL)
    model_state, optim_state = get_state_dict(module, optimizer)
    dcp.save({"model": model_state, "optim": optim_state, "extra": extra}, checkpoint_id=partial,
             process_group=group)
    dist.barrier(group=group)  # every rank's files and the metadata are written
    if is_first_rank(group):
        os.replace(partial, path)
    dist.barrier(group=group)
    return path


_STEP = re.compile(r"^(.*?)(\d+)$")


def latest(directory: str | os.PathLike) -> pathlib.Path | None:
    """The newest complete checkpoint in ``directory`` (the subdirectory with the highest number at the end of its
    name that ``save`` finished: not ``*.partial``), or None."""
    directory = pathlib.Path(directory)
    if not directory.is_dir():
        return None
    complete = [p for p in directory.iterdir()
                if p.is_dir() and not p.name.endswith(_PARTIAL) and _STEP.match(p.name) and (p / ".metadata").exists()]
    return max(complete, key=lambda p: int(_STEP.match(p.name).group(2)), default=None)


def _check_checkpoint(path: pathlib.Path, template: dict):
    """The checkpoint's metadata, after checking that it holds every key of ``template`` at the same shape, that its
    chunks cover each tensor and that every file a chunk lives in is there, long enough. FxShardError otherwise, on
    every rank alike (they read the same files)."""
    from torch.distributed.checkpoint import FileSystemReader

    if not (path / ".metadata").is_file():
        raise FxShardError(f"{path} is not a complete checkpoint (no .metadata); load one that save() finished, "
                           "e.g. fxshard.checkpoint.latest(directory)")
    metadata = FileSystemReader(path).read_metadata()
    saved = metadata.state_dict_metadata
    wanted = {k: v for k, v in dcp_flat_keys(template).items() if not k.startswith("extra.")}
    missing = sorted(set(wanted) - set(saved))
    mismatched = [(k, list(saved[k].size), list(v.shape)) for k, v in wanted.items()
                  if k in saved and torch.is_tensor(v) and isinstance(saved[k], TensorStorageMetadata)
                  and tuple(saved[k].size) != tuple(v.shape)]
    if missing or mismatched:
        raise FxShardError(
            f"{path} is not a checkpoint of this model and optimizer: "
            + (f"it lacks {missing[:4]}{' ...' if len(missing) > 4 else ''}" if missing else "")
            + ("; " if missing and mismatched else "")
            + ("; ".join(f"{k} has shape {got} there, {want} here" for k, got, want in mismatched[:4]))
            + "; load a checkpoint saved from the same model (any world size and stage)"
        )
    for key, entry in saved.items():
        if isinstance(entry, TensorStorageMetadata):
            covered = sum(math.prod(chunk.sizes) for chunk in entry.chunks)
            if covered < math.prod(entry.size):
                raise FxShardError(f"{path}: the shards of {key} cover {covered} of its {math.prod(entry.size)} "
                                   "elements; the checkpoint is incomplete, load another one")
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, length in sorted(needed.items()):
        file = path / name
        if not file.is_file() or file.stat().st_size < length:
            state = "missing" if not file.is_file() else f"{file.stat().st_size} bytes, {length} needed"
            raise FxShardError(f"{path}: shard file {name} is {state}; the checkpoint is incomplete or damaged, "
                               "load another one (e.g. an earlier step)")
    return metadata


def load(model: nn.Module, optimizer: torch.optim.Optimizer, path: str | os.PathLike) -> dict:
    """Load a checkpoint ``save`` wrote (at any world size and stage, or one FSDP2 wrote with ``get_state_dict`` under
    the keys ``model`` and ``optim``) into a prepared model and optimizer, also one that has not stepped yet;
    returns its ``extra_state``. Everything is checked before anything changes: a checkpoint of another model, or
    one with a shard file missing, raises FxShardError. Every rank calls it."""
    path = pathlib.Path(path)
    module = prepared_module(model)
    group = checkpoint_group(module)
    model_state, optim_state = get_state_dict(module, optimizer)
    template = {"model": model_state, "optim": optim_state}
    metadata = _check_checkpoint(path, template)
    extra = {}
    for key, entry in metadata.state_dict_metadata.items():
        if key.startswith("extra."):
            name = key[len("extra."):]
            extra[name] = (torch.empty(entry.size, dtype=entry.properties.dtype)
                           if isinstance(entry, TensorStorageMetadata) else None)
    template["extra"] = extra
    dcp.load(template, checkpoint_id=path, process_group=group)
    set_state_dict(module, optimizer, model_state_dict=template["model"], optim_state_dict=template["optim"])
    return template["extra"]
