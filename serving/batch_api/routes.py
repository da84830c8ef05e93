"""The OpenAI Batch API, online: files and batches over a ``BatchStore``, run by a
``BatchRunner`` behind the server's interactive traffic.

Routes: ``POST /v1/files`` (multipart ``file`` + ``purpose=batch``), ``GET /v1/files``,
``GET /v1/files/{id}``, ``GET /v1/files/{id}/content``, ``DELETE /v1/files/{id}``,
``POST /v1/batches`` (``input_file_id``, ``endpoint`` ``/v1/completions``,
``/v1/chat/completions`` or ``/v1/responses``, ``completion_window`` ``24h``, optional
``metadata``),
``GET /v1/batches`` (newest first, ``limit`` and ``after``), ``GET /v1/batches/{id}`` and
``POST /v1/batches/{id}/cancel``. Bad input answers with the OpenAI error body.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import FileResponse
from pydantic import BaseModel, ConfigDict, StrictStr
from starlette.requests import ClientDisconnect

from pagedserve.serving.batch_api.records import BATCH_ENDPOINTS
from pagedserve.serving.batch_api.runner import BatchRunner
from pagedserve.serving.batch_api.store import TERMINAL
from pagedserve.serving.batch_api.upload import FILE_FIELD, receive_upload
from pagedserve.serving.openai.api_errors import APIError

__all__ = ["MAX_UPLOAD_BYTES", "CreateBatchRequest", "batch_router"]

MAX_UPLOAD_BYTES = 200 << 20
UPLOAD_PURPOSES = ("batch",)
_METADATA_PAIRS, _METADATA_KEY, _METADATA_VALUE = 16, 64, 512


class CreateBatchRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input_file_id: StrictStr
    endpoint: StrictStr
    completion_window: StrictStr
    metadata: dict[StrictStr, StrictStr] | None = None


def _not_found(kind: str, ident: str, param: str) -> APIError:
    return APIError(404, f"no {kind} with id {ident!r}", param=param, code="not_found")


_UPLOAD_BODY = {"requestBody": {"required": True, "content": {"multipart/form-data": {
    "schema": {"type": "object", "required": [FILE_FIELD, "purpose"], "properties": {
        FILE_FIELD: {"type": "string", "format": "binary"},
        "purpose": {"type": "string", "enum": list(UPLOAD_PURPOSES)},
    }}}}}}


def _is_unicode(text: str) -> bool:
    """False for a string holding a lone surrogate (``"\\ud800"`` in the client's JSON): no
    UTF-8 can carry it, so every answer echoing it could not be encoded."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if not all(_is_unicode(k) and _is_unicode(v) for k, v in metadata.items()):
        raise APIError(400, "metadata keys and values must be valid Unicode text (a lone "
                       "surrogate such as \\ud800 is not)", param="metadata")
    if len(metadata) > _METADATA_PAIRS:
        raise APIError(400, f"metadata holds at most {_METADATA_PAIRS} pairs", param="metadata")
    for key, value in metadata.items():
        if len(key) > _METADATA_KEY or len(value) > _METADATA_VALUE:
            raise APIError(
                400, f"metadata keys hold at most {_METADATA_KEY} characters and values "
                f"{_METADATA_VALUE}; {key[:70]!r} is longer", param="metadata",
            )


def _page(items: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {
        "object": "list", "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": has_more,
    }


def batch_router(runner: BatchRunner) -> APIRouter:
    """The routes of the files and batches kept in ``runner.store``."""
    store = runner.store
    model_name = runner.ctx.client.model_name
    router = APIRouter()

    # ----------------------------------------------------------------------- files
    @router.post("/v1/files", openapi_extra=_UPLOAD_BODY)
    async def create_file(request: Request) -> Any:
        # The body streams into the batch directory, never through starlette's form parser
        # (which would spool it all to $TMPDIR first): see ``upload``.
        tmp = store.upload_path()
        try:
            upload = await receive_upload(request.headers, request.stream(), tmp,
                                          MAX_UPLOAD_BYTES)
        except ClientDisconnect:  # the partial file is gone already; nobody reads an answer
            return Response(status_code=499)
        purpose = upload.fields.get("purpose")
        if purpose not in UPLOAD_PURPOSES:
            tmp.unlink(missing_ok=True)
            raise APIError(400, f"purpose must be one of {', '.join(UPLOAD_PURPOSES)}, got "
                           f"{purpose!r}", param="purpose")
        try:
            return store.add_file(tmp, Path(upload.filename or "upload.jsonl").name, purpose)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    @router.get("/v1/files")
    async def list_files(
        purpose: str | None = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
        after: str | None = None,
        order: Literal["asc", "desc"] = "desc",
    ) -> dict[str, Any]:
        files = store.list_files(purpose)
        if order == "asc":
            files.reverse()
        if after is not None:
            ids = [f["id"] for f in files]
            files = files[ids.index(after) + 1:] if after in ids else []
        return _page(files[:limit], len(files) > limit)

    def _file(file_id: str) -> dict[str, Any]:
        meta = store.get_file(file_id)
        if meta is None:
            raise _not_found("file", file_id, "file_id")
        return meta

    @router.get("/v1/files/{file_id}")
    async def retrieve_file(file_id: str) -> dict[str, Any]:
        return _file(file_id)

    @router.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str) -> FileResponse:
        meta = _file(file_id)
        return FileResponse(store.content_path(file_id), media_type="application/octet-stream",
                            filename=meta["filename"])

    @router.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str) -> dict[str, Any]:
        _file(file_id)
        if store.uses_file(file_id):
            raise APIError(409, f"file {file_id!r} is the input of an unfinished batch",
                           param="file_id", code="file_in_use")
        store.delete_file(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    # --------------------------------------------------------------------- batches
    @router.post("/v1/batches")
    async def create_batch(body: CreateBatchRequest) -> dict[str, Any]:
        if body.endpoint not in BATCH_ENDPOINTS:
            raise APIError(400, f"endpoint must be one of {', '.join(BATCH_ENDPOINTS)}, got "
                           f"{body.endpoint!r}", param="endpoint", code="unsupported_endpoint")
        if body.completion_window != "24h":
            raise APIError(400, f"completion_window must be \"24h\", got "
                           f"{body.completion_window!r}", param="completion_window")
        _check_metadata(body.metadata)
        meta = store.get_file(body.input_file_id)
        if meta is None:
            raise _not_found("file", body.input_file_id, "input_file_id")
        if meta["purpose"] != "batch":
            raise APIError(400, f"file {body.input_file_id!r} has purpose {meta['purpose']!r}, "
                           "not 'batch'", param="input_file_id")
        batch = store.create_batch(body.input_file_id, body.endpoint, body.completion_window,
                                   body.metadata, model=model_name)
        runner.notify()
        return batch

    @router.get("/v1/batches")
    async def list_batches(
        limit: Annotated[int, Query(ge=1, le=100)] = 20, after: str | None = None
    ) -> dict[str, Any]:
        page, has_more = store.list_batches(limit, after)
        return _page(page, has_more)

    def _batch(batch_id: str) -> dict[str, Any]:
        batch = store.get_batch(batch_id)
        if batch is None:
            raise _not_found("batch", batch_id, "batch_id")
        return batch

    @router.get("/v1/batches/{batch_id}")
    async def retrieve_batch(batch_id: str) -> dict[str, Any]:
        return _batch(batch_id)

    @router.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str) -> dict[str, Any]:
        batch = _batch(batch_id)
        if batch["status"] in ("cancelling", "cancelled"):
            return batch
        moved = store.transition(batch_id, {"validating", "in_progress"}, "cancelling")
        if moved is None:
            status = _batch(batch_id)["status"]
            done = "finished" if status in TERMINAL else "finishing"
            raise APIError(409, f"batch {batch_id!r} is {status} ({done}): it cannot be "
                           "cancelled", param="batch_id", code="batch_not_cancellable")
        runner.notify()
        return moved

    return router
