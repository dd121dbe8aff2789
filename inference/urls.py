from django.urls import path

from inference import batch_views, views

app_name = "inference"

urlpatterns = [
    path("models", views.ModelList.as_view(), name="models"),
    path("files", batch_views.files, name="files"),
    path("files/<str:file_id>", batch_views.FileDetail.as_view(), name="file"),
    path("files/<str:file_id>/content", batch_views.FileContent.as_view(), name="file-content"),
    path("batches", batch_views.batch_list, name="batches"),
    path("batches/<str:batch_id>", batch_views.BatchDetail.as_view(), name="batch"),
    path("batches/<str:batch_id>/cancel", batch_views.BatchCancel.as_view(), name="batch-cancel"),
]
