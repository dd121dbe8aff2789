from django.urls import path

from tenants import staff_api

app_name = "tenants"

# Mounted at /api/v1/admin/ (config/urls.py).
admin_urlpatterns = [
    path("tenants", staff_api.TenantList.as_view(), name="admin-tenants"),
    path("tenants/<int:pk>", staff_api.TenantDetail.as_view(), name="admin-tenant"),
    path("tenants/<int:pk>/keys", staff_api.TenantKeys.as_view(), name="admin-tenant-keys"),
    path("keys/<int:pk>/revoke", staff_api.KeyRevoke.as_view(), name="admin-key-revoke"),
    path("keys/<int:pk>/rotate", staff_api.KeyRotate.as_view(), name="admin-key-rotate"),
    path("tiers", staff_api.TierList.as_view(), name="admin-tiers"),
    path("tiers/<slug:name>", staff_api.TierDetail.as_view(), name="admin-tier"),
    path("usage", staff_api.AdminUsage.as_view(), name="admin-usage"),
    path("audit", staff_api.AuditLog.as_view(), name="admin-audit"),
]
