"""The ``torch.compile`` backend: from Dynamo's graph through AOT autograd and the pass pipeline to a compiled step.

- ``options``: the backend's options checked (stage, compiler, mesh, the knobs every pass reads);
- ``backend``: ``Backend``, which prepares a model and compiles its graphs;
- ``inductor``: the rewritten graphs handed to Inductor as ``torch.compile``'s default backend would;
- ``segments``: regional compilation, a graph cut at its collectives and each repeated segment compiled once;
- ``pipeline``: the passes run in order over one graph, each graph kept before and after every pass;
- ``blocks``: which modules share one collective (``bucket="block"`` / ``"auto"``);
- ``consistency``: the compile-time check that every rank compiled the same collectives.
"""
