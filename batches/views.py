"""The OpenAI Files and Batch APIs. Views parse, call `batches.actions`, and respond.

Every lookup is scoped to the caller's tenant, so another tenant's file or batch is a
404, exactly like one that does not exist.
"""
import threading
import weakref
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from channels.db import database_sync_to_async
from django.conf import settings
from django.db import connection
from django.db.models import Sum
from django.db.models.functions import Substr
from django.http import HttpResponse, StreamingHttpResponse
from django.utils.http import content_disposition_header
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.negotiation import BaseContentNegotiation
from rest_framework.parsers import JSONParser, MultiPartParser
from rest_framework.request import Request
from rest_framework.response import Response

from batches import actions
from batches.models import Batch, File
from tenants.api import TenantAPIView, on_a_pool
from tenants.errors import ApiError
from tenants.models import ApiKey, Scope

MAX_PAGE = 100
MAX_METADATA_KEYS = 16  # as OpenAI
MAX_IDEMPOTENCY_KEY = 255


def _not_found(kind: str, object_id: str) -> ApiError:
    return ApiError(404, f"No {kind} with id '{object_id}' was found.", code=f"{kind}_not_found")


def _own_file(request: Request, file_id: str) -> File:
    file = File.objects.filter(tenant=request.user, pk=file_id).defer("content").first()
    if file is None:
        raise _not_found("file", file_id)
    return file


def _own_batch(request: Request, batch_id: str) -> Batch:
    batch = Batch.objects.filter(tenant=request.user, pk=batch_id).first()
    if batch is None:
        raise _not_found("batch", batch_id)
    return batch


def _limit(request: Request) -> int:
    raw = request.query_params.get("limit", "20")
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_PAGE:
        raise ApiError(400, f"'limit' must be an integer from 1 to {MAX_PAGE}.", code="invalid_value", param="limit")
    return int(raw)


def _page(queryset, request: Request, make: Any) -> dict:
    """OpenAI's cursor pagination: newest first, `after` the last id of the previous page.
    `make` turns the page's rows into their objects, all at once."""
    limit = _limit(request)
    after = request.query_params.get("after")
    if after:
        anchor = queryset.filter(pk=after).values("created_at").first()
        if anchor is None:
            raise ApiError(400, f"'after' names no object of yours: '{after}'.", code="invalid_value", param="after")
        queryset = queryset.filter(created_at__lte=anchor["created_at"]).exclude(
            created_at=anchor["created_at"], pk__gte=after)
    rows = list(queryset.order_by("-created_at", "-pk")[: limit + 1])
    data = make(rows[:limit])
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(rows) > limit}


FILE_FIELDS = {
    "id": serializers.CharField(), "object": serializers.CharField(help_text="file"),
    "bytes": serializers.IntegerField(), "created_at": serializers.IntegerField(),
    "filename": serializers.CharField(), "purpose": serializers.CharField(), "status": serializers.CharField(),
}
BATCH_FIELDS = {
    "id": serializers.CharField(), "object": serializers.CharField(help_text="batch"),
    "endpoint": serializers.CharField(), "input_file_id": serializers.CharField(),
    "completion_window": serializers.CharField(), "status": serializers.ChoiceField(choices=Batch.Status.values),
    "output_file_id": serializers.CharField(allow_null=True), "error_file_id": serializers.CharField(allow_null=True),
    "created_at": serializers.IntegerField(), "expires_at": serializers.IntegerField(),
    "request_counts": inline_serializer("BatchRequestCounts", {
        "total": serializers.IntegerField(), "completed": serializers.IntegerField(),
        "failed": serializers.IntegerField()}),
    "metadata": serializers.DictField(allow_null=True),
    "model": serializers.CharField(allow_null=True),
    "usage": inline_serializer("BatchUsage", {
        "input_tokens": serializers.IntegerField(),
        "input_tokens_details": inline_serializer("BatchInputTokensDetails", {"cached_tokens": serializers.IntegerField()}),
        "output_tokens": serializers.IntegerField(),
        "output_tokens_details": inline_serializer("BatchOutputTokensDetails", {"reasoning_tokens": serializers.IntegerField()}),
        "total_tokens": serializers.IntegerField()}, help_text="The tokens its items used so far; each item billed once."),
}
FILE_SCHEMA = inline_serializer("File", FILE_FIELDS)
BATCH_SCHEMA = inline_serializer("Batch", BATCH_FIELDS)


def _list_schema(name: str, item: str, fields: dict) -> serializers.Serializer:
    return inline_serializer(name, {
        "object": serializers.CharField(help_text="list"), "data": inline_serializer(item, fields, many=True),
        "first_id": serializers.CharField(allow_null=True), "last_id": serializers.CharField(allow_null=True),
        "has_more": serializers.BooleanField()})


