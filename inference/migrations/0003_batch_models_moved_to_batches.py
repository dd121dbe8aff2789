"""The batch models leave this app's state for the batches app's: no table changes.

batches 0001 holds them now, on the same tables; removing them here only ends this app's
claim to them (`database_operations` is empty, so no table is dropped). No other app's
foreign key points at them, so none has to be moved over first.
"""
from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ('inference', '0002_batch_item_runs'),
        ('batches', '0001_initial'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[],
            # Referencing models first: a model left in the state must not point at a deleted one.
            state_operations=[
                migrations.DeleteModel(name='BatchItem'),
                migrations.DeleteModel(name='Batch'),
                migrations.DeleteModel(name='File'),
            ],
        ),
    ]
