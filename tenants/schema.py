"""How the OpenAPI schema (drf-spectacular) describes key authentication.

Registered from `TenantsConfig.ready()`, so every schema generation sees it, including
the one `manage.py check` runs.
"""
from drf_spectacular.extensions import OpenApiAuthenticationExtension


class ApiKeyScheme(OpenApiAuthenticationExtension):
    target_class = "tenants.authentication.ApiKeyAuthentication"
    name = "ApiKey"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "description": "A tenant API key: `sk-<prefix>_<secret>`."}
