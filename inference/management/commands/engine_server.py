"""`manage.py engine_server`: the engine for every web process of this host that connects to
INFERENCE_ENGINE_SOCKET (inference.engine.process.SharedEngine): one model in memory and one
batch, however many web processes serve the API. Web processes started with the same setting
connect to it (and again after it restarts); a web process whose INFERENCE settings differ
from this one's is refused, naming them.

SIGTERM or SIGINT: it stops taking web processes, waits for the connected ones to leave
(they drain first, DRAIN_TIMEOUT_S) and stops.
"""
import logging
import os
import signal
import sys

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from inference.host import engine_config


class Command(BaseCommand):
    help = "Serve one engine to the web processes that connect to INFERENCE_ENGINE_SOCKET."

    def add_arguments(self, parser):
        parser.add_argument("--socket", default="", help="the Unix socket's path (default: INFERENCE_ENGINE_SOCKET)")

    def handle(self, *args, **options):
        path = options["socket"] or settings.INFERENCE["ENGINE_SOCKET"]
        if not path:
            raise CommandError("no socket: set INFERENCE_ENGINE_SOCKET (or pass --socket)")
        from inference.engine.process import SharedEngine

        # Its web processes drain first; it waits for them a little longer than they take.
        server = SharedEngine(engine_config(), path, drain_timeout_s=settings.DRAIN_TIMEOUT_S + 5)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: server.stop())
        code = server.serve()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # not the interpreter's teardown: Triton's bindings report their objects as leaked there
