"""The Files and Batch APIs under /v1/ (`config.urls` mounts them beside the inference app's)."""
from django.urls import path

from batches import views

app_name = "batches"

urlpatterns = [
    path("files", views.files, name="files"),
    path("files/<str:file_id>", views.FileDetail.as_view(), name="file"),
    path("files/<str:file_id>/content", views.FileContent.as_view(), name="file-content"),
    path("batches", views.batch_list, name="batches"),
    path("batches/<str:batch_id>", views.BatchDetail.as_view(), name="batch"),
    path("batches/<str:batch_id>/cancel", views.BatchCancel.as_view(), name="batch-cancel"),
]
