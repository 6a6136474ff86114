"""The sympy ledger (fxshard.budget): textbook closed forms from the rewritten graphs, exact against measurement."""

import pytest
import sympy
import torch

import fxshard
import scenarios
from fxshard import budget
from fxshard.budget import B_GRAD, B_PARAM, N, PSI

STAGES = [0, 1, 2, 3]


def compiled_ledger(stage: int, world: int = 2, **options) -> budget.Ledger:
    return budget.ledger(scenarios.compiled_model("chain", stage, world, **options))


@pytest.fixture(scope="module")
def ledgers():
    return {stage: compiled_ledger(stage) for stage in STAGES}


TEXTBOOK_MEMORY = {0: 16 * PSI, 1: 4 * PSI + 12 * PSI / N, 2: 2 * PSI + 14 * PSI / N, 3: 16 * PSI / N}
TEXTBOOK_COMM = {0: 2, 1: 2, 2: 2, 3: 3}


@pytest.mark.parametrize("stage", STAGES)
def test_memory_simplifies_to_the_zero_paper(ledgers, stage):
    ledger = ledgers[stage]
    mixed = ledger.closed_form(ledger.mixed_precision().subs(budget.ZERO_PAPER_WIDTHS))
    assert sympy.simplify(mixed - TEXTBOOK_MEMORY[stage]) == 0, mixed


@pytest.mark.parametrize("stage", STAGES)
def test_communication_simplifies_to_2_or_3_psi(ledgers, stage):
    ledger = ledgers[stage]
    b = sympy.Symbol("b", positive=True)
    sent = ledger.closed_form(ledger.communicated(moved=True).subs({B_PARAM: b, B_GRAD: b}))
    assert sympy.simplify(sent - TEXTBOOK_COMM[stage] * b * PSI * (N - 1) / N) == 0, sent


def test_run_view_keeps_one_copy_where_the_graph_reads_the_master(ledgers):
    # fp32: stages 0 and 3 read (or gather) the very tensor the optimizer updates; 1 and 2 read a separate full copy
    master, param, grad, state = budget.B_MASTER, B_PARAM, B_GRAD, budget.B_STATE
    expected = {0: (master + grad + 2 * state) * PSI, 1: (param + grad) * PSI + (master + 2 * state) * PSI / N,
                2: param * PSI + (master + grad + 2 * state) * PSI / N, 3: (master + grad + 2 * state) * PSI / N}
    for stage, form in expected.items():
        assert sympy.simplify(ledgers[stage].closed_form(ledgers[stage].resident()) - form) == 0, stage


def test_terms_name_the_graph_nodes_they_come_from(ledgers):
    sources = {t.source for t in ledgers[3].select("comm")}
    assert {"graph 0 forward: all_gather_layers_0", "graph 0 backward: reduce_scatter_layers_2"} <= sources
    assert all(t.source.startswith("optimizer: layers.") for t in ledgers[3].select("memory", "exp_avg"))


def test_keeping_gathered_weights_for_backward_changes_the_ledger_not_a_table():
    # reshard_after_forward=False: the graphs no longer gather in backward, so the same stage sends 2Ψ, and the
    # gathered weights appear as saved activations instead
    ledger = compiled_ledger(3, reshard_after_forward=False)
    b = sympy.Symbol("b", positive=True)
    sent = ledger.closed_form(ledger.communicated(moved=True).subs({B_PARAM: b, B_GRAD: b}))
    assert sympy.simplify(sent - 2 * b * PSI * (N - 1) / N) == 0, sent
    assert ledger.calls("all_gather") == 3


def test_gpt_stage_3_gathers_what_backward_reads():
    # the closed form of docs/budget.md, read off the GPT's graphs: the tied embedding is gathered at both of its
    # use sites; backward re-gathers every weight but the position embedding and the linear layers' biases
    gpt = scenarios.build_model("gpt")
    psi = {name: budget.psi(name) for name, _ in gpt.named_parameters()}
    linear_biases = [psi[f"{name}.bias"] for name, module in gpt.named_modules() if isinstance(module, torch.nn.Linear)
                     and module.bias is not None]
    expected = {
        True: 2 * PSI + psi["tok_emb.weight"] - psi["pos_emb.weight"] - sympy.Add(*linear_biases),
        False: PSI + psi["tok_emb.weight"],
    }
    for reshard, elements in expected.items():
        ledger = budget.ledger(scenarios.compiled_model("gpt", 3, reshard_after_forward=reshard, bucket="layer"))
        gathered = ledger.closed_form(ledger.communicated("all_gather"))
        assert sympy.simplify(gathered - B_PARAM * elements / N) == 0, (reshard, gathered)