PAGE_PARAMS = [OpenApiParameter("limit", int, description=f"1..{MAX_PAGE}, default 20"),
               OpenApiParameter("after", str, description="the last id of the previous page")]


class FileList(TenantAPIView):
    """POST /v1/files (multipart: `file`, `purpose=batch`), GET /v1/files."""
    scopes = {"GET": Scope.READ, "POST": Scope.BATCH}

    parser_classes = [MultiPartParser]

    @extend_schema(operation_id="createFile", tags=["files"], responses={200: FILE_SCHEMA}, description=(
        f"A JSONL batch input file: at most {settings.FILES_MAX_BYTES} bytes and {settings.BATCH_MAX_LINES} lines "
        f"(blank lines count), each line at most {settings.MAX_REQUEST_BYTES} bytes (400/413 naming `file`). "
        f"A tenant's files take at most {settings.FILES_MAX_STORED_BYTES} bytes in all (400 "
        f"`storage_limit_exceeded`), and {settings.FILES_MAX_CONCURRENT_UPLOADS} upload(s) per tenant are checked "
        "at a time (429 `too_many_uploads`, with Retry-After). The key is checked before the body is read."),
                   request={"multipart/form-data": inline_serializer("FileUpload", {
                       "file": serializers.FileField(), "purpose": serializers.ChoiceField(choices=["batch"])})})
    def post(self, request: Request) -> Response:
        upload = request.FILES.get("file")
        if upload is None:
            raise ApiError(400, "Send the file as the multipart field 'file'.", code="missing_required_parameter",
                           param="file")
        purpose = request.data.get("purpose")
        if not purpose:
            raise ApiError(400, "'purpose' is required (\"batch\").", code="missing_required_parameter", param="purpose")
        _check_storage(request.user, upload.size)
        with upload_slot(request.user.pk):
            file = actions.upload_file(request.user, upload.name or "", upload, purpose)
        return Response(actions.file_object(file))

    @extend_schema(operation_id="listFiles", tags=["files"], parameters=[
        *PAGE_PARAMS, OpenApiParameter("purpose", str)], responses={200: _list_schema("FileList", "File", FILE_FIELDS)})
    def get(self, request: Request) -> Response:
        files = File.objects.filter(tenant=request.user).defer("content")
        if request.query_params.get("purpose"):
            files = files.filter(purpose=request.query_params["purpose"])
        return Response(_page(files, request, lambda rows: [actions.file_object(f) for f in rows]))


_uploading: Counter = Counter()  # tenant id -> uploads being checked in this process
_uploading_lock = threading.Lock()


@contextmanager
def upload_slot(tenant_id: int) -> Iterator[None]:
    """One of the tenant's FILES_MAX_CONCURRENT_UPLOADS slots in this process, or a 429: the
    upload pool is shared, and one tenant's files must not hold all of it."""
    limit = settings.FILES_MAX_CONCURRENT_UPLOADS
    with _uploading_lock:
        if _uploading[tenant_id] >= limit:
            raise ApiError(429, f"This organization already has {limit} upload(s) being checked; retry when "
                                "it finishes.", type="requests", code="too_many_uploads", param="file",
                           headers={"Retry-After": "2"})
        _uploading[tenant_id] += 1
    try:
        yield
    finally:
        with _uploading_lock:
            _uploading[tenant_id] -= 1
            if not _uploading[tenant_id]:
                del _uploading[tenant_id]


def _check_storage(tenant, size: int) -> None:
    """A tenant's files (inputs and outputs) stay under FILES_MAX_STORED_BYTES. Two uploads
    racing may both pass: the bound is exceeded by at most the uploads in flight."""
    stored = File.objects.filter(tenant=tenant).aggregate(total=Sum("bytes"))["total"] or 0
    limit = settings.FILES_MAX_STORED_BYTES
    if stored + size > limit:
        raise ApiError(400, f"This organization's files would take {stored + size} bytes, over its limit of {limit}; "
                            "delete files it no longer needs.", code="storage_limit_exceeded", param="file")


# A large file parsed in a request's own thread (a 40 MiB upload took 14 s) took the GIL from
# every other tenant's request for as many uploads as were sent at once. Uploads, and batch
# creation (which reads the file's lines again), run on a small pool of their own instead,
# FILES_UPLOAD_WORKERS at a time; the rest queue for it (tenants.api.on_a_pool).
_upload_pool = ThreadPoolExecutor(max_workers=settings.FILES_UPLOAD_WORKERS, thread_name_prefix="file-upload")


