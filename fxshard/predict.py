"""Predict a training step of a HuggingFace model from its config file alone, at any world size, on any machine.

``python -m fxshard simulate --config CONFIG.json --world 64 --batch 1 --seq 8192 --ac selective --machine NAME``
builds the model from the config on the meta device (never materialised: no parameter, activation or gradient is
ever allocated), prepares it under a fake process group of ``--world`` ranks (so the shards, the buckets, the
autotune choices and the prefetch placement are those of that world, made on that machine), compiles one training
step and runs it on meta tensors (the graphs are traced, rewritten and run op by op on shapes alone, in seconds),
and predicts it with ``fxshard.simulate``.

Depth: the model is compiled at ``COMPILED_DEPTHS`` decoder layers, and at the config's depth the compute and the
exposed communication are the deeper step's plus the per-layer difference times the layers left (every layer is
the same block: its compute, its collectives and their overlap repeat), the exposed part never shrinking with depth
(a shallow model exposes a little once that a deeper one does not). Where autotune chose among candidates (the
grouping), each is scaled so and the fastest at full depth taken: a grouping that exposes a little per layer can win
at 2 layers and lose at 80. Checked against a full-depth compile of Llama 3 8B (docs/simulate.md).

Attention runs as the flash kernel a GPU runs (``_scaled_dot_product_flash_attention_for_cpu``, which fxshard's
flop counter counts as CUDA's flash attention): on meta tensors torch's SDPA would fall back to the math path and
price an s x s softmax a GPU never writes.

Activation checkpointing (``ac``): ``"full"`` recomputes every decoder layer in backward, ``"selective"`` every
second one (torchtitan's selective layer AC, ``ac_freq=2``), ``"none"`` none. The recomputation is simulated, not
traced (``WhatIf.recompute``): each checkpointed layer's forward compute runs again on the compute stream right
before the layer's backward, where the collectives in flight hide behind it as they do behind any compute. (Traced
on meta tensors, a checkpointed region's attention, a seeded op, would need torch's RNG functionalization, which
has no meta implementation.)

MFU is torchtitan's: model FLOPs per token ``6 * parameters + 12 * layers * hidden * seq`` (recomputation not
counted) times tokens per second, over the machine's datasheet peak (``Machine.peak_flops_per_s``).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import pathlib

import torch

from fxshard.compiler.backend import Backend
from fxshard.errors import FxShardError
from fxshard.passes.cost_model import Machine
from fxshard.compiler.blocks import ROOT, repeated_blocks
from fxshard.simulate.simulator import WhatIf, simulate
from fxshard.testing import fake_process_group
from fxshard.torch_compat import flash_attention, reset_compiled

AC_MODES = ("none", "selective", "full")
PARAM_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}  # --param-dtype: None computes in fp32
COMPILED_DEPTHS = (2, 4)  # decoder layers compiled (not 1: a lone layer is no repeated block, and bucket="auto"
# groups another way); the step scales linearly from them (docs/simulate.md)
# the HuggingFace attention implementation registered below (a name with "flash" in it sends transformers looking
# for its flash-attn packages)
ATTENTION = "fxshard_fused"


@dataclasses.dataclass(frozen=True)
class Prediction:
    """One predicted training step per rank of a model at its config's depth."""

    model: str  # the config's model_type
    layers: int
    world: int
    batch: int  # sequences per rank
    seq: int
    ac: str
    machine: str
    step_s: float
    compute_s: float  # busy compute stream, recomputation included
    exposed_s: float  # communication compute did not hide
    flops_per_token: float  # model FLOPs (torchtitan's count)
    peak_flops_per_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.batch * self.seq / self.step_s

    @property
    def mfu(self) -> float:
        return self.tokens_per_s * self.flops_per_token / self.peak_flops_per_s

    def summary(self) -> str:
        return f"tokens/s per rank {self.tokens_per_s:.0f}  MFU {100 * self.mfu:.1f}%"


