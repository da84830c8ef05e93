"""The controller: scheduler, engine core, executors and tokenizer I/O (no torch, no tensors).

* ``request``: ``Request`` and its stop conditions;
* ``scheduler``: the token-budget scheduler over ``pagedserve.kv``;
* ``engine_core``: ``EngineCore`` (validate -> schedule -> execute -> update);
* ``executor``: the ``Executor`` protocol and the in-process ``LocalExecutor``;
* ``tokenizer``: Hugging Face tokenizer loading and incremental detokenization;
* ``errors``: typed request errors;
* ``wire``: the ZMQ step channel to remote workers; ``llm``: the offline ``LLM`` API.
"""
