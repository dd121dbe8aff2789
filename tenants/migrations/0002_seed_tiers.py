"""Seed the three tiers the lanes are named after. Operators tune them with create_tier."""
from django.db import migrations

TIERS = [
    # name, lane, rpm, tpm, streams, max tokens/request, monthly tokens, batch, isolated cache
    ("realtime", 0, 600, 400_000, 32, 4096, 200_000_000, False, True),
    ("standard", 1, 120, 100_000, 8, 2048, 20_000_000, True, False),
    ("batch", 2, 60, 200_000, 2, 2048, 500_000_000, True, False),
]


def seed(apps, schema_editor):
    QuotaTier = apps.get_model("tenants", "QuotaTier")
    for name, lane, rpm, tpm, streams, max_tokens, monthly, batch, isolate in TIERS:
        QuotaTier.objects.get_or_create(
            name=name,
            defaults={
                "lane": lane,
                "requests_per_minute": rpm,
                "tokens_per_minute": tpm,
                "concurrent_streams": streams,
                "max_tokens_per_request": max_tokens,
                "monthly_token_budget": monthly,
                "allow_batch": batch,
                "isolate_prefix_cache": isolate,
            },
        )


def unseed(apps, schema_editor):
    QuotaTier = apps.get_model("tenants", "QuotaTier")
    QuotaTier.objects.filter(name__in=[t[0] for t in TIERS], tenants__isnull=True).delete()


class Migration(migrations.Migration):
    dependencies = [("tenants", "0001_initial")]
    operations = [migrations.RunPython(seed, unseed)]
