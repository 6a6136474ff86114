"""fxshard: ZeRO-0/1/2/3 data parallelism for torch.compile, by FX graph passes.

    backend = fxshard.backend(stage=3)
    model, opt = backend.prepare(model, opt)
    model = torch.compile(model, backend=backend)

The package follows the data path: ``runtime`` (shards laid out and run), ``compiler`` (the torch.compile backend
and its pass pipeline; the passes themselves are ``fxshard.passes``), ``checkpoint``, ``budget`` (the sympy ledger),
``simulate`` (step-time prediction and autotune), ``report`` (what the compiler did), ``testing``.
"""

# api first: it loads fxshard.passes before the ledger (fxshard.budget), whose graph reading uses the passes'
# helpers while the budget pass uses the ledger. The names report and simulate are then rebound from the packages
# to the functions; the packages stay importable as fxshard.report and fxshard.simulate.
from .api import Backend, backend, backend_of, default_passes, report  # noqa: I001
from . import checkpoint  # the docs' fxshard.checkpoint.save / load / latest after a plain `import fxshard`
from .errors import FxShardError
from .runtime.ops import reduce_grad, unshard
from .simulate.simulator import simulate

__all__ = ["Backend", "FxShardError", "backend", "backend_of", "default_passes", "reduce_grad", "report", "simulate",
           "unshard"]
