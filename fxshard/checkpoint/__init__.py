"""Checkpoints of a prepared model and optimizer that ``torch.distributed.checkpoint`` (DCP) saves rank by rank and
reshards on load, in FSDP2's layout; the consolidated (full) dicts on request; crash-safe saves.

- ``state_dict``: ``get_state_dict`` / ``set_state_dict`` and their model and optimizer halves, keyed by parameter
  name as torch's functions of the same names key an FSDP2 model's (sharded tensors as DTensors of the full shape:
  ``fxshard.runtime.layout``);
- ``files``: ``save`` / ``load`` / ``latest``, a checkpoint directory per save that survives a crash mid-save;
- ``huggingface``: ``load_huggingface`` / ``save_huggingface``, HuggingFace safetensors directories in and out,
  each rank reading and writing its own rows.
"""

from torch.distributed.checkpoint.state_dict import StateDictOptions

from .files import latest, load, save
from .huggingface import load_huggingface, save_huggingface
from .state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

__all__ = [
    "StateDictOptions", "get_model_state_dict", "get_optimizer_state_dict", "get_state_dict", "latest", "load",
    "load_huggingface", "save", "save_huggingface", "set_model_state_dict", "set_optimizer_state_dict",
    "set_state_dict",
]
