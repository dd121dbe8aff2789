"""PostgreSQL stores File.content out of line without compressing it, so that a download reads
a slice's pages only (batches.views._slice): substring() of a compressed value decompresses it
from its start for every slice, quadratic in the file's size. Files stored before keep their
compression until rewritten; SQLite has nothing to change."""
from django.db import migrations


def uncompressed(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("ALTER TABLE inference_file ALTER COLUMN content SET STORAGE EXTERNAL")


def compressed(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("ALTER TABLE inference_file ALTER COLUMN content SET STORAGE EXTENDED")


class Migration(migrations.Migration):

    dependencies = [
        ("batches", "0004_batch_api_key"),
    ]

    operations = [
        migrations.RunPython(uncompressed, compressed),
    ]
