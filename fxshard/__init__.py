"""fxshard: ZeRO-0/1/2/3 data parallelism for torch.compile, by FX graph passes.

    backend = fxshard.backend(stage=3)
    model, opt = backend.prepare(model, opt)
    model = torch.compile(model, backend=backend)
"""

from .api import Backend, backend, backend_of, default_passes
from . import report as _report_module  # noqa: F401, I001  (loaded before the name fxshard.report is rebound below)
from .api import report  # noqa: E402  (the function; the module stays importable as fxshard.report)
from .errors import FxShardError
from .ops import reduce_grad, unshard
from .simulate import simulate  # noqa: E402  (the function; the module stays importable as fxshard.simulate)

__all__ = ["Backend", "FxShardError", "backend", "backend_of", "default_passes", "reduce_grad", "report", "simulate",
           "unshard"]
