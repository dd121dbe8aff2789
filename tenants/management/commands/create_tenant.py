"""`manage.py create_tenant NAME --tier TIER`: a tenant and its first key (the last line)."""
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from tenants import actions
from tenants.models import QuotaTier, Tenant


class Command(BaseCommand):
    help = "Create a tenant on a tier and issue its first API key, printed as the last line."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name")
        parser.add_argument("--tier", default="standard", help="quota tier name (default: standard)")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            tier = QuotaTier.objects.get(name=options["tier"])
        except QuotaTier.DoesNotExist:
            names = ", ".join(QuotaTier.objects.values_list("name", flat=True))
            raise CommandError(f"No tier {options['tier']!r}. Tiers: {names}") from None
        if Tenant.objects.filter(name=options["name"]).exists():
            raise CommandError(f"A tenant named {options['name']!r} already exists; use issue_key for a new key.")
        tenant = actions.create_tenant(options["name"], tier)
        issued = actions.issue_key(tenant, name="default")
        self.stdout.write(f"Created tenant {tenant.name} (id {tenant.pk}) on tier {tier}.")
        self.stdout.write("Its API key follows; it is shown only once:")
        self.stdout.write(issued.plaintext)
