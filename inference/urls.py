from django.urls import path

from inference import views

app_name = "inference"

urlpatterns = [
    path("models", views.ModelList.as_view(), name="models"),
    path("models/<path:model>", views.ModelDetail.as_view(), name="model"),
]
