"""URL map: the OpenAI-shaped API under /v1/, probes, and the admin console."""
from django.conf import settings
from django.contrib import admin
from django.contrib.staticfiles.urls import staticfiles_urlpatterns
from django.urls import include, path

from inference import health

urlpatterns = [
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("v1/", include("inference.urls")),
    path("admin/", admin.site.urls),
]

if settings.DEBUG:
    # daphne serves no static files; in development Django serves the admin's own.
    # Production runs `collectstatic` and lets the front web server or CDN serve them.
    urlpatterns += staticfiles_urlpatterns()
