"""Usage rows written at admission and completed at the end, keyed for retried writes."""
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("tenants", "0003_share_prefix_cache")]
    operations = [
        migrations.AddField(
            model_name="usagerecord",
            name="key",
            field=models.CharField(blank=True, editable=False, max_length=128, null=True, unique=True),
        ),
        migrations.AddField(
            model_name="usagerecord",
            name="attempt",
            field=models.PositiveIntegerField(default=0, editable=False),
        ),
        migrations.AddField(
            model_name="usagerecord",
            name="closed",
            field=models.BooleanField(default=True, help_text="False while the request runs (or if its server died)."),
        ),
    ]
