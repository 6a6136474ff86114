"""New batch sizes and sequence lengths recompile a prepared model once (to dynamic shapes), then never, at
every stage."""

import pytest
import torch
from torch._dynamo.utils import counters

import fxshard
from examples.models import GPT, GPTConfig
from fxshard.testing import fake_process_group

# The second shape changes both dimensions, so Dynamo's automatic dynamic shapes make both symbolic at once.
SHAPES = [(2, 16), (3, 8), (4, 12), (5, 5), (7, 9)]


@pytest.mark.parametrize("stage", [0, 3])  # the full-replica and the fully sharded layouts
def test_varying_batch_and_sequence_compile_one_dynamic_graph(stage):
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    with fake_process_group(2):  # the graphs, not the numbers
        backend = fxshard.backend(compiler="eager", stage=stage)
        model = GPT(GPTConfig(n_layer=1))
        model, _ = backend.prepare(model, torch.optim.AdamW(model.parameters()))
        compiled = torch.compile(model, backend=backend)
        for batch, seq in SHAPES:
            tokens = torch.randint(0, 64, (batch, seq + 1))
            compiled(tokens[:, :-1], tokens[:, 1:]).backward()
    assert counters["stats"]["unique_graphs"] == 2, counters["stats"]
    assert [r.graph_id for r in backend.graphs if r.kind == "forward"] == [0, 1]
