"""Celery tasks of the inference app."""
from celery import shared_task


@shared_task(name="inference.ping")
def ping() -> str:
    """Proves a worker is consuming the queue (used by tests and operators' tools)."""
    return "pong"