def test_dynamic_shapes_name_the_batch_and_sequence_dimensions():
    import torch.nn.functional as F

    from fxshard.testing import fake_process_group

    with fake_process_group(2):
        torch._dynamo.reset()
        backend = fxshard.backend(compiler="eager", stage=3)
        model = scenarios.Chain()
        model, _ = backend.prepare(model, torch.optim.AdamW(model.parameters()))
        run = torch.compile(model, backend=backend, fullgraph=True, dynamic=True)
        tokens = torch.randn(3, 10, 7, requires_grad=True)  # (batch, seq, features)
        F.mse_loss(run(tokens), torch.zeros(3, 10, 5)).backward()
    ledger = budget.ledger(backend)
    saved = sympy.Add(*(t.bytes for t in ledger.select("saved")))
    batch, seq = sympy.symbols("batch seq", positive=True, integer=True)
    assert saved.free_symbols == {batch, seq}
    assert sympy.expand(saved / (batch * seq)).is_number  # saved activations grow with batch × seq tokens
    assert ledger.at(saved, batch=6) == 2 * ledger.at(saved)
    assert {str(k): v for k, v in ledger.values.items() if k in (batch, seq)} == {"batch": 3, "seq": 10}


B_MASTER, U = budget.B_MASTER, budget.U
PREPARE_PEAK_BORN_ON_META = {0: B_MASTER * (U + PSI), 1: U * B_MASTER + B_PARAM * PSI + B_MASTER * PSI / N,
                             2: U * B_MASTER + B_PARAM * PSI + B_MASTER * PSI / N, 3: B_MASTER * (U + PSI / N)}
PREPARE_PEAK_BUILT_WHOLE = {0: B_MASTER * PSI, 1: B_MASTER * PSI + B_PARAM * PSI + B_MASTER * PSI / N,
                            2: B_MASTER * PSI + B_PARAM * PSI + B_MASTER * PSI / N, 3: B_MASTER * (PSI + PSI / N)}


@pytest.mark.parametrize("stage", STAGES)
def test_prepare_peak_is_what_the_stage_keeps_plus_the_largest_unit_or_the_whole_model(stage):
    born_backend = scenarios.compiled_model("gpt", stage, on_meta=True)
    born = budget.ledger(born_backend)
    whole = budget.ledger(scenarios.compiled_model("gpt", stage))
    assert sympy.simplify(born.closed_form(born.prepare_peak()) - PREPARE_PEAK_BORN_ON_META[stage]) == 0
    assert sympy.simplify(whole.closed_form(whole.prepare_peak()) - PREPARE_PEAK_BUILT_WHOLE[stage]) == 0
    block = sum(p.numel() for p in scenarios.build_model("gpt").blocks[0].parameters())  # larger than the embedding
    assert born.values[U] == block
    assert U not in whole.values
    assert "prepare peak (born on meta)" in born_backend.report()


def test_padding_is_exact_at_the_run_and_gone_in_the_closed_form(ledgers):
    # Chain: (11, 7) + (13, 11) + (5, 13) = 285 elements; at N=2 each rank holds ceil(rows / 2) whole rows, so the
    # reduce-scatters take 2 x (6 x 7) + 2 x (7 x 11) + 2 x (3 x 13) = 84 + 154 + 78 elements
    ledger = ledgers[3]
    assert ledger.at(ledger.communicated("reduce_scatter")) == 4 * (84 + 154 + 78)
    assert ledger.at(ledger.closed_form(ledger.communicated("reduce_scatter")), Ψ=285) == 4 * 285


@pytest.fixture(scope="module")
def measured_world2(pools):
    return pools(2).run(scenarios.ledger_against_measurement, "chain", peak=True)


@pytest.fixture(scope="module")
def measured_world3(pools):
    return pools(3).run(scenarios.ledger_against_measurement, "chain")


def _assert_exact(results):
    for rank_result in results:
        for stage, result in rank_result.items():
            assert result["ledger"] == result["measured"], f"stage {stage} at world {result['world']}"


def test_ledger_equals_measured_bytes_at_world_2(measured_world2):
    _assert_exact(measured_world2)


def test_ledger_equals_measured_bytes_at_world_3(measured_world3):
    _assert_exact(measured_world3)


def test_ledger_equals_measured_bytes_with_a_0_d_parameter(pools):
    # a 0-d parameter has no rows to split: stages 2 and 3 hold it whole and all-reduce its gradient (4 bytes)
    results = pools(2).run(scenarios.ledger_against_measurement, "mlp_temperature")
    _assert_exact(results)
    assert all(r[stage]["measured"]["collectives"]["all_reduce"] == (4, 1) for r in results for stage in (2, 3))


def test_ledger_counts_a_compiled_optimizer_steps_gathers_per_unit(pools):
    # the MLP's units hold a weight and a bias: the compiled step gathers each unit once, the eager step each
    # parameter; the ledger must read the step's graph, not assume the eager path
    results = pools(2).run(scenarios.ledger_against_measurement, "mlp", stages=(1, 2), compile_step=True)
    _assert_exact(results)
    assert all(r[stage]["ledger"]["collectives"]["all_gather"][1] == 2 for r in results for stage in (1, 2))


PEAK_TOLERANCE = 0.3  # measured on this Chain at world 2, least of 5 steps: +4% (stage 0) .. +23% (stage 2)


