from django.apps import AppConfig


class InferenceConfig(AppConfig):
    name = "inference"
    verbose_name = "Inference"

    def ready(self) -> None:
        from inference import checks  # noqa: F401  (registers the system checks)
