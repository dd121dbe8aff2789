"""URL map: the OpenAI-shaped API under /v1/, operator endpoints, probes, schema, admin.

The generation endpoints (/v1/chat/completions, /v1/completions, /api/v1/inference/chat)
and the WebSocket are Channels consumers, routed before Django in `config.asgi`.
"""
import re

from django.conf import settings
from django.contrib import admin
from django.urls import include, path, re_path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from config import static_files
from inference import health, operator_views, views
from tenants import urls as tenant_urls, views as tenant_views

SCHEMA_HOOKS = ["drf_spectacular.hooks.postprocess_schema_enums", "inference.openapi.close_request_bodies",
                "inference.openapi.document_errors"]

urlpatterns = [
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("metrics", operator_views.metrics, name="metrics"),
    path("v1/", include("inference.urls")),
    # vLLM's utility endpoints, at its paths (the tenant's key, requests/min).
    path("tokenize", views.tokenize, name="tokenize"),
    path("detokenize", views.detokenize, name="detokenize"),
    path("v1/", include("batches.urls")),
    path("v1/usage", tenant_views.Usage.as_view(), name="usage"),
    path("v1/organization/usage/completions", tenant_views.OrganizationUsage.as_view()),
    path("version", views.Version.as_view(), name="version"),
    path("api/v1/admin/", include((tenant_urls.admin_urlpatterns, "admin-api"))),
    path("api/v1/engine/stats", operator_views.engine_stats, name="engine-stats"),
    path("api/v1/engine/fleet", operator_views.engine_fleet, name="engine-fleet"),
    # The schema covers the consumer endpoints too (see inference.openapi); open to all, as docs are.
    path("api/schema/", SpectacularAPIView.as_view(urlconf="inference.openapi", authentication_classes=[],
                                                   permission_classes=[], throttle_classes=[],
                                                   custom_settings={"POSTPROCESSING_HOOKS": SCHEMA_HOOKS}), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema", authentication_classes=[],
                                                     permission_classes=[], throttle_classes=[]), name="swagger-ui"),
    path("admin/", admin.site.urls),
    path("console/", include("console.urls")),
]

# Static files: from the apps' folders in DEBUG, else what `collectstatic` gathered. The view
# reads DEBUG per request: a URL map fixed at import would depend on when it was imported.
urlpatterns.append(re_path(rf"^{re.escape(settings.STATIC_URL.lstrip('/'))}(?P<path>.+)$", static_files.serve))
# Last: a client of the API gets JSON for a path that does not exist, as from any other error.
urlpatterns.append(re_path(r"^(?:v1|api|internal)(?:/|$)", views.unknown_path))
