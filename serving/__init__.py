"""The front ends, each in its own subpackage, over the engine's ``EngineClient``:

* ``llm``: the ``LLM`` Python class (``from pagedserve import LLM``);
* ``openai/``: the OpenAI-compatible HTTP server (``pagedserve serve``): protocol, endpoints,
  tokenize routes, Prometheus metrics;
* ``batch_api/``: the OpenAI Batch API mounted in that server (files and batches on disk, run
  through the server's endpoint code behind its interactive traffic);
* ``jsonl_job/``: the offline JSONL job (``pagedserve generate --input/--output``);
* ``cli/``: the command-line options of ``pagedserve generate`` and ``pagedserve serve``, the
  only place here that parses argv;
* ``chat``: chat templates, shared by ``LLM.chat``, the JSONL job and the CLI.
"""
