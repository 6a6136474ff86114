"""Bytes on the wire as the kernel counts them: each TCP socket's ``bytes_sent`` (``ss -tinp``), summed by the pair
of processes it connects. It checks the ledger from outside fxshard and torch: gloo's own framing and any traffic a
profiler cannot see are in it.

    pids = [p for p in all ranks' os.getpid()]          # e.g. dist.all_gather_object
    before = sent_by_pair(pids)
    ... every rank runs one step ...
    sent = sent_between(before, sent_by_pair(pids))    # {(sender rank, receiver rank): bytes}

Linux only (``ss`` from iproute2); it sees the sockets of processes this user may inspect.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections import Counter
from collections.abc import Sequence

from fxshard.errors import FxShardError

# `ss -tinpH state established`: "Recv-Q Send-Q local peer users:((...,pid=P,fd=F))", then an indented info line
_SOCKET = re.compile(r"^\d+\s+\d+\s+(\S+)\s+(\S+)\s+users:\(\(.*?pid=(\d+),")
_BYTES_SENT = re.compile(r"\bbytes_sent:(\d+)")

Sockets = dict[tuple[str, str], tuple[int, int]]  # (local, peer address) -> (owner pid, bytes sent)


def tcp_sockets() -> Sockets:
    """Every established TCP socket this user can see, with its owner and the bytes it has sent."""
    if shutil.which("ss") is None:
        raise FxShardError("counting bytes on the wire needs `ss` (iproute2) on the PATH")
    lines = subprocess.run(["ss", "-tinpH", "state", "established"], capture_output=True, text=True,
                           check=True).stdout.splitlines()
    sockets: Sockets = {}
    for head, info in zip(lines, lines[1:]):
        found = _SOCKET.match(head)
        if found is None or not info.startswith(("\t", " ")):
            continue
        sent = _BYTES_SENT.search(info)
        sockets[(found[1], found[2])] = (int(found[3]), int(sent[1]) if sent else 0)
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
