"""fxshard's compiler half: one FX pass per module, each ``name_pass(gm, ctx) -> gm``.

A pass documents what it assumes about the graph and what it guarantees, records its decisions in
``node.meta["fxshard"]``, keeps node names and order deterministic, and touches no global state.
"""

from .bucket import bucket_pass
from .context import PassContext
from .cost_model import Machine, exposed_communication
from .lower_collectives import lower_collectives_pass
from .merge_tied_grads import merge_tied_grads_pass
from .prefetch import make_prefetch_pass, prefetch_pass
from .recompute_gathers import recompute_gathers_pass
from .shard_optimizer import shard_optimizer_pass
from .twin_groups import twin_groups_pass

__all__ = ["Machine", "PassContext", "bucket_pass", "exposed_communication",
           "lower_collectives_pass", "make_prefetch_pass", "merge_tied_grads_pass", "prefetch_pass",
           "recompute_gathers_pass", "shard_optimizer_pass", "twin_groups_pass"]
