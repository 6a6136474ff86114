"""The runtime that lays shards out and runs them, outside any graph.

- ``sharding``: how one parameter splits over a group (``ShardSpec``, flat and padded);
- ``groups``: the process groups fxshard's collectives run on (gloo's one-worker twin, peer failures);
- ``ops``: the marker ops ``unshard`` / ``reduce_grad`` the passes lower, with their eager implementations;
- ``param``: one record per prepared parameter (``PreparedParam``): its layout and the tensors kept for it;
- ``prepare``: a model's parameters laid out for a ZeRO stage before the first trace;
- ``materialise``: a model built on the meta device, initialised one module at a time into its shards;
- ``layout``: a flat shard as the DTensor of its rows that state dicts hold (FSDP2's layout);
- ``optim``: the optimizer ``prepare`` returns, over what this rank updates;
- ``optimizer_state_dict``: that optimizer's ``state_dict()`` / ``load_state_dict()`` in the DTensor layout.
"""
