"""`manage.py list_tenants [--search TEXT] [--json]`: tenants, their tiers, keys and this month's tokens."""
import json
from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db.models import Count, F, OuterRef, Subquery, Sum
from django.utils import timezone

from tenants.models import ApiKey, Tenant, UsageRecord


class Command(BaseCommand):
    help = "List tenants with their tier, state, live keys and this month's tokens (from the usage records)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--search", default="", help="part of the name")
        parser.add_argument("--json", action="store_true", help="one JSON object per line")

    def handle(self, *args: Any, **options: Any) -> None:
        now = timezone.now()
        month = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        # Subqueries, not joins: keys x usage rows would multiply the sum by the number of keys.
        month_tokens = (UsageRecord.objects.filter(tenant=OuterRef("pk"), created__gte=month).values("tenant")
                        .annotate(total=Sum(F("prompt_tokens") + F("completion_tokens"))).values("total"))
        live_keys = (ApiKey.objects.filter(tenant=OuterRef("pk"), revoked__isnull=True).values("tenant")
                     .annotate(n=Count("pk")).values("n"))
        tenants = (Tenant.objects.select_related("tier").filter(name__icontains=options["search"]).order_by("name")
                   .annotate(live_keys=Subquery(live_keys), month_tokens=Subquery(month_tokens)))
        rows = [{"id": t.pk, "name": t.name, "tier": t.tier.name, "lane": t.tier.lane, "active": t.is_active,
                 "live_keys": t.live_keys or 0, "month_tokens": t.month_tokens or 0} for t in tenants]
        if options["json"]:
            for row in rows:
                self.stdout.write(json.dumps(row))
            return
        self.stdout.write(f"{'id':>5}  {'name':<32} {'tier':<20} lane  active  keys  {'tokens this month':>18}")
        for row in rows:
            self.stdout.write(f"{row['id']:>5}  {row['name'][:32]:<32} {row['tier'][:20]:<20} P{row['lane']}    "
                              f"{'yes' if row['active'] else 'no':<6}  {row['live_keys']:>4}  {row['month_tokens']:>18,}")
