"""What every pass is told about the graph it rewrites."""

from __future__ import annotations

import dataclasses
from typing import Literal

GraphKind = Literal["joint", "forward", "backward", "inference"]


@dataclasses.dataclass(frozen=True)
class PassContext:
    """The knobs and facts a pass may read; passes never read global state.

    stage: ZeRO stage 0..3.
    graph: which graph is being rewritten: the AOT ``joint`` graph (before partitioning), the partitioned
        ``forward`` / ``backward`` graphs, or an ``inference`` graph (a call under ``torch.no_grad``).
    world_size, group_name: the process group the markers name (one group per backend).
    reshard_after_forward: stage 3 only: free gathered weights after forward and gather again in backward (True,
        ZeRO-3) or keep them from forward to backward (False: less communication, more memory).
    """

    stage: int
    graph: GraphKind
    world_size: int
    group_name: str
    reshard_after_forward: bool = True
