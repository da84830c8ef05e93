"""The engine core (pure Python: no torch, ray or zmq, never a tensor).

* ``request``: ``Request`` and its stop conditions; ``scheduler``: the token-budget scheduler
  over ``pagedserve.kv``; ``kv_plan``: the KV pool from the workers' report;
* ``engine_core``: ``EngineCore`` (validate -> schedule -> execute -> update, per-step deltas);
* ``outputs``: the delta contract and the accumulator of cumulative outputs;
* ``loop``: ``EngineLoop``, the one engine loop; ``client``: ``EngineClient`` and the
  in-process client;
* ``drafts``: speculative decoding's proposers (prompt lookup, suffix trees) and the drafter
  that gives running requests their drafts before each step;
* ``executor``: the ``Executor`` protocol and ``LocalExecutor``; ``restarts``: the rebuild
  policy; ``errors``: typed errors; ``tokenizer``: tokenizer I/O and incremental detokenization.
"""
