"""The OpenAI-compatible HTTP server (``pagedserve serve``): ``server`` builds the app,
``protocol`` holds the bodies, ``prepare`` and ``endpoint`` answer ``/v1/completions`` and
``/v1/chat/completions`` over an ``engine_run``, ``responses`` (with ``responses_protocol`` and
``responses_output``) answers ``/v1/responses`` as the chat completion it amounts to,
``tokenize_routes`` the tokenizer routes and ``metrics`` the Prometheus registry."""
