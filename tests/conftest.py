import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # `import examples.models`

from fxshard.testing import WorkerPool  # noqa: E402


@pytest.fixture(scope="session")
def pools():
    """Gloo worlds of 2 and 3 ranks, spawned once and shared by every distributed test."""
    created: dict[int, WorkerPool] = {}

    def get(world_size: int) -> WorkerPool:
        if world_size not in created:
            created[world_size] = WorkerPool(world_size)
        return created[world_size]

    yield get
    for pool in created.values():
        pool.close()
