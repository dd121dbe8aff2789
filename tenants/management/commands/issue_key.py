"""`manage.py issue_key TENANT`: a new API key for a tenant, printed as the last line."""
from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from tenants import actions
from tenants.models import Tenant


class Command(BaseCommand):
    help = "Issue a new API key for a tenant (by name or id), printed as the last line."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("tenant", help="tenant name or id")
        parser.add_argument("--name", default="", help="a label for the key")
        parser.add_argument("--expires-in-days", type=int, default=None, help="default: never expires")

    def handle(self, *args: Any, **options: Any) -> None:
        ref = options["tenant"]
        tenant = Tenant.objects.filter(name=ref).first()
        if tenant is None and ref.isdigit():
            tenant = Tenant.objects.filter(pk=int(ref)).first()
        if tenant is None:
            raise CommandError(f"No tenant named {ref!r}.")
        days = options["expires_in_days"]
        expires = timezone.now() + timedelta(days=days) if days is not None else None
        issued = actions.issue_key(tenant, name=options["name"], expires=expires)
        self.stdout.write(f"Issued key {issued.api_key.prefix} for tenant {tenant.name}; it is shown only once:")
        self.stdout.write(issued.plaintext)
