"""Bytes on the wire as the kernel counts them: each TCP socket's ``bytes_sent`` less its ``bytes_retrans``
(``ss -tinp``: the data the process handed, not TCP's resends of it), summed by the pair of processes it connects. It checks the ledger from outside fxshard and torch: gloo's own framing (240 bytes per
message on torch 2.13) and any traffic a profiler cannot see are in it.

    sent = sent_during(step)      # every rank calls it; on rank 0 {(sender rank, receiver rank): bytes}

Linux only (``ss`` from iproute2), ranks on one machine (rank 0 reads every rank's sockets).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections import Counter
from collections.abc import Sequence

from fxshard.errors import FxShardError

# `ss -tinpH state established`: "Recv-Q Send-Q local peer users:((...,pid=P,fd=F))", then an indented info line
_SOCKET = re.compile(r"^\d+\s+\d+\s+(\S+)\s+(\S+)\s+users:\(\(.*?pid=(\d+),")
_BYTES_SENT = re.compile(r"\bbytes_sent:(\d+)")
# resent segments (a tail-loss probe fires when a loaded machine delays the ACK): in bytes_sent, not in the data
_BYTES_RETRANS = re.compile(r"\bbytes_retrans:(\d+)")

Sockets = dict[tuple[str, str], tuple[int, int]]  # (local, peer address) -> (owner pid, bytes sent)


def tcp_sockets() -> Sockets:
    """Every established TCP socket this user can see, with its owner and the data bytes it has sent."""
    if shutil.which("ss") is None:
        raise FxShardError("counting bytes on the wire needs `ss` (iproute2) on the PATH")
    lines = subprocess.run(["ss", "-tinpH", "state", "established"], capture_output=True, text=True,
                           check=True).stdout.splitlines()
    sockets: Sockets = {}
    for head, info in zip(lines, lines[1:]):
        found = _SOCKET.match(head)
        if found is None or not info.startswith(("\t", " ")):
            continue
        sent, resent = (int(m[1]) if (m := pattern.search(info)) else 0 for pattern in (_BYTES_SENT, _BYTES_RETRANS))
        sockets[(found[1], found[2])] = (int(found[3]), sent - resent)
    return sockets


def sent_between(before: Sockets, after: Sockets, pids: Sequence[int]) -> dict[tuple[int, int], int]:
    """{(sender, receiver) as indices into ``pids``: bytes sent between the two snapshots}, over the sockets that
    join two of these processes."""
    owner_of = {local: pid for (local, _), (pid, _) in after.items()}
    index = {pid: i for i, pid in enumerate(pids)}
    sent: Counter = Counter()
    for (local, peer), (pid, total) in after.items():
        receiver = owner_of.get(peer)
        if pid not in index or receiver not in index:
            continue
        already = before.get((local, peer), (pid, 0))[1]
        sent[(index[pid], index[receiver])] += total - already
    return dict(sent)


def sent_during(work) -> dict[tuple[int, int], int]:
    """{(sender rank, receiver rank): bytes} the ranks sent each other while every rank ran ``work()``, counted by
    rank 0 (the others get {}): a collective, every rank calls it. No rank starts ``work`` before rank 0 has
    counted, nor goes on before it has counted again; what the barriers that ensure it send is counted around an
    empty ``work`` and taken off."""
    import torch.distributed as dist

    pids: list = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())

    def counted(task) -> dict:
        snapshots = []
        for _ in range(2):
            dist.barrier()
            snapshots.append(tcp_sockets() if dist.get_rank() == 0 else None)
            dist.barrier()
            if len(snapshots) == 1:
                task()
        return sent_between(*snapshots, pids) if dist.get_rank() == 0 else {}

    barriers = counted(lambda: None)
    return {pair: sent - barriers.get(pair, 0) for pair, sent in counted(work).items()}
