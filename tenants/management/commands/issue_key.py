"""`manage.py issue_key TENANT`: a new API key for a tenant, printed as the last line."""
from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from tenants import actions
from tenants.management import lookup


class Command(BaseCommand):
    help = "Issue a new API key for a tenant (by name or id), printed as the last line."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("tenant", help="tenant name or id")
        parser.add_argument("--name", default="", help="a label for the key")
        parser.add_argument("--expires-in-days", type=int, default=None, help="default: never expires")
        parser.add_argument("--scopes", default="", help="comma-separated: inference, batch, read; default all")
        parser.add_argument("--rpm", type=int, default=None, help="the key's own requests/min; default its tenant's")
        parser.add_argument("--tpm", type=int, default=None, help="the key's own tokens/min; default its tenant's")
        parser.add_argument("--monthly-budget", type=int, default=None, help="the key's own monthly tokens")

    def handle(self, *args: Any, **options: Any) -> None:
        tenant = lookup.tenant(options["tenant"])
        days = options["expires_in_days"]
        expires = timezone.now() + timedelta(days=days) if days is not None else None
        scopes = [part.strip() for part in options["scopes"].split(",") if part.strip()]
        try:
            issued = actions.issue_key(tenant, name=options["name"], expires=expires, scopes=scopes,
                                       requests_per_minute=options["rpm"], tokens_per_minute=options["tpm"],
                                       monthly_token_budget=options["monthly_budget"], actor=lookup.actor())
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"Issued key {issued.api_key.prefix} for tenant {tenant.name}; it is shown only once:")
        self.stdout.write(issued.plaintext)
