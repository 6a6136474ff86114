"""HuggingFace safetensors directories in and out of a prepared model, each rank reading and writing its own rows.

``load_huggingface(model, directory)`` fills a prepared model (built on the meta device or not, any stage) from a
HuggingFace checkpoint directory (``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` with its index, or a
sharded directory ``save_huggingface`` wrote): DCP's ``HuggingFaceStorageReader`` reads, for each rank, the rows its
shards hold. ``save_huggingface(model, directory)`` writes the model's weights as safetensors that
``from_pretrained`` reads (``consolidated=True``: full tensors in ``model-*.safetensors``, plus the model's
``config.json`` where it has a HuggingFace config), or every rank's rows alone (``consolidated=False``).

Names are the model's own (a HuggingFace model's are the file's). A tied parameter is stored once, under its first
name (GPT-2's ``transformer.wte.weight``; ``lm_head.weight`` is left out), as ``save_pretrained`` stores it. A file
that lacks a parameter, or holds one of another shape, raises FxShardError before anything changes.
"""

from __future__ import annotations

import os
import pathlib
import shutil

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions

from fxshard.errors import FxShardError

from .state_dict import checkpoint_group, get_model_state_dict, is_first_rank, prepared_module, set_model_state_dict


def _stored_once(module: nn.Module, state_dict: dict) -> dict:
    """``state_dict`` without the later names of tied parameters (the first name in module order stays)."""
    first_name: dict[int, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        first_name.setdefault(id(param), name)
    later = {name for name, param in module.named_parameters(remove_duplicate=False) if first_name[id(param)] != name}
    return {key: value for key, value in state_dict.items() if key not in later}


def load_huggingface(model: nn.Module, directory: str | os.PathLike) -> None:
    """Load the HuggingFace safetensors checkpoint in ``directory`` into a prepared ``model``, every rank reading
    only its rows. Every rank calls it."""
    directory = pathlib.Path(directory)
    module = prepared_module(model)
    if not directory.is_dir() or not any(directory.rglob("*.safetensors")):
        raise FxShardError(f"{directory} holds no .safetensors file; give the directory of a HuggingFace checkpoint "
                           "(model.safetensors, or model-*-of-*.safetensors with model.safetensors.index.json)")
    reader = HuggingFaceStorageReader(str(directory))
    saved = reader.read_metadata().state_dict_metadata
    wanted = _stored_once(module, get_model_state_dict(module))
    missing = sorted(set(wanted) - set(saved))
    mismatched = [(k, list(saved[k].size), list(v.shape)) for k, v in wanted.items()
                  if k in saved and isinstance(saved[k], TensorStorageMetadata) and tuple(saved[k].size) != tuple(v.shape)]
    if missing or mismatched:
        raise FxShardError(
            f"{directory} is not a checkpoint of this model: "
            + (f"it lacks {missing[:4]}{' ...' if len(missing) > 4 else ''}" if missing else "")
            + ("; " if missing and mismatched else "")
            + "; ".join(f"{k} has shape {got} there, {want} here" for k, got, want in mismatched[:4])
            + "; load the checkpoint of the model's own architecture and size"
        )
    dcp.load(wanted, storage_reader=reader, process_group=checkpoint_group(module))
    set_model_state_dict(module, wanted, options=StateDictOptions(strict=False))


def save_huggingface(model: nn.Module, directory: str | os.PathLike, *, consolidated: bool = True) -> pathlib.Path:
    """Write a prepared ``model``'s weights into ``directory`` as HuggingFace safetensors: with ``consolidated``,
    full tensors that ``from_pretrained`` reads (and ``config.json``, ``generation_config.json`` where the model has
    them), nothing else; else each rank's rows in files of its own, which ``load_huggingface`` reads at any world
    size. Every rank calls it."""
    directory = pathlib.Path(directory)
    module = prepared_module(model)
    group = checkpoint_group(module)
    state_dict = _stored_once(module, get_model_state_dict(module))
    writer = HuggingFaceStorageWriter(str(directory), save_distributed=True, enable_consolidation=consolidated)
    dcp.save(state_dict, storage_writer=writer, process_group=group)  # returns once the files are consolidated
    if is_first_rank(group):
        if consolidated:  # DCP writes every rank's rows under directory/sharded first: a second copy of the model
            shutil.rmtree(writer.path)
        for settings in (getattr(module, "config", None), getattr(module, "generation_config", None)):
            if callable(getattr(settings, "save_pretrained", None)):
                settings.save_pretrained(directory)
    dist.barrier(group=group)
    return directory
