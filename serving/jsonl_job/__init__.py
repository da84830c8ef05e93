"""The offline JSONL job, ``pagedserve generate --input in.jsonl --output out.jsonl``: ``job``
runs it (resumable), ``lines`` parses a line into a request and writes its record."""
