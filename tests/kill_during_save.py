"""examples/train_gpt.py with rank 1 killed by SIGKILL in the middle of its second checkpoint save: after it wrote
its shard files, before the checkpoint's metadata exists and before the directory is renamed complete.

Run it with train_gpt.py's arguments. The patch sits at module level because the ranks are spawned: each imports
this script again as ``__mp_main__`` and so patches its own DCP writer."""

import os
import pathlib
import signal
import sys

import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemWriter

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

KILLED_SAVE = 2
_write_data = FileSystemWriter.write_data
_saves = 0


def _write_data_then_die(self, plan, planner):
    global _saves
    written = _write_data(self, plan, planner)
    _saves += 1
    if _saves == KILLED_SAVE and dist.get_rank() == 1:
        written.wait()
        os.kill(os.getpid(), signal.SIGKILL)
    return written


FileSystemWriter.write_data = _write_data_then_die

if __name__ == "__main__":
    from examples.train_gpt import main

    main()
