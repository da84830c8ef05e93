"""The front ends: the LLM class, the OpenAI-compatible HTTP server, JSONL batch jobs, CLI
arguments and metrics."""
