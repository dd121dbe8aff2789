"""The batch models' move from the inference app to the batches app, run on a database that
has batches in it: every row written before the move is read back after it through the
batches app's models, with its values and relations, and the grants on the old models'
permissions hold on the new ones.

Run the way Django's own migration tests run them: a MigrationExecutor moves the schema to a
state, and the historical models of that state write and read the rows. The move is state
only, so a migration that dropped and recreated a table would lose the rows and fail here.
"""
from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.contrib.auth.models import Group
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone

from batches.models import Batch, BatchItem, File
from tenants.models import QuotaTier, Tenant

pytestmark = pytest.mark.django_db(transaction=True)

LAST_BEFORE_THE_MOVE = ("inference", "0002_batch_item_runs")
MOVE = [("batches", "0001_initial"), ("batches", "0002_content_types_from_inference"),
        ("inference", "0003_batch_models_moved_to_batches")]
BODY = {"model": "m", "messages": [{"role": "user", "content": "Say 0."}], "max_tokens": 4}
# A tier of the test's own: the seeded ones are gone once an earlier test flushed the database.
TIER = {"name": "batch-move", "lane": 2, "requests_per_minute": 10, "tokens_per_minute": 1000, "concurrent_streams": 1,
        "max_tokens_per_request": 100, "monthly_token_budget": 10_000, "allow_batch": True}
RESPONSE = {"object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": "0"}}]}


def _before_the_move(executor: MigrationExecutor) -> list[tuple[str, str]]:
    """Every app at its latest except the move: inference at 0002, batches not there yet."""
    leaves = executor.loader.graph.leaf_nodes()
    return [LAST_BEFORE_THE_MOVE, *(node for node in leaves if node[0] not in ("inference", "batches"))]


@pytest.fixture
def before_the_move() -> Iterator:
    """The schema as it was before the move; its models. The latest schema afterwards."""
    executor = MigrationExecutor(connection)
    before = _before_the_move(executor)
    # inference 0002 alone would leave batches applied: it depends on inference, not the reverse.
    executor.migrate([LAST_BEFORE_THE_MOVE, ("batches", None)])
    yield executor.loader.project_state(before).apps
    _migrate_to_latest()


def _migrate_to_latest() -> list[tuple[str, str]]:
    """Apply what is left; the (app, name) of each migration applied."""
    executor = MigrationExecutor(connection)
    leaves = executor.loader.graph.leaf_nodes()
    plan = executor.migration_plan(leaves)
    executor.migrate(leaves)
    return [(migration.app_label, migration.name) for migration, _backwards in plan]


def test_rows_written_before_the_move_are_read_back_through_the_batches_app(before_the_move):
    old = before_the_move
    with pytest.raises(LookupError):
        old.get_model("batches", "Batch")
    tier = old.get_model("tenants", "QuotaTier").objects.create(**TIER)
    tenant = old.get_model("tenants", "Tenant").objects.create(name="acme", tier=tier)
    OldFile, OldBatch = old.get_model("inference", "File"), old.get_model("inference", "Batch")
    created = timezone.now() - timedelta(hours=1)
    upload = OldFile.objects.create(tenant=tenant, purpose="batch", filename="in.jsonl", content=b'{"line": 1}\n',
                                    bytes=12, created_at=created)
    output = OldFile.objects.create(tenant=tenant, purpose="batch_output", filename="out.jsonl", content=b"out\n",
                                    bytes=4)
    batch = OldBatch.objects.create(tenant=tenant, endpoint="/v1/chat/completions", input_file_id=upload.id,
                                    status="in_progress", metadata={"job": "nightly"}, output_file=output,
                                    idempotency_key="key-1", created_at=created, expires_at=created + timedelta(hours=24))
    item = old.get_model("inference", "BatchItem").objects.create(
        batch=batch, line=1, custom_id="req-1", url="/v1/chat/completions", body=BODY, state="succeeded",
        attempts=2, runs=3, status_code=200, request_id="batchreq-1", response=RESPONSE)
    # A staff group that may see batches (the console's and the admin's check).
    content_type, _ = old.get_model("contenttypes", "ContentType").objects.get_or_create(app_label="inference",
                                                                                        model="batch")
    permission, _ = old.get_model("auth", "Permission").objects.get_or_create(
        content_type=content_type, codename="view_batch", defaults={"name": "Can view batch"})
    old.get_model("auth", "Group").objects.create(name="batch-viewers").permissions.add(permission)

    applied = _migrate_to_latest()
    assert [step for step in applied if step in MOVE] == MOVE
    assert all(app == "batches" for app, _ in set(applied) - set(MOVE))  # the batches app's later ones

    moved = File.objects.get(pk=upload.id)
    assert (moved.tenant.name, moved.purpose, moved.filename, bytes(moved.content), moved.bytes, moved.created_at) == (
        "acme", "batch", "in.jsonl", b'{"line": 1}\n', 12, created)
    assert sorted(File.objects.values_list("id", flat=True)) == sorted([upload.id, output.id])
    moved_batch = Batch.objects.get(pk=batch.id)
    assert moved_batch.tenant_id == tenant.pk and moved_batch.input_file_id == upload.id
    assert (moved_batch.status, moved_batch.metadata, moved_batch.idempotency_key) == ("in_progress", {"job": "nightly"},
                                                                                      "key-1")
    assert moved_batch.output_file == File.objects.get(pk=output.id) and moved_batch.error_file is None
    assert moved_batch.expires_at == created + timedelta(hours=24)
    moved_item = moved_batch.items.get()
    assert moved_item.pk == item.pk
    assert (moved_item.custom_id, moved_item.body, moved_item.state, moved_item.attempts, moved_item.runs,
            moved_item.status_code, moved_item.response) == ("req-1", BODY, "succeeded", 2, 3, 200, RESPONSE)
    # The grant follows the model: the group may now view `batches.batch`.
    assert list(Group.objects.get(name="batch-viewers").permissions.values_list(
        "content_type__app_label", "content_type__model", "codename")) == [("batches", "batch", "view_batch")]


def test_rolling_the_move_back_keeps_the_rows_in_the_inference_app(before_the_move):
    _migrate_to_latest()
    tenant = Tenant.objects.create(name="globex", tier=QuotaTier.objects.create(**TIER))
    upload = File.objects.create(tenant=tenant, purpose="batch", filename="in.jsonl", content=b"x\n", bytes=2)
    batch = Batch.objects.create(tenant=tenant, endpoint="/v1/completions", input_file_id=upload.id,
                                 expires_at=timezone.now())
    item = BatchItem.objects.create(batch=batch, line=1, custom_id="c", url="/v1/completions", body={"prompt": "p"})

    executor = MigrationExecutor(connection)
    old_state = _before_the_move(executor)
    executor.migrate([LAST_BEFORE_THE_MOVE, ("batches", None)])
    old = executor.loader.project_state(old_state).apps
    old_item = old.get_model("inference", "BatchItem").objects.select_related("batch").get(pk=item.pk)
    assert (old_item.batch_id, old_item.body, old_item.batch.input_file_id) == (batch.id, {"prompt": "p"}, upload.id)
    assert old.get_model("inference", "File").objects.get(pk=upload.id).filename == "in.jsonl"
