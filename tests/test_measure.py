"""fxshard.report.measure.CollectiveCounter: collectives by kind and size, split into steps by mark_step."""

import pytest
import torch
from torch.distributed._functional_collectives import all_gather_tensor, reduce_scatter_tensor

import fxshard
from fxshard.report.measure import CollectiveCounter
from fxshard.testing import fake_process_group


def test_counts_each_step_apart():
    with fake_process_group(2) as group:
        with CollectiveCounter() as counter:
            all_gather_tensor(torch.ones(3), 0, group).wait()  # step 0
            counter.mark_step()
            all_gather_tensor(torch.ones(5, dtype=torch.bfloat16), 0, group).wait()  # step 1
            reduce_scatter_tensor(torch.ones(8), "sum", 0, group).wait()
            counter.mark_step()
    assert counter.steps == 2
    assert counter.totals(step=0) == {"all_gather": {"calls": 1, "elements": 3, "bytes": 12}}
    assert counter.totals(step=-1) == {"all_gather": {"calls": 1, "elements": 5, "bytes": 10},
                                       "reduce_scatter": {"calls": 1, "elements": 8, "bytes": 32}}
    assert counter.totals()["all_gather"] == {"calls": 2, "elements": 8, "bytes": 22}


def test_counts_the_in_place_collectives_inductors_code_calls():
    # an all_reduce compiled by Inductor runs as all_reduce_ on a buffer; an all-gather may write into one
    from fxshard.torch_compat import c10d_functional

    with fake_process_group(2) as group, CollectiveCounter() as counter:
        c10d_functional.wait_tensor(c10d_functional.all_reduce_(torch.ones(6), "sum", group.group_name))
        out = torch.empty(8)
        c10d_functional.wait_tensor(c10d_functional.all_gather_into_tensor_out(torch.ones(4), 2, group.group_name,
                                                                               out=out))
    assert counter.totals() == {"all_reduce": {"calls": 1, "elements": 6, "bytes": 24},
                                "all_gather": {"calls": 1, "elements": 4, "bytes": 16}}


# every dtype a parameter, a gradient or a packed wire buffer (int8, uint8, fp8, bf16) may travel in
_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
           torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
def test_counts_the_bytes_of_a_collective_in_every_dtype(dtype):
    from fxshard.torch_compat import c10d_functional

    with fake_process_group(2) as group, CollectiveCounter() as counter:
        c10d_functional.wait_tensor(c10d_functional.all_gather_into_tensor(torch.zeros(3, dtype=dtype), 2,
                                                                           group.group_name))
    assert counter.totals() == {"all_gather": {"calls": 1, "elements": 3, "bytes": 3 * dtype.itemsize}}


def test_asking_for_a_step_that_was_not_marked_says_what_to_do():
    with CollectiveCounter() as unmarked:
        pass
    with pytest.raises(fxshard.FxShardError, match="call counter.mark_step"):
        unmarked.totals(step=-1)
    with CollectiveCounter() as counter:
        counter.mark_step()
    with pytest.raises(fxshard.FxShardError, match="saw 1 completed steps"):
        counter.totals(step=1)
