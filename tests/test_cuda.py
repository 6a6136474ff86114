"""The NCCL path: every stage trains on GPUs like a single process, with nothing of fxshard's on the CPU.

Runs where CUDA is present, one rank per GPU (world size = the GPUs present, at least 1); skipped otherwise. The
multi-rank numerics of every stage are gloo's job (test_numerics, test_stages); here the same training runs with
NCCL's collectives on device tensors, eagerly and through Inductor.
"""

import pytest
import torch

import scenarios
from fxshard.testing import WorkerPool
from test_numerics import STEPS, assert_matches_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device: the NCCL path runs where a GPU is present")


@pytest.fixture(scope="module")
def nccl_pool():
    pool = WorkerPool(torch.cuda.device_count(), backend="nccl")
    yield pool
    pool.close()


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gpt_trains_on_gpus_like_a_single_process(nccl_pool, stage, compiler):
    results = nccl_pool.run(scenarios.train_against_reference, "gpt", "adamw", STEPS, compiler=compiler, stage=stage,
                            device="cuda")
    for rank, result in enumerate(results):
        assert_matches_reference(result, "adamw")
        assert result["devices"] == [f"cuda:{rank}"], "parameters and optimizer state stay on the rank's GPU"
        assert result["graph_devices"] == [f"cuda:{rank}"], "every tensor of the rewritten graphs is on the GPU"
        assert result["compiled_graphs"] == [(0, "backward"), (0, "forward"), (0, "joint")]


@pytest.mark.parametrize("stage", [0, 3])
def test_hybrid_mesh_trains_on_gpus(nccl_pool, stage):
    gpus = nccl_pool.world_size
    mesh_shape = (2, gpus // 2) if gpus % 2 == 0 else (1, gpus)  # (replicas, shard group size)
    results = nccl_pool.run(scenarios.train_against_reference, "gpt", "adamw", STEPS, stage=stage, device="cuda",
                            mesh_shape=mesh_shape)
    for rank, result in enumerate(results):
        assert_matches_reference(result, "adamw")
        assert result["graph_devices"] == [f"cuda:{rank}"]


def test_pool_reports_the_gpus_it_runs_on(nccl_pool):
    assert nccl_pool.run(torch.cuda.current_device) == list(range(nccl_pool.world_size))