def load_config(path):
    """The HuggingFace config a JSON file describes (its ``model_type`` names the architecture)."""
    import transformers

    try:
        fields = json.loads(pathlib.Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise FxShardError(f"cannot read the config file {path}: {error}") from None
    model_type = fields.pop("model_type", None) if isinstance(fields, dict) else None
    if model_type is None:
        raise FxShardError(f"{path} must hold a HuggingFace config: a JSON object with its model_type "
                           '(e.g. "llama"), as config.json of a model on the Hub')
    try:
        return transformers.AutoConfig.for_model(model_type, **fields)
    except ValueError as error:
        raise FxShardError(f"{path}: transformers does not know model_type {model_type!r} ({error})") from None


def predict_from_config(path, *, world: int, batch: int, seq: int, machine: Machine, ac: str = "none",
                        param_dtype: torch.dtype | None = torch.bfloat16, stage: int = 3, **knobs) -> Prediction:
    """The step of the model ``path``'s config describes, ``batch`` sequences of ``seq`` tokens per rank, on
    ``world`` ranks of ``machine``, under ``fxshard.backend(stage, param_dtype=..., **knobs)`` (the wire options and
    ``reshard_after_forward`` among them)."""
    if ac not in AC_MODES:
        raise FxShardError(f"ac must be one of {', '.join(AC_MODES)}; got {ac!r}")
    if min(world, batch, seq) < 1:
        raise FxShardError(f"world, batch and seq must be positive; got {world}, {batch}, {seq}")
    config = load_config(path)
    layers = config.num_hidden_layers
    options = {"stage": stage, "param_dtype": param_dtype, **knobs}
    depths = COMPILED_DEPTHS if layers > max(COMPILED_DEPTHS) else (layers,)  # a shallow model: compiled whole
    steps = {depth: _simulated_steps(*_compiled_step(config, depth, world, batch, seq, machine, options), world,
                                     machine, ac) for depth in depths}
    at_depth = {}  # per candidate the backend chose among (its knobs): the step at the config's depth
    for knobs in steps[depths[-1]]:
        if layers in steps:
            at_depth[knobs] = steps[layers][knobs]
        else:
            (shallow, (_, compute_low, exposed_low)), (deep, (_, compute, exposed)) = (
                (depth, steps[depth][knobs]) for depth in depths)
            compute += (layers - deep) * (compute - compute_low) / (deep - shallow)
            # what a shallow model exposes once (a gather held back to keep its small peak) can shrink with depth;
            # each further layer exposes what it exposes, never less than nothing
            exposed += (layers - deep) * max(0.0, (exposed - exposed_low) / (deep - shallow))
            at_depth[knobs] = (compute + exposed, compute, exposed)
    # the choice autotune would make at full depth: a grouping that exposes a little per layer can win at 2 layers
    # and lose at 80
    step, compute, exposed = min(at_depth.values())
    flops = _model_flops(config, seq, layers)
    return Prediction(config.model_type, layers, world, batch, seq, ac, machine.name, step, compute, exposed, flops,
                      machine.peak_flops_per_s or machine.flops_per_s)


def _compiled_step(config, depth: int, world: int, batch: int, seq: int, machine: Machine,
                   options: dict) -> tuple[Backend, list[str]]:
    """The backend that compiled one step of the model cut to ``depth`` layers, run on meta tensors under a fake
    group of ``world`` ranks, and the names of its decoder layers."""
    import transformers

    _register_flash_attention()
    config = copy.deepcopy(config)
    config.num_hidden_layers = depth
    config.use_cache = False
    reset_compiled()
    with fake_process_group(world):
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=ATTENTION)
        backend = Backend(compiler="eager", machine=machine, **options)
        model, _ = backend.prepare(model, torch.optim.AdamW(model.parameters()), device="meta")
        ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
        torch.compile(_training_loss, backend=backend, fullgraph=True)(model, ids).backward()
    return backend, [block for block in repeated_blocks(model) if block != ROOT]


def _simulated_steps(backend: Backend, layers: list[str], world: int, machine: Machine,
                     ac: str) -> dict[str | None, tuple[float, float, float]]:
    """(step, busy compute, exposed communication) seconds of ``backend``'s step, its checkpointed layers (``ac``)
    recomputed in backward; per candidate autotune chose among (by its knobs; None where there was no choice)."""
    checkpointed = {"none": [], "selective": layers[::2], "full": layers}[ac]
    what_if = WhatIf(recompute=tuple(checkpointed))
    choices = [r.final.meta["fxshard_choice"] for r in backend.graphs
               if r.final is not None and "fxshard_choice" in r.final.meta]
    candidates = list(dict.fromkeys(c["knobs"] for choice in choices for c in choice["candidates"])) or [None]
    steps = {}
    for knobs in candidates:
        timeline = simulate(backend, world, machine=machine, what_if=what_if, knobs=knobs)
        steps[knobs] = (timeline.step_time, timeline.compute_time, timeline.exposed_comm)
    return steps


def _training_loss(model, ids: torch.Tensor) -> torch.Tensor:
    """The next-token loss of a causal LM, as HuggingFace computes it (in fp32 over the vocabulary), written out:
    ``labels=`` would reach ``aten::nll_loss``, whose meta kernel has no autograd formula (torch warns while tracing
    the backward)."""
    logits = model(input_ids=ids).logits.float()
    return -logits.log_softmax(-1).gather(-1, ids.unsqueeze(-1)).mean()


def _model_flops(config, seq: int, layers: int) -> float:
    """Model FLOPs per token, torchtitan's ``6 N + 12 l h s`` with N every parameter (as its published MFUs count
    them), counted on meta models of one layer and of two (each layer adds the same)."""
    import transformers

    counts = []
    for depth in (1, 2):
        cut = copy.deepcopy(config)
        cut.num_hidden_layers = depth
        with torch.device("meta"):
            counts.append(sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(cut).parameters()))
    parameters = counts[0] + (layers - 1) * (counts[1] - counts[0])
    return 6 * parameters + 12 * layers * config.hidden_size * seq


def _register_flash_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _flash_attention)


def _flash_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal attention as the flash kernel (HuggingFace's attention interface: (batch, heads, seq, dim) in,
    (batch, seq, heads, dim) out); grouped keys and values repeated to the query's heads, as HuggingFace's SDPA
    path does."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    out, _ = flash_attention(query, key, value, dropout, True, scaling)
    return out.transpose(1, 2).contiguous(), None
