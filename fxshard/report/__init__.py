"""``fxshard.report``: what the compiler did, for a person and for tools.

- ``tables``: the collectives of each rewritten graph and the step's ledger beside what a run measured;
- ``measure``: ``CollectiveCounter``, the collectives a step really ran, by kind and size;
- ``wire``: the bytes ranks sent each other as the kernel counts them (``sent_during``), outside torch;
- ``trace``: every pass's graphs in ``TORCH_LOGS="fxshard"`` and ``TORCH_TRACE`` (tlparse);
- ``chrome_trace``: a simulated step as a Chrome trace-event file for Perfetto.

``fxshard.report(model)`` is the function of ``fxshard.api``; this package stays importable by its name.
"""

from .measure import CollectiveCounter
from .tables import collective_report, collectives, ledger_report, ledger_rows

__all__ = ["CollectiveCounter", "collective_report", "collectives", "ledger_report", "ledger_rows"]
