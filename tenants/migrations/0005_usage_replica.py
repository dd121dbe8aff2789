"""Which web process serves an open usage row, so that a row left open by one that died is
completed by another (inference.sweep)."""
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("tenants", "0004_usage_ledger")]
    operations = [
        migrations.AddField(
            model_name="usagerecord",
            name="replica",
            field=models.CharField(blank=True, editable=False, max_length=100),
        ),
        migrations.AddIndex(
            model_name="usagerecord",
            index=models.Index(condition=models.Q(closed=False), fields=["replica"], name="usage_open_by_replica"),
        ),
    ]