class FileDetail(TenantAPIView):
    """GET /v1/files/{id}, DELETE /v1/files/{id}."""
    scopes = {"GET": Scope.READ, "DELETE": Scope.BATCH}

    @extend_schema(operation_id="retrieveFile", tags=["files"], responses={200: FILE_SCHEMA})
    def get(self, request: Request, file_id: str) -> Response:
        return Response(actions.file_object(_own_file(request, file_id)))

    @extend_schema(operation_id="deleteFile", tags=["files"], responses={200: inline_serializer("FileDeleted", {
        "id": serializers.CharField(), "object": serializers.CharField(), "deleted": serializers.BooleanField()})})
    def delete(self, request: Request, file_id: str) -> Response:
        actions.delete_file(_own_file(request, file_id))
        return Response({"id": file_id, "object": "file", "deleted": True})


class AnyAccept(BaseContentNegotiation):
    """The file's bytes answer any Accept header (the openai client asks for
    `application/binary`); errors still render as JSON."""

    def select_parser(self, request, parsers):
        return parsers[0] if parsers else None

    def select_renderer(self, request, renderers, format_suffix=None):
        return renderers[0], renderers[0].media_type


# Downloads stream from the database a slice at a time, on a pool of their own, at most
# FILES_MAX_CONCURRENT_DOWNLOADS of a tenant's at once in this process. Read whole
# (bytes(file.content)), a 100 MiB file held a thread while the database sent it and
# was held three times over (the row, the copy, Twisted's buffer for a client that reads
# nothing): a tenant's few parallel downloads grew the web process by gigabytes. The server's
# stream hook (config.daphne_hooks) holds a download to DOWNLOAD_BUFFER_BYTES unread and
# disconnects a client that takes nothing for STREAM_STALL_S.
DOWNLOAD_CHUNK = 1024**2
_download_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="file-download")
# The downloads alive in this process: one counts until it ends or its response is dropped (a
# client gone before its first byte cancels the response without closing its content).
_downloads: weakref.WeakSet = weakref.WeakSet()
_downloads_lock = threading.Lock()


def _slice(file_id: str, offset: int) -> bytes | None:
    """DOWNLOAD_CHUNK bytes of a file's content from `offset` (None: the file is gone). SQLite
    reads them with its incremental blob I/O: its substr() materialised the whole value for
    every slice (a 19 MB file took 0.78 s to download, against 0.10 s read whole). PostgreSQL
    slices the stored value itself (its content column is stored uncompressed, migration
    0005, so a slice reads only its own pages)."""
    if connection.vendor == "sqlite":
        connection.ensure_connection()
        raw = connection.connection
        row = raw.execute(f"SELECT rowid FROM {File._meta.db_table} WHERE id = ?", (file_id,)).fetchone()
        if row is None:
            return None
        with raw.blobopen(File._meta.db_table, "content", row[0], readonly=True) as blob:
            blob.seek(offset)
            return blob.read(DOWNLOAD_CHUNK)
    part = (File.objects.filter(pk=file_id).annotate(part=Substr("content", offset + 1, DOWNLOAD_CHUNK))
            .values_list("part", flat=True).first())
    return None if part is None else bytes(part)


class _Download:
    """A file's content as an async iterator of slices, counted against its holder's downloads
    (a tenant, or a staff user of the console)."""

    def __init__(self, file: File, holder: object) -> None:
        self.file_id, self.size, self.holder, self.done = file.id, file.bytes, holder, False
        limit = settings.FILES_MAX_CONCURRENT_DOWNLOADS
        with _downloads_lock:
            if sum(1 for d in list(_downloads) if d.holder == holder and not d.done) >= limit:
                raise ApiError(429, f"This organization already has {limit} download(s) in progress; retry when "
                                    "one finishes.", type="requests", code="too_many_downloads",
                               headers={"Retry-After": "2"})
            _downloads.add(self)

    async def __aiter__(self):
        try:
            for offset in range(0, self.size, DOWNLOAD_CHUNK):
                part = await database_sync_to_async(_slice, thread_sensitive=False, executor=_download_pool)(
                    self.file_id, offset)
                if not part:  # deleted meanwhile: the connection closes short of Content-Length
                    raise RuntimeError(f"file {self.file_id} was deleted during its download")
                yield part
        finally:
            self.done = True

    def close(self) -> None:  # Django calls it when the response ends
        self.done = True


class FileContent(TenantAPIView):
    """GET /v1/files/{id}/content: the file's bytes (JSONL), streamed."""
    scopes = {"GET": Scope.READ}

    content_negotiation_class = AnyAccept

    @extend_schema(operation_id="downloadFile", tags=["files"], responses={(200, "application/jsonl"): bytes})
    def get(self, request: Request, file_id: str) -> HttpResponse:
        file = File.objects.filter(tenant=request.user, pk=file_id).defer("content").first()
        if file is None:
            raise _not_found("file", file_id)
        return streamed_file(file, request.user.pk)


