"""Prefix-cache isolation becomes the default: `isolate_prefix_cache` (default False, so sharing)
gives way to `share_prefix_cache` (default False, so isolated), an opt-in.

Every existing tier becomes isolated, whatever it had: the seeded `standard` and `batch` tiers
shared their cache only because the old field defaulted to sharing, not because anyone chose
it, and that sharing let a tenant confirm another's prompt (issue 24, item 3). An operator who
wants a tier to share opts in again with `create_tier --share-prefix-cache` or the admin.

Rolling back keeps isolation: each tier gets `isolate_prefix_cache = not share_prefix_cache`,
not the old field's default, which would make every tier share again.
"""
from django.db import migrations, models


def restore_isolation(apps, schema_editor):
    QuotaTier = apps.get_model("tenants", "QuotaTier")
    QuotaTier.objects.filter(share_prefix_cache=False).update(isolate_prefix_cache=True)


class Migration(migrations.Migration):
    dependencies = [("tenants", "0002_seed_tiers")]

    operations = [
        # Its default is what every existing row gets: no tier keeps sharing.
        migrations.AddField(
            model_name="quotatier",
            name="share_prefix_cache",
            field=models.BooleanField(
                default=False,
                help_text="The tier's tenants reuse each other's cached prompt prefixes, which saves prefill "
                "compute. Only for tenants that trust each other: cached_tokens never reveals another "
                "tenant's prompt, but a faster first token can. Off: each tenant's cache is its own.",
            ),
        ),
        migrations.RunPython(migrations.RunPython.noop, restore_isolation),
        migrations.RemoveField(model_name="quotatier", name="isolate_prefix_cache"),
    ]
