"""`manage.py deactivate_tenant TENANT [--reactivate]`: refuse (or again admit) every key of a tenant."""
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from tenants import actions
from tenants.management import lookup


class Command(BaseCommand):
    help = "Deactivate a tenant (by name or id): its keys are refused, its open sockets closed; --reactivate undoes it."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("tenant", help="tenant name or id")
        parser.add_argument("--reactivate", action="store_true", help="make it active again")

    def handle(self, *args: Any, **options: Any) -> None:
        tenant = lookup.tenant(options["tenant"])
        actions.set_active(tenant, options["reactivate"], actor=lookup.actor())
        self.stdout.write(f"Tenant {tenant.name} is {'active' if tenant.is_active else 'inactive'}.")