def streamed_file(file: File, holder: object) -> StreamingHttpResponse:
    """`file` (its content deferred) as a download streamed a slice at a time, counted against
    `holder`'s downloads in progress: ApiError 429 `too_many_downloads` past the limit."""
    response = StreamingHttpResponse(_Download(file, holder), content_type="application/jsonl")
    response["Content-Length"] = str(file.bytes)
    response["Content-Disposition"] = content_disposition_header(True, file.filename)
    return response


def _batch_spec(request: Request) -> actions.BatchSpec:
    data = request.data
    if not isinstance(data, dict):
        raise ApiError(400, "The request body must be a JSON object.", code="invalid_json")
    unknown = sorted(set(data) - {"input_file_id", "endpoint", "completion_window", "metadata"})
    if unknown:
        raise ApiError(400, f"Unrecognized request argument(s): {', '.join(unknown)}.", code="unknown_parameter",
                       param=unknown[0])
    for name in ("input_file_id", "endpoint", "completion_window"):
        if not isinstance(data.get(name), str) or not data[name]:
            raise ApiError(400, f"'{name}' is required and must be a string.", code="missing_required_parameter",
                           param=name)
    metadata = data.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= MAX_METADATA_KEYS
                                     and all(isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                                             for k, v in metadata.items())):
        raise ApiError(400, f"'metadata' must be an object of at most {MAX_METADATA_KEYS} string values "
                            "(keys up to 64 characters, values up to 512).", code="invalid_value", param="metadata")
    key = request.headers.get("Idempotency-Key", "").strip()
    if len(key) > MAX_IDEMPOTENCY_KEY:
        raise ApiError(400, f"The Idempotency-Key header is longer than {MAX_IDEMPOTENCY_KEY} characters.",
                       code="invalid_value", param="Idempotency-Key")
    return actions.BatchSpec(data["input_file_id"], data["endpoint"], data["completion_window"], metadata, key)


class BatchList(TenantAPIView):
    """POST /v1/batches (an `Idempotency-Key` header replays the first answer), GET /v1/batches."""
    scopes = {"GET": Scope.READ, "POST": Scope.BATCH}

    parser_classes = [JSONParser]

    @extend_schema(operation_id="createBatch", tags=["batches"], responses={200: BATCH_SCHEMA},
                   parameters=[OpenApiParameter("Idempotency-Key", str, OpenApiParameter.HEADER)],
                   request=inline_serializer("BatchCreate", {
                       "input_file_id": serializers.CharField(),
                       "endpoint": serializers.ChoiceField(choices=["/v1/chat/completions", "/v1/completions"]),
                       "completion_window": serializers.ChoiceField(choices=["24h"]),
                       "metadata": serializers.DictField(child=serializers.CharField(), required=False)}))
    def post(self, request: Request) -> Response:
        api_key = request.auth if isinstance(request.auth, ApiKey) else None
        batch, _ = actions.create_batch(request.user, _batch_spec(request), api_key)
        return Response(actions.batch_object(batch))

    @extend_schema(operation_id="listBatches", tags=["batches"], parameters=PAGE_PARAMS,
                   responses={200: _list_schema("BatchList", "Batch", BATCH_FIELDS)})
    def get(self, request: Request) -> Response:
        return Response(_page(Batch.objects.filter(tenant=request.user), request, actions.batch_objects))


files = on_a_pool(FileList, _upload_pool, "upload")
batch_list = on_a_pool(BatchList, _upload_pool, "upload")


class BatchDetail(TenantAPIView):
    """GET /v1/batches/{id}."""
    scopes = {"GET": Scope.READ}

    @extend_schema(operation_id="retrieveBatch", tags=["batches"], responses={200: BATCH_SCHEMA})
    def get(self, request: Request, batch_id: str) -> Response:
        return Response(actions.batch_object(_own_batch(request, batch_id)))


class BatchCancel(TenantAPIView):
    """POST /v1/batches/{id}/cancel: queued items stop at once, running ones are aborted."""
    scopes = {"POST": Scope.BATCH}

    @extend_schema(operation_id="cancelBatch", tags=["batches"], request=None, responses={200: BATCH_SCHEMA})
    def post(self, request: Request, batch_id: str) -> Response:
        batch = _own_batch(request, batch_id)
        if batch.status in (Batch.Status.COMPLETED, Batch.Status.FAILED, Batch.Status.EXPIRED):
            raise ApiError(409, f"Cannot cancel a batch that is {batch.status}.", code="batch_not_cancellable")
        return Response(actions.batch_object(actions.cancel(batch)))
