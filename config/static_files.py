"""Static files with DEBUG off: what `collectstatic` put in STATIC_ROOT, served by daphne.

Django serves static files only in DEBUG (from the apps' folders). With DEBUG off the
console and the admin would lose their CSS and JavaScript unless a proxy serves
STATIC_ROOT; this view does it in any deployment, nginx in front or not. It is an async
view that reads the file off the event loop and answers with a plain response: Django's own
`serve` (and WhiteNoise) answer with a sync file iterator, which Django under ASGI streams
from a thread with a warning per file. Names `ManifestStaticFilesStorage` hashed are cached
for a year; the few it did not hash, for a minute.
"""
from __future__ import annotations

import asyncio
import mimetypes
import re
from pathlib import Path

from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib.staticfiles.views import serve as finders_serve
from django.core.exceptions import SuspiciousFileOperation
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseNotAllowed
from django.utils._os import safe_join

HASHED = re.compile(r"\.[0-9a-f]{12}\.[A-Za-z0-9]+$")  # ManifestStaticFilesStorage: name.<md5[:12]>.ext
YEAR_S = 365 * 24 * 3600


async def serve(request: HttpRequest, path: str) -> HttpResponse:
    if request.method not in ("GET", "HEAD"):
        return HttpResponseNotAllowed(["GET", "HEAD"])
    if settings.DEBUG:  # development: the apps' own folders, as Django's runserver does
        return await sync_to_async(finders_serve)(request, path)
    try:
        full = Path(safe_join(settings.STATIC_ROOT, path))
    except SuspiciousFileOperation:
        raise Http404(path) from None
    if not await asyncio.to_thread(full.is_file):
        raise Http404(path)
    body = b"" if request.method == "HEAD" else await asyncio.to_thread(full.read_bytes)
    content_type, _ = mimetypes.guess_type(full.name)
    response = HttpResponse(body, content_type=content_type or "application/octet-stream")
    response["Content-Length"] = str(full.stat().st_size)
    immutable = HASHED.search(full.name) is not None
    response["Cache-Control"] = f"public, max-age={YEAR_S}, immutable" if immutable else "public, max-age=60"
    return response
