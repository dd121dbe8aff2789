"""The operators' console under /console/: staff only (see console.views)."""
from django.urls import path
from django.views.generic import RedirectView

from console import views

app_name = "console"

urlpatterns = [
    path("", RedirectView.as_view(pattern_name="console:engine"), name="index"),
    path("engine/", views.engine, name="engine"),
    path("tenants/", views.tenants, name="tenants"),
    path("tenants/<int:pk>/", views.tenant_detail, name="tenant"),
    path("tenants/<int:pk>/keys/", views.issue_key, name="issue-key"),
    path("tenants/<int:pk>/keys/<int:key_pk>/revoke/", views.revoke_key, name="revoke-key"),
    path("tenants/<int:pk>/tier/", views.change_tier, name="change-tier"),
    path("tenants/<int:pk>/active/", views.switch_tenant, {"switch": "active"}, name="set-active"),
    path("tenants/<int:pk>/debug-capture/", views.switch_tenant, {"switch": "debug-capture"}, name="debug-capture"),
    path("batches/", views.batches, name="batches"),
    path("batches/<str:batch_id>/", views.batch_detail, name="batch"),
    path("batches/<str:batch_id>/files/<str:kind>/", views.batch_file, name="batch-file"),
    path("batches/<str:batch_id>/cancel/", views.cancel_batch, name="cancel-batch"),
    path("workers/", views.workers, name="workers"),
    path("requests/", views.requests_tail, name="requests"),
    path("playground/", views.playground, name="playground"),
    path("audit/", views.audit, name="audit"),
]
