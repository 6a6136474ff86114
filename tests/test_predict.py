"""Predicting a HuggingFace model's step from its config alone (``fxshard.predict``, ``simulate --config``)."""

import json
import re

import pytest
import torch

from fxshard import predict
from fxshard.errors import FxShardError
from fxshard.simulate.machines import H100_80GB_SXM, gpu_node, load_machine
from fxshard.simulate.simulator import WhatIf, simulate

TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_hidden_layers": 6, "vocab_size": 256, "max_position_embeddings": 128,
              "tie_word_embeddings": False}
MACHINE = load_machine("h100-sxm-100g")


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("predict") / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    return path


@pytest.fixture(autouse=True, scope="module")
def compiled_once():
    """Each (depth, world, batch, seq, machine) compiled once for the module: the tests vary what is made of the steps."""
    steps, compile_step = {}, predict._compiled_step

    def remembered(config, depth, world, batch, seq, machine, options):  # a compiled step is the same for every ac
        key = (depth, world, batch, seq, machine)
        if key not in steps:
            steps[key] = compile_step(config, depth, world, batch, seq, machine, options)
        return steps[key]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(predict, "_compiled_step", remembered)
        yield


def test_the_step_scaled_from_two_depths_is_the_step_compiled_at_full_depth(tiny_config, monkeypatch):
    scaled = predict.predict_from_config(tiny_config, world=16, batch=2, seq=64, machine=MACHINE)
    monkeypatch.setattr(predict, "COMPILED_DEPTHS", (TINY_LLAMA["num_hidden_layers"],))
    whole = predict.predict_from_config(tiny_config, world=16, batch=2, seq=64, machine=MACHINE)
    assert scaled.step_s == pytest.approx(whole.step_s, rel=0.01)
    assert scaled.compute_s == pytest.approx(whole.compute_s, rel=0.01)
    assert scaled.exposed_s == pytest.approx(whole.exposed_s, rel=0.05, abs=1e-6)


def test_model_flops_are_torchtitans_count_of_the_full_depth_model(tiny_config):
    prediction = predict.predict_from_config(tiny_config, world=16, batch=2, seq=64, machine=MACHINE)
    config = predict.load_config(tiny_config)
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert prediction.flops_per_token == 6 * sum(p.numel() for p in model.parameters()) + 12 * 6 * 64 * 64
    assert prediction.mfu == pytest.approx(prediction.tokens_per_s * prediction.flops_per_token / 989e12)
    assert prediction.tokens_per_s == 2 * 64 / prediction.step_s


def test_activation_checkpointing_recomputes_each_checkpointed_layers_forward(tiny_config):
    runs = {ac: predict.predict_from_config(tiny_config, world=16, batch=2, seq=64, machine=MACHINE, ac=ac)
            for ac in predict.AC_MODES}
    none, full = runs["none"], runs["full"]
    recomputed = full.compute_s - none.compute_s
    # every other layer (a layer's forward differs from another's by an op or two: the first one's reshapes)
    assert recomputed > 0 and runs["selective"].compute_s - none.compute_s == pytest.approx(recomputed / 2, rel=0.01)
    assert none.step_s < runs["selective"].step_s < full.step_s


def test_a_checkpointed_layer_recomputes_its_forward_before_its_backward_hiding_collectives(tiny_config):
    slow = gpu_node(H100_80GB_SXM, 0.01)  # communication-bound: the backward's collectives are exposed
    backend, layers = predict._compiled_step(predict.load_config(tiny_config), 2, 16, 2, 64, slow,
                                             {"stage": 3, "param_dtype": torch.bfloat16})
    plain = simulate(backend, 16, machine=slow)
    timeline = simulate(backend, 16, machine=slow, what_if=WhatIf(recompute=tuple(layers)))
    recomputed = timeline.compute_time - plain.compute_time
    backward = [e for e in timeline.events if e.stream == "compute" and e.graph.endswith("backward")]
    again = {e.unit: e.end - e.start for e in backward if e.node.startswith("recompute ")}
    assert sorted(again) == sorted(layers) and sum(again.values()) == pytest.approx(recomputed)
    forward = [e for e in timeline.events if e.stream == "compute" and e.graph.endswith("forward")]
    for layer in layers:
        inside = sum(e.end - e.start for e in forward if e.unit.startswith(layer + "."))
        with_own = sum(e.end - e.start for e in forward if e.unit == layer or e.unit.startswith(layer + "."))
        # its submodules' compute and the layer's own (its residual adds), not its gathers' copies
        assert 0 < inside <= again[layer] <= with_own
        at = next(i for i, e in enumerate(backward) if e.node == f"recompute {layer}")
        assert backward[at + 1].unit.startswith(layer + ".")  # the layer's own backward follows
        assert not any(e.unit.startswith(layer + ".") for e in backward[:at])
    assert timeline.exposed_comm < plain.exposed_comm  # gathers in flight hide behind the recomputation...
    assert plain.step_time <= timeline.step_time < plain.step_time + recomputed  # ... so it costs less than itself


def test_a_config_without_a_model_type_or_an_unknown_ac_is_refused(tmp_path, tiny_config):
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(FxShardError, match="model_type"):
        predict.predict_from_config(bare, world=8, batch=1, seq=64, machine=MACHINE)
    with pytest.raises(FxShardError, match="ac must be one of none, selective, full"):
        predict.predict_from_config(tiny_config, world=8, batch=1, seq=64, machine=MACHINE, ac="op")


def test_simulate_config_ends_with_tokens_per_second_and_mfu(tiny_config, capsys):
    from fxshard.__main__ import main

    assert main(["simulate", "--config", str(tiny_config), "--world", "16", "--batch", "2", "--seq", "64", "--ac",
                 "selective", "--machine", "h100-sxm-100g"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "llama, 6 layers, stage 3, 16 ranks of H100 80GB SXM" in lines[0], lines
    assert re.fullmatch(r"tokens/s per rank \d+  MFU \d+\.\d%", lines[-1]), lines
