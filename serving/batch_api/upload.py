"""``POST /v1/files``'s body, streamed: a ``multipart/form-data`` body parsed as it arrives,
its ``file`` part written straight into a temporary file in the batch directory, the size
limit enforced while reading.

Starlette's own form parsing spools every file part to ``$TMPDIR`` before the route runs, so a
300 MB upload used to cost 300 MB outside ``--batch-dir`` and its 413 came only after the whole
body had arrived. Here the body is read chunk by chunk; past the limit the answer is a 413 at
once and the partial file is deleted. A ``Content-Length`` already over the limit is refused
before any byte is read.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from pagedserve.serving.openai.api_errors import APIError

try:
    from python_multipart.exceptions import FormParserError
    from python_multipart.multipart import MultipartParser, parse_options_header
except ImportError:  # python-multipart before 0.0.13 names its module ``multipart``
    from multipart.exceptions import FormParserError  # type: ignore[no-redef]
    from multipart.multipart import MultipartParser, parse_options_header  # type: ignore[no-redef]

__all__ = ["FILE_FIELD", "MAX_FIELD_BYTES", "Upload", "receive_upload"]

FILE_FIELD = "file"
MAX_FIELD_BYTES = 64 << 10
"""The other parts (``purpose``) together, at most; they are held in memory."""
_FLUSH_BYTES = 1 << 20  # file data is written in pieces of about this size, off the loop


@dataclass
class Upload:
    """What the body held: the file part's name and size (its bytes are in ``dest``) and the
    other parts as text."""

    filename: str | None = None
    size: int = 0
    fields: dict[str, str] = field(default_factory=dict)


def too_large(limit: int) -> APIError:
    return APIError(413, f"the file is larger than {limit} bytes", param=FILE_FIELD,
                    code="file_too_large")


def _bad(message: str) -> APIError:
    return APIError(400, message, param=FILE_FIELD)


class _Parts:
    """The parser's callbacks: headers of each part, then its data into the file or a field."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.upload = Upload()
        self.pending: list[bytes] = []  # file data not yet written
        self.pending_bytes = 0
        self._field_bytes = 0
        self._header_name = bytearray()
        self._header_value = bytearray()
        self._headers: dict[bytes, bytes] = {}
        self._part: str | None = None  # the part's form name
        self._data = bytearray()  # a field part's value so far
        self.seen_file = False
        self.complete = False  # the closing boundary was read

    def callbacks(self) -> dict[str, Any]:
        return {
            "on_part_begin": self._begin, "on_header_field": self._hname,
            "on_header_value": self._hvalue, "on_header_end": self._hend,
            "on_headers_finished": self._headers_done, "on_part_data": self._part_data,
            "on_part_end": self._end, "on_end": self._finished,
        }

    def _begin(self) -> None:
        self._headers, self._part, self._data = {}, None, bytearray()

    def _hname(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]

    def _hvalue(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def _hend(self) -> None:
        self._headers[bytes(self._header_name).lower()] = bytes(self._header_value)
        self._header_name, self._header_value = bytearray(), bytearray()

    def _headers_done(self) -> None:
        disposition, options = parse_options_header(self._headers.get(b"content-disposition"))
        if disposition != b"form-data" or b"name" not in options:
            raise _bad("every part of the form needs 'Content-Disposition: form-data; name=...'")
        self._part = options[b"name"].decode("utf-8", errors="replace")
        if self._part == FILE_FIELD:
            if self.seen_file:
                raise _bad("the form holds more than one file part")
            self.seen_file = True
            name = options.get(b"filename")
            self.upload.filename = name.decode("utf-8", errors="replace") if name else None

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        size = end - start
        if self._part == FILE_FIELD:
            self.upload.size += size
            if self.upload.size > self.limit:
                raise too_large(self.limit)
            self.pending.append(bytes(data[start:end]))
            self.pending_bytes += size
            return
        self._field_bytes += size
        if self._field_bytes > MAX_FIELD_BYTES:
            raise APIError(413, f"the form's fields other than the file hold more than "
                           f"{MAX_FIELD_BYTES} bytes", param="purpose")
        self._data += data[start:end]

    def _end(self) -> None:
        if self._part is not None and self._part != FILE_FIELD:
            self.upload.fields[self._part] = self._data.decode("utf-8", errors="replace")

    def _finished(self) -> None:
        self.complete = True

    def take(self) -> bytes:
        data = b"".join(self.pending)
        self.pending, self.pending_bytes = [], 0
        return data


def _boundary(content_type: str | None) -> bytes:
    kind, options = parse_options_header(content_type or "")
    boundary = options.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise _bad("the body must be multipart/form-data with a 'file' part and a 'purpose' "
                   "field")
    return bytes(boundary)


async def receive_upload(
    headers: Any, chunks: AsyncIterator[bytes], dest: Path, limit: int
) -> Upload:
    """Read a multipart body from ``chunks`` (``Request.stream()``); write its file part into
    ``dest``. Raises ``APIError`` (400 malformed, 413 over ``limit``), removing ``dest``."""
    boundary = _boundary(headers.get("content-type"))
    declared = headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit + MAX_FIELD_BYTES:
        raise too_large(limit)  # every part's headers and fields fit in the slack
    parts = _Parts(limit)
    parser = MultipartParser(boundary, parts.callbacks())
    f: IO[bytes] = await asyncio.to_thread(open, dest, "wb")
    try:
        async for chunk in chunks:
            try:
                parser.write(chunk)
            except FormParserError as exc:
                raise _bad(f"the multipart body is malformed: {exc}") from None
            if parts.pending_bytes >= _FLUSH_BYTES:
                await asyncio.to_thread(f.write, parts.take())
        if not parts.complete:
            raise _bad("the multipart body ends before its closing boundary")
        if not parts.seen_file:
            raise _bad("the form has no 'file' part")
        await asyncio.to_thread(f.write, parts.take())
        await asyncio.to_thread(f.close)
    except BaseException:
        f.close()
        dest.unlink(missing_ok=True)
        raise
    return parts.upload
