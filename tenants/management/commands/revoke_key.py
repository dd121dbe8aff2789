"""`manage.py revoke_key PREFIX`: refuse a key from now on (open WebSockets close at their next re-check)."""
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from tenants import actions
from tenants.management import lookup


class Command(BaseCommand):
    help = "Revoke an API key by its prefix (sk-ab12cd34ef56, or the whole key)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("key", help="the key's prefix, with or without sk-")

    def handle(self, *args: Any, **options: Any) -> None:
        api_key = lookup.api_key(options["key"])
        already = api_key.revoked is not None
        actions.revoke_key(api_key, actor=lookup.actor())
        state = "was already revoked" if already else "is revoked"
        self.stdout.write(f"Key sk-{api_key.prefix} of tenant {api_key.tenant.name} {state} ({api_key.revoked:%Y-%m-%d %H:%M:%S} UTC).")
