"""The Celery app. Its settings live in Django settings under the `CELERY_` prefix."""
import os
from queue import Empty

from celery import Celery
from kombu.transport import redis as kombu_redis
from redis.exceptions import ConnectionError as RedisConnectionError

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")


def _harden_kombu_redis_channel() -> None:
    """Keep a broker restart from killing the worker (issue 24, item 12; kombu 5.7.0).

    Measured (tests/reliability/test_broker_restart.py, 20 of 20 runs without this): when
    Redis goes away and the worker notices it first on its pidbox (remote-control)
    connection, its task channel still waits for a BRPOP reply. Celery's reconnect calls
    `Connection.collect()`, whose close of the task channel drains that reply; kombu only
    expects `Empty` there, the dead socket raises a connection error, and the channel stays
    half-closed, unacknowledged messages and all. The pidbox channel's close fails too, and
    collect() detaches the transport (`transport.client = None`). Celery's
    `connection.close()` then closes the task channel again: restoring its messages needs a
    new pool, `Channel._connparams` reads `self.connection.client.hostname`, and the
    AttributeError (no connection error, so nothing catches it) ends the worker:
    "Unrecoverable error: AttributeError('NoneType' object has no attribute 'hostname')".
    kombu #970 and #582 are the same family: a channel used after its connection closed.

    Two changes, each enough for that path on its own:
    - close() treats a connection error while draining the BRPOP reply like `Empty`: a dead
      socket has no reply to drain. The close then runs to the end at once, while the
      transport is still attached: the restore either reaches Redis or fails with a
      connection error that collect() ignores.
    - `_connparams` raises a connection error, not an AttributeError, for a channel whose
      transport was detached, so any path that still reaches such a channel (the second
      close above, were the first one to stop early again) gets an error its callers
      already ignore.
    Neither loses anything the worker could keep: messages it cannot restore are in a Redis
    that is gone or keeps them in its unacked set (redelivered after the visibility
    timeout). The database stays the source of truth: the batch sweep sends again what no
    worker holds, and a duplicate delivery finds its item taken and does nothing.
    """
    channel = kombu_redis.Channel
    if getattr(channel, "_platform_hardened", False):
        return
    close, connparams = channel.close, channel._connparams
    connection_errors = kombu_redis.Transport.connection_errors

    def close_after_draining_brpop(self):
        if self._in_poll:
            try:
                self._brpop_read()  # clears _in_poll, so kombu's close skips its own drain
            except (Empty, *connection_errors):
                pass
        close(self)

    def connparams_of_attached_transport(self, asynchronous=False):
        transport = self.connection
        if transport is None or transport.client is None:
            raise RedisConnectionError("the broker connection of this channel was closed")
        return connparams(self, asynchronous=asynchronous)

    channel.close = close_after_draining_brpop
    channel._connparams = connparams_of_attached_transport
    channel._platform_hardened = True


_harden_kombu_redis_channel()

app = Celery("config")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
