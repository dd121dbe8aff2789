"""The batch models, moved here from the inference app: state only, no table changes.

`File`, `Batch` and `BatchItem` were created by inference 0001 and 0002, whose tables
(`inference_file`, `inference_batch`, `inference_batchitem`) they keep through
`Meta.db_table`. This migration adds them to this app's state exactly as they stood there
and touches no table; inference 0003 then removes them from inference's state. A fresh
database gets its tables from inference 0001 and 0002, an existing one keeps its rows.
"""
import batches.models
import django.db.models.deletion
import django.utils.timezone
from django.db import migrations, models


class Migration(migrations.Migration):

    initial = True

    dependencies = [
        # The tables exist once inference's own migrations have made them.
        ('inference', '0002_batch_item_runs'),
        ('tenants', '0002_seed_tiers'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[],
            state_operations=[
                migrations.CreateModel(
                    name='File',
                    fields=[
                        ('id', models.CharField(default=batches.models._file_id, editable=False, max_length=40, primary_key=True, serialize=False)),
                        ('purpose', models.CharField(choices=[('batch', 'Batch'), ('batch_output', 'Batch Output')], max_length=32)),
                        ('filename', models.CharField(max_length=255)),
                        ('content', models.BinaryField()),
                        ('bytes', models.PositiveBigIntegerField()),
                        ('created_at', models.DateTimeField(default=django.utils.timezone.now)),
                        ('tenant', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='files', to='tenants.tenant')),
                    ],
                    options={
                        'db_table': 'inference_file',
                        'ordering': ['-created_at', '-id'],
                    },
                ),
                migrations.CreateModel(
                    name='Batch',
                    fields=[
                        ('id', models.CharField(default=batches.models._batch_id, editable=False, max_length=40, primary_key=True, serialize=False)),
                        ('endpoint', models.CharField(max_length=64)),
                        ('input_file_id', models.CharField(max_length=40)),
                        ('completion_window', models.CharField(default='24h', max_length=16)),
                        ('status', models.CharField(choices=[('validating', 'Validating'), ('failed', 'Failed'), ('in_progress', 'In Progress'), ('finalizing', 'Finalizing'), ('completed', 'Completed'), ('expired', 'Expired'), ('cancelling', 'Cancelling'), ('cancelled', 'Cancelled')], db_index=True, default='validating', max_length=16)),
                        ('metadata', models.JSONField(blank=True, null=True)),
                        ('errors', models.JSONField(blank=True, null=True)),
                        ('idempotency_key', models.CharField(blank=True, max_length=255)),
                        ('stop_reason', models.CharField(blank=True, max_length=16)),
                        ('created_at', models.DateTimeField(default=django.utils.timezone.now)),
                        ('expires_at', models.DateTimeField()),
                        ('in_progress_at', models.DateTimeField(blank=True, null=True)),
                        ('finalizing_at', models.DateTimeField(blank=True, null=True)),
                        ('completed_at', models.DateTimeField(blank=True, null=True)),
                        ('failed_at', models.DateTimeField(blank=True, null=True)),
                        ('expired_at', models.DateTimeField(blank=True, null=True)),
                        ('cancelling_at', models.DateTimeField(blank=True, null=True)),
                        ('cancelled_at', models.DateTimeField(blank=True, null=True)),
                        ('tenant', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='batches', to='tenants.tenant')),
                        ('error_file', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='+', to='batches.file')),
                        ('output_file', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='+', to='batches.file')),
                    ],
                    options={
                        'verbose_name_plural': 'batches',
                        'db_table': 'inference_batch',
                        'ordering': ['-created_at', '-id'],
                        'constraints': [models.UniqueConstraint(condition=models.Q(('idempotency_key', ''), _negated=True), fields=('tenant', 'idempotency_key'), name='batch_idempotency_key_per_tenant')],
                    },
                ),
                migrations.CreateModel(
                    name='BatchItem',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('line', models.PositiveIntegerField()),
                        ('custom_id', models.CharField(max_length=512)),
                        ('url', models.CharField(max_length=64)),
                        ('body', models.JSONField()),
                        ('state', models.CharField(choices=[('queued', 'Queued'), ('running', 'Running'), ('succeeded', 'Succeeded'), ('failed', 'Failed'), ('cancelled', 'Cancelled'), ('expired', 'Expired')], default='queued', max_length=16)),
                        ('attempts', models.PositiveIntegerField(default=0)),
                        ('runs', models.PositiveIntegerField(default=0)),
                        ('not_before', models.DateTimeField(blank=True, null=True)),
                        ('dispatched_at', models.DateTimeField(blank=True, null=True)),
                        ('dispatch_epoch', models.CharField(blank=True, max_length=32)),
                        ('claim', models.CharField(blank=True, max_length=64)),
                        ('heartbeat_at', models.DateTimeField(blank=True, null=True)),
                        ('status_code', models.PositiveSmallIntegerField(blank=True, null=True)),
                        ('request_id', models.CharField(blank=True, max_length=64)),
                        ('response', models.JSONField(blank=True, null=True)),
                        ('error', models.JSONField(blank=True, null=True)),
                        ('finished_at', models.DateTimeField(blank=True, null=True)),
                        ('batch', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='items', to='batches.batch')),
                    ],
                    options={
                        'db_table': 'inference_batchitem',
                        'ordering': ['batch', 'line'],
                        'indexes': [models.Index(fields=['batch', 'state'], name='inference_b_batch_i_ed8c73_idx'), models.Index(fields=['state', 'dispatched_at'], name='inference_b_state_df6ea9_idx')],
                        'constraints': [models.UniqueConstraint(fields=('batch', 'custom_id'), name='batch_item_custom_id_unique')],
                    },
                ),
            ],
        ),
    ]
