"""fxshard's compiler half: one FX pass per module, each ``name_pass(gm, ctx) -> gm``.

A pass documents what it assumes about the graph and what it guarantees, records its decisions in
``node.meta["fxshard"]``, keeps node names and order deterministic, and touches no global state.
"""

from .context import PassContext
from .lower_collectives import lower_collectives_pass
from .merge_tied_grads import merge_tied_grads_pass
from .recompute_gathers import recompute_gathers_pass

__all__ = ["PassContext", "lower_collectives_pass", "merge_tied_grads_pass", "recompute_gathers_pass"]
