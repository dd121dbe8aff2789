"""The Celery tasks (run a batch item, sweep on demand, ping), and the worker's own batch sweep.

Delivery guarantees come from settings (acks_late, reject_on_worker_lost, prefetch 1) and
from the database: a task only carries an item id, and `batches.actions` decides
whether that item runs. A lost message is sent again by the sweep; a duplicate one finds
its item already taken and does nothing.
"""
import threading

from celery import shared_task
from celery.signals import worker_ready, worker_shutting_down

from batches import actions, worker

_sweep_stop = threading.Event()


# Task names keep the `inference.` prefix these tasks had before batch jobs became their own
# app: messages already queued in Redis carry them, and a worker runs a message by its name.
@shared_task(name="inference.ping", ignore_result=False)  # its caller waits for the answer
def ping() -> str:
    """Proves a worker is consuming the queue (used by tests and operators' tools)."""
    return "pong"


@shared_task(name=actions.RUN_TASK)
def run_batch_item(item_id: int) -> str:
    return worker.run_item(item_id)


@shared_task(name="inference.sweep_batches")
def sweep_batches() -> dict:
    """One sweep on demand (every worker also sweeps on its own schedule)."""
    return actions.sweep()


@worker_ready.connect
def _start_sweeping(**kwargs) -> None:
    worker.start_sweeper(_sweep_stop)


@worker_shutting_down.connect
def _hand_items_back(**kwargs) -> None:
    worker.shutting_down.set()
    _sweep_stop.set()
