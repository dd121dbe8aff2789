"""Batch jobs: the OpenAI Files and Batch APIs, their models, and the Celery side that runs
batch items against the engine's internal endpoints."""
from django.apps import AppConfig


class BatchesConfig(AppConfig):
    name = "batches"
    verbose_name = "Batch jobs"
