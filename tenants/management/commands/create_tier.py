"""`manage.py create_tier NAME --lane 0|1|2 --rpm N ...`: create or update a quota tier."""
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from tenants import actions


class Command(BaseCommand):
    help = "Create a quota tier, or update it if one with this name exists."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name")
        parser.add_argument("--lane", type=int, choices=[0, 1, 2], required=True, help="best lane: 0, 1 or 2")
        parser.add_argument("--rpm", type=int, required=True, help="requests per minute")
        parser.add_argument("--tpm", type=int, required=True, help="tokens per minute")
        parser.add_argument("--concurrency", type=int, required=True, help="concurrent streams")
        parser.add_argument("--max-tokens", type=int, required=True, help="max tokens per request")
        parser.add_argument("--monthly-tokens", type=int, required=True, help="monthly token budget")
        parser.add_argument("--batch", action="store_true", help="allow Batch API jobs")
        parser.add_argument(
            "--share-prefix-cache", action="store_true",
            help="let the tier's tenants reuse each other's cached prompt prefixes (saves prefill compute; "
            "a faster first token can reveal a co-tenant's prompt, so only for tenants that trust each other). "
            "Without it each tenant's cache is its own",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        for flag in ("rpm", "tpm", "max_tokens"):
            if options[flag] < 1:
                self.stderr.write(f"--{flag.replace('_', '-')} must be at least 1")
                raise SystemExit(2)
        for flag in ("concurrency", "monthly_tokens"):
            if options[flag] < 0:
                self.stderr.write(f"--{flag.replace('_', '-')} must not be negative")
                raise SystemExit(2)
        tier, created = actions.save_tier(
            options["name"],
            lane=options["lane"],
            requests_per_minute=options["rpm"],
            tokens_per_minute=options["tpm"],
            concurrent_streams=options["concurrency"],
            max_tokens_per_request=options["max_tokens"],
            monthly_token_budget=options["monthly_tokens"],
            allow_batch=options["batch"],
            share_prefix_cache=options["share_prefix_cache"],
        )
        self.stdout.write(f"{'Created' if created else 'Updated'} tier {tier}")
