"""Admin pages for batch jobs: progress per batch, items by state, a cancel action.

Rows are written by `batches.actions` only; these pages read them and cancel batches.
"""
from typing import Any

from django.contrib import admin, messages
from django.db.models import Count, Q, QuerySet
from django.http import HttpRequest
from django.utils.html import format_html

from batches import actions as batch_actions
from batches.models import Batch, BatchItem, File

State = BatchItem.State


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Batch)
class BatchAdmin(ReadOnlyAdmin):
    list_display = ["id", "tenant", "endpoint", "status", "progress", "failed_items", "created_at", "expires_at"]
    list_filter = ["status", "tenant"]
    search_fields = ["id", "tenant__name", "input_file_id"]
    date_hierarchy = "created_at"
    actions = ["cancel_batches"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Batch]:
        final = Q(items__state__in=BatchItem.FINAL)
        return super().get_queryset(request).select_related("tenant").annotate(
            total_items=Count("items"), done_items=Count("items", filter=final),
            failed_count=Count("items", filter=Q(items__state=State.FAILED)),
        )

    @admin.display(description="progress")
    def progress(self, batch: Batch) -> str:
        total = batch.total_items or 1
        percent = round(100 * batch.done_items / total)
        return format_html('<progress max="100" value="{}"></progress> {} / {}', percent, batch.done_items,
                           batch.total_items)

    @admin.display(description="failed", ordering="failed_count")
    def failed_items(self, batch: Batch) -> int:
        return batch.failed_count

    @admin.action(description="Cancel selected batches")
    def cancel_batches(self, request: HttpRequest, queryset: QuerySet[Batch]) -> None:
        cancelled = 0
        for batch in queryset:
            if batch.status in (Batch.Status.VALIDATING, Batch.Status.IN_PROGRESS):
                batch_actions.cancel(batch)
                cancelled += 1
        self.message_user(request, f"Cancelling {cancelled} batch(es); running items are being aborted.", messages.SUCCESS)


@admin.register(BatchItem)
class BatchItemAdmin(ReadOnlyAdmin):
    list_display = ["batch", "line", "custom_id", "state", "attempts", "status_code", "finished_at"]
    list_filter = ["state"]
    search_fields = ["batch__id", "custom_id"]
    list_select_related = ["batch"]


@admin.register(File)
class FileAdmin(ReadOnlyAdmin):
    list_display = ["id", "tenant", "purpose", "filename", "bytes", "created_at"]
    list_filter = ["purpose", "tenant"]
    search_fields = ["id", "filename", "tenant__name"]
    exclude = ["content"]