def test_peak_within_tolerance(measured_world2):
    # The ledger's peak is the state held between steps plus every tensor the compiled graphs hold at their worst
    # node. Not in it: gloo's own staging copies inside a collective, and the optimizer step's temporaries beyond its
    # step buckets (AdamW's foreach temporaries, a gathered column's copy). A single step's peak also holds buffers
    # gloo's worker thread frees late when it waits for a core (+49% at stage 3 once on a 2-core CI machine), hence
    # the least of a few steps (scenarios._measured_peak).
    for stage, result in measured_world2[0].items():
        grads = result["measured"]["gradients"]
        measured = result["resident"] - grads + result["measured_peak"]  # the step starts with no gradients
        assert abs(measured - result["ledger_peak"]) <= PEAK_TOLERANCE * result["ledger_peak"], (stage, measured,
                                                                                                 result["ledger_peak"])


def _compiled_or_error(stage: int, memory_budget: int | None, model: str = "chain"):
    """Compile the model's step under ``memory_budget``: each lowered graph by kind, or the FxShardError."""
    try:
        backend = scenarios.compiled_model(model, stage, memory_budget=memory_budget)
    except fxshard.FxShardError as error:
        return None, error
    return {r.kind: r.final for r in backend.graphs if r.kind in ("forward", "backward")}, None


def _ledgers_or_error(stage: int, memory_budget: int | None):
    graphs, error = _compiled_or_error(stage, memory_budget)
    return (None if graphs is None else {k: g.meta["fxshard_ledger"] for k, g in graphs.items()}), error


@pytest.mark.parametrize("stage", [1, 3])
def test_memory_budget_counts_the_optimizer_and_fails_compilation_over_it(stage):
    ledgers, error = _ledgers_or_error(stage, None)
    assert error is None
    params = sum(p.numel() for p in scenarios.Chain().parameters())
    for ledger in ledgers.values():
        # AdamW's two moments over what this rank updates (flat shards on 2 ranks, at most one row of padding each),
        # plus stage 1's master shards
        shard_elements = ledger["optimizer"] // (4 * (3 if stage == 1 else 2))
        rows = sum(p.shape[1] for p in scenarios.Chain().parameters())
        assert params / 2 <= shard_elements <= params / 2 + rows
        assert ledger["total"] == ledger["inputs"] + ledger["peak"] + ledger["optimizer"]
    # under a budget less eager schedules and per-layer grouping are candidates too: compilation fails only where
    # none fits
    graphs, _ = _compiled_or_error(stage, 1 << 40)
    least = max(min(c["bytes"] for c in g.meta["fxshard_choice"]["candidates"]) for g in graphs.values())
    _, error = _ledgers_or_error(stage, least - 1)
    assert error is not None and "memory_budget" in str(error) and "optimizer" in str(error)
    assert _ledgers_or_error(stage, least)[1] is None


def test_the_report_says_which_knobs_were_chosen_and_why():
    backend = scenarios.compiled_model("chain", 3, memory_budget=1 << 40)
    report = backend.report()
    assert "knobs chosen by the simulator (the fastest predicted graph that fits memory_budget=1,099,511,627,776 " \
           "bytes):" in report
    chosen = [line for line in report.splitlines() if line.endswith("<- chosen")]
    assert [line.split(":")[0].strip() for line in chosen] == ["graph 0 forward", "graph 0 backward"]
    assert all('bucket="auto", prefetch=1, max_inflight_gathers=2' in line and " ms, " in line for line in chosen)

class TiedAcrossABreak(torch.nn.Module):
    """An embedding and the head that shares its weight, in two Dynamo graphs (as HuggingFace models break on
    ``logger.warning_once``)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(96, 16)
        self.mix = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 96, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        x = self.mix(self.emb(tokens))
        torch._dynamo.graph_break()
        return self.head(torch.tanh(x)).logsumexp(-1).mean()


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_weight_tied_across_a_graph_break_is_held_once(stage):
    from torch.distributed.tensor import DTensor

    from fxshard.runtime.param import prepared_param, spec_of
    from fxshard.testing import fake_process_group

    with fake_process_group(2):
        torch._dynamo.reset()
        backend = fxshard.backend(compiler="eager", stage=stage)
        model = TiedAcrossABreak()
        model, _ = backend.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        torch.compile(model, backend=backend)(torch.randint(0, 96, (4, 8))).backward()
        def held(t, param):  # a leaf's rows (and its gradient's) are a view of a flat shard, padding included
            elements = spec_of(param).chunk if isinstance(t, DTensor) else t.numel()
            return elements * t.element_size()

        grads = sum(held(p.grad, p) for p in model.parameters())
        copies = [prepared_param(p).resident for p in model.parameters() if prepared_param(p).resident is not None]  # stage 2's, forward reads
        params = sum(held(p, p) for p in model.parameters()) + sum(t.numel() * t.element_size() for t in copies)
    ledger = budget.ledger(backend)
    assert len({r.graph_id for r in backend.graphs}) == 2
    assert ledger.at(sympy.Add(*(t.bytes for t in ledger.select("memory", "gradients")))) == grads
    held = [*ledger.select("memory", "master"), *ledger.select("memory", "compute copy")]
    assert ledger.at(sympy.Add(*(t.bytes for t in held))) == params
