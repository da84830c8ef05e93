"""The OpenAI Batch API, online, inside the HTTP server: ``routes`` (files and batches),
``runner`` (lines through the server's endpoint code, behind interactive traffic), ``store``
(state on disk) and ``records`` (the line format)."""
