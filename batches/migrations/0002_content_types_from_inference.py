"""The batch models' content types follow them from the inference app to this one.

Permissions (`view_batch`, `change_batch`, ... : the admin's and the console's checks) and
the admin's log entries point at a content type. Renaming the inference app's rows keeps
every grant: a staff account or group that could see batches still can, now as
`batches.view_batch`. Creating new rows instead (what `migrate` would do by itself) would
leave those grants on rows no model uses. A fresh database has no such rows yet: nothing
to rename. A model whose row in this app already exists keeps both (never deletes grants).
"""
from django.db import migrations

MODELS = ("file", "batch", "batchitem")


def _rename(apps, old_label: str, new_label: str) -> None:
    content_type = apps.get_model("contenttypes", "ContentType")
    taken = set(content_type.objects.filter(app_label=new_label, model__in=MODELS).values_list("model", flat=True))
    content_type.objects.filter(app_label=old_label, model__in=set(MODELS) - taken).update(app_label=new_label)


def forwards(apps, schema_editor) -> None:
    _rename(apps, "inference", "batches")


def backwards(apps, schema_editor) -> None:
    _rename(apps, "batches", "inference")


class Migration(migrations.Migration):

    dependencies = [
        ('batches', '0001_initial'),
        ('contenttypes', '0002_remove_content_type_name'),
    ]

    operations = [
        migrations.RunPython(forwards, backwards),
    ]
