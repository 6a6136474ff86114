"""Readable closed forms: sums of parameter counts named (modules, numbered sums with a legend), every line of the
example GPT's report within 120 characters at every stage and on a hybrid mesh, every formula equal to the
per-parameter form it stands for."""

import json

import pytest
import sympy
import torch

import fxshard
from examples.models import GPT, GPTConfig
from fxshard import budget
from fxshard.budget.formula import SumNames, describe, module_sums
from fxshard.runtime.collectives import COLLECTIVE_ROLES
from fxshard.report import ledger_rows
from fxshard.testing import fake_process_group
from scenarios import hybrid_mesh

GPT_NAMES = [
    "tok_emb.weight", "pos_emb.weight",
    *(f"blocks.{i}.{part}" for i in range(2) for part in (
        "ln1.weight", "ln1.bias", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "attn.proj.bias",
        "ln2.weight", "ln2.bias", "fc.weight", "fc.bias", "out.weight", "out.bias")),
    "ln_f.weight", "ln_f.bias",
]
LINE_WIDTH = 120  # characters a formula, and a line of the report, take at most
# a step's collective bytes as a measurement reports them: as many digits as the measured column holds
MEASURED = {kind: {"bytes": 10**9} for kind in COLLECTIVE_ROLES}


@pytest.mark.parametrize("chosen, described", [
    ([n for n in GPT_NAMES if n.endswith(".bias") and "ln" not in n],
     "blocks.*.{attn.qkv,attn.proj,fc,out}.bias"),  # every block: factored
    ([n for n in GPT_NAMES if n.startswith("blocks.0.") and "ln2" not in n and "out" not in n],
     "blocks.0.{ln1,attn,fc}"),  # whole modules by their name
    (["blocks.1.fc.bias", "ln_f.weight", "ln_f.bias"], "blocks.1.fc.bias, ln_f"),  # one block only: not factored
])
def test_describe_names_modules_and_factors_repeated_blocks(chosen, described):
    assert describe(chosen, GPT_NAMES) == described


def test_a_group_that_is_one_module_is_named_by_it_and_needs_no_legend():
    sums = SumNames(GPT_NAMES)
    ln2 = [budget.psi(n) for n in ("blocks.0.ln2.weight", "blocks.0.ln2.bias")]
    biases = [budget.psi(n) for n in GPT_NAMES if n.endswith(".bias") and "ln" not in n]
    form = sums.readable(budget.N * sympy.Add(*ln2) - 2 * sympy.Add(*biases))
    assert str(form) == "N*ψ[blocks.0.ln2] - 2*ψ₁"
    assert sums.legend() == ["ψ₁ = Σ ψ over blocks.*.{attn.qkv,attn.proj,fc,out}.bias (8 parameters)"]


def compiled_gpt(stage: int, mesh_shape: tuple | None = None) -> fxshard.Backend:
    """The backend of the example GPT (train_gpt.py's configuration) with AdamW after one forward and backward
    under a fake group of 2 ranks, or of a (replicas, shards) ``mesh_shape`` hybrid mesh."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    with fake_process_group(4 if mesh_shape else 2):
        backend = fxshard.backend(compiler="eager", stage=stage, mesh=hybrid_mesh(mesh_shape))
        model = GPT(GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, d_model=64))
        model, _ = backend.prepare(model, torch.optim.AdamW(model.parameters()))
        tokens = torch.randint(0, 128, (8, 33))
        torch.compile(model, backend=backend)(tokens[:, :-1], tokens[:, 1:]).backward()
        return backend


def too_wide(report: str) -> list[str]:
    return [line for line in report.splitlines() if len(line) > LINE_WIDTH]


@pytest.fixture(scope="module")
def gpt_ledger():
    """The example GPT at stage 3, and its ledger."""
    backend = compiled_gpt(3)
    return backend, budget.ledger(backend)


def test_every_formula_of_the_gpt_report_fits_and_is_exact(gpt_ledger):
    backend, ledger = gpt_ledger
    names = list(ledger.params)
    sums = SumNames(names)
    rows = ledger_rows(ledger, sums=sums)
    assert max(len(r["readable"]) for r in rows) <= LINE_WIDTH, [r["readable"] for r in rows]
    assert max(len(r["expression"]) for r in rows) > 2 * LINE_WIDTH  # what the per-parameter form would print
    for expr in [ledger.peak(), ledger.resident(), *(ledger.communicated(k, moved=m) for k in ("all_gather",
                 "reduce_scatter") for m in (False, True))]:
        closed = ledger.closed_form(expr)
        named = sums.readable(closed)
        assert sympy.expand(module_sums(named.subs(sums.substitutions()), names) - closed) == 0, named
    report = backend.report(measured=MEASURED)
    assert any(line.startswith("ψ₁ = ") for line in report.splitlines())  # the legend
    assert too_wide(report) == []


@pytest.mark.parametrize("stage, mesh_shape", [(0, None), (1, None), (2, None), (2, (2, 2))])
def test_every_line_of_the_gpt_report_fits_at_every_stage_and_on_a_mesh(stage, mesh_shape):
    # stage 3: test_every_formula_of_the_gpt_report_fits_and_is_exact; stage 3 on a mesh: the hybrid run of
    # tests/test_examples.py
    assert too_wide(compiled_gpt(stage, mesh_shape).report(measured=MEASURED)) == []


def test_json_keeps_the_per_parameter_form_and_the_sums(gpt_ledger):
    backend, _ = gpt_ledger
    data = json.loads(backend.report(format="json"))
    peak = next(r for r in data["ledger"] if r["what"].startswith("peak"))
    assert "ψ₁" in peak["readable"] and "ψ₁" not in peak["expression"]
    assert len(peak["expression"]) > 2 * len(peak["readable"])  # per parameter: what the sums stand for
    assert data["sums"]["ψ₁"] and all(name in data["parameters"] for name in data["sums"]["ψ₁"])
