"""The process group fxshard's own collectives run on.

On gloo, fxshard does not communicate on the group it is given: ``collective_group`` builds a twin of it (the same
ranks) whose gloo backend has ONE worker thread, and every marker, lowered collective and optimizer-step collective
names that twin. Why: torch 2.13's ``ProcessGroupGloo::runLoop`` writes the group's status (the name of the last
completed work, a heap-allocated string) after each collective without holding the lock that guards it, so two
collectives that finish together on gloo's two default worker threads free the same buffer twice and the rank dies
in malloc (docs/known-issues.md). Prefetch keeps two or more collectives in flight, which makes that likely. With
one worker thread a group's collectives run one after another, in the order they were issued, on that thread, while
the main thread computes: the overlap of communication and compute stays (it is the overlap NCCL's one stream gives).

Every other backend (NCCL, the single-process ``fake`` group of ``fxshard.testing``) is used as it is. The user's
group stays theirs: ``prepare`` broadcasts over it, and nothing of fxshard's runs on it afterwards.

The twin also carries fxshard's collective timeout: a rank that waits longer than ``timeout_s`` for its peers (one
died, raised, or stopped calling the model) fails instead of hanging for gloo's default half hour.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import re

import torch.distributed as dist

from fxshard.errors import FxShardError
from fxshard.torch_compat import gloo_threads, gloo_with_options, is_backend_registered, resolve_group

COLLECTIVE_TIMEOUT_S = 30.0  # how long a rank waits for its peers in one of fxshard's collectives
ONE_THREAD_GLOO = "fxshard_gloo"  # the name the one-worker-thread gloo backend is registered under


def _one_thread_gloo(store, rank: int, world_size: int, timeout: datetime.timedelta):
    return gloo_with_options(store, rank, world_size, timeout=timeout, threads=1)


def uses_gloo(group) -> bool:
    """Whether ``group`` communicates over gloo (alone, or for its CPU tensors)."""
    backend = dist.get_backend(group)
    return backend == "gloo" or "cpu:gloo" in backend.split(",")


# (user group's name, timeout) -> (that group, its one-thread twin). A name is not an identity: after
# destroy_process_group() and a new init_process_group() the new default group is named like the old one.
_TWINS: dict[tuple[str, float], tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}


def _live_twin(key: tuple[str, float], group) -> dist.ProcessGroup | None:
    """The twin made for ``group`` under ``key``, if both are still the groups registered under their names."""
    source, twin = _TWINS.get(key, (None, None))
    if twin is None or source is not group:
        return None
    try:
        current = resolve_group(twin.group_name)
    except (RuntimeError, ValueError):  # destroyed since (destroy_process_group)
        return None
    return twin if current is twin else None


def collective_group(group, timeout_s: float) -> dist.ProcessGroup:
    """The group fxshard's collectives over ``group``'s ranks run on: a one-worker-thread gloo twin of a gloo
    ``group`` (made once per group and timeout, by every rank of ``group`` together, and made anew for a group
    that replaced a destroyed one of the same name), else ``group`` itself."""
    if not uses_gloo(group):
        return group
    key = (group.group_name, float(timeout_s))
    twin = _live_twin(key, group)
    if twin is None:
        if not is_backend_registered(ONE_THREAD_GLOO):
            dist.Backend.register_backend(ONE_THREAD_GLOO, _one_thread_gloo, devices=["cpu"])
        twin = dist.new_group(
            ranks=dist.get_process_group_ranks(group), backend=ONE_THREAD_GLOO,
            timeout=datetime.timedelta(seconds=timeout_s), use_local_synchronization=True,
        )
        _TWINS[key] = (group, twin)
    return twin


def group_over(ranks: list[int]) -> dist.ProcessGroup:
    """A process group of ``ranks`` (sorted): the world group when they are every rank, else a new group, made by
    those ranks alone (every one of them calls this, the others need not)."""
    if ranks == list(range(dist.get_world_size())):
        return dist.group.WORLD
    return dist.new_group(ranks=ranks, use_local_synchronization=True)


def secondary_group(shard_group, size: int, timeout_s: float) -> tuple[str, int]:
    """(the name of the group fxshard re-gathers over, this rank's place in it) for ``reshard_after_forward=size``:
    the ``size`` consecutive ranks of ``shard_group`` that hold this rank (on one node when a node's ranks are
    numbered together, as torchrun numbers them). Every rank of ``shard_group`` calls this; each group is made by
    its own ranks."""
    ranks = dist.get_process_group_ranks(shard_group)
    place = ranks.index(dist.get_rank())
    members = sorted(ranks[place - place % size:][:size])
    group = collective_group(group_over(members), timeout_s)
    return group.group_name, members.index(dist.get_rank())  # a group's gathers stack its ranks in this order


def compares_peers(group) -> bool:
    """Whether ``group`` has peers to compare this rank with: more than one rank, and not the single-process
    ``fake`` group of ``fxshard.testing``, whose collectives return no peer's data."""
    return dist.get_world_size(group) > 1 and dist.get_backend(group) != "fake"


def gloo_worker_threads(group_name: str) -> int | None:
    """How many worker threads the gloo backend of the group named ``group_name`` runs (None: not gloo)."""
    return gloo_threads(resolve_group(group_name))


def scatters_by_all_to_all(group_name: str) -> bool:
    """Whether fxshard reduce-scatters over the group named ``group_name`` as an all-to-all and a local sum: on gloo,
    whose own reduce-scatter all-reduces the whole buffer and keeps a slice (twice a reduce-scatter's traffic and
    reduction work, for bit for bit the same result; timed in docs/architecture.md). False for any other backend
    and a group that no longer resolves."""
    try:
        return gloo_worker_threads(group_name) is not None
    except (RuntimeError, ValueError):
        return False


# What a collective's failure says, on gloo (a peer's socket closed, or no peer within the timeout) and on NCCL.
_PEER_FAILURE = re.compile(r"third_party/gloo|Connection (closed|reset) by peer|Timed out waiting|caused pair closure|"
                           r"NCCL (error|timeout)")


def is_peer_failure(error: BaseException) -> bool:
    """Whether ``error`` is a collective failing because a peer rank did not take part in it."""
    return isinstance(error, RuntimeError) and bool(_PEER_FAILURE.search(str(error)))


def peer_failure(error: RuntimeError, where: str) -> FxShardError:
    """The FxShardError a rank raises when one of fxshard's collectives failed for want of a peer."""
    first_line = str(error).strip().splitlines()[0]
    rank = dist.get_rank() if dist.is_initialized() else "?"
    return FxShardError(
        f"rank {rank}: a collective in {where} failed: {first_line}. Another rank died, raised an exception, or "
        "stopped running the same step: look for its own error. A rank waits for its peers as long as the backend "
        "option collective_timeout_s says; the process group cannot be used after this: end the process"
    )


@contextlib.contextmanager
def peer_failures_explained(where: str):
    """Inside it, a collective that fails for want of a peer raises ``peer_failure`` (other errors pass as they are).
    Nested, the outermost names the place: it is the call the user made (``model.state_dict()``, not the gather of
    one parameter inside it)."""
    try:
        yield
    except RuntimeError as error:
        failure = error.__cause__ if isinstance(error, FxShardError) else error
        if not isinstance(failure, RuntimeError) or isinstance(failure, FxShardError) or not is_peer_failure(failure):
            raise
        raise peer_failure(failure, where) from failure


def explaining_peer_failures(compiled, where: str):
    """``compiled`` (a compiled graph, boxed or not) raising ``peer_failure`` where one of its collectives failed
    for want of a peer."""

    @functools.wraps(compiled)
    def run(*args):
        with peer_failures_explained(where):
            return compiled(*args)

    return run
