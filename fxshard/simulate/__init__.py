"""``fxshard.simulate``: predict a step's time from its rewritten graphs, and choose knobs by the prediction.

- ``simulator``: the two-stream alpha-beta timeline (``simulate``, ``simulate_graph``) over the one estimator of
  time the passes schedule by (``fxshard.passes.cost_model``: ``Machine``, re-exported here);
- ``calibration``: the ``Machine`` constants measured on a process group (``calibrate``) and the fits behind them;
- ``machines``: presets for GPU systems from their datasheets (``load_machine``), and JSON files of one's own;
- ``autotune``: the knobs a graph compiles with where the user left a choice, the fastest predicted that fits.

``fxshard.simulate(...)`` is the function ``simulator.simulate``; this package stays importable by its name.
"""

from fxshard.passes.cost_model import GLOO_ON_CPU, NCCL_ON_GPU, Machine, default_machine

from .calibration import calibrate
from .simulator import Timeline, machine_of, simulate, simulate_graph

__all__ = ["GLOO_ON_CPU", "NCCL_ON_GPU", "Machine", "Timeline", "calibrate", "default_machine", "machine_of",
           "simulate", "simulate_graph"]
