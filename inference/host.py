"""The engine this web process hosts: built once when the ASGI application starts serving.

Nothing here runs at import, so `manage.py migrate` (or any test that imports the app)
never loads a model. `config.asgi` wraps the application in `EngineLifespan`, which
starts loading on the server's lifespan startup or, under daphne (which sends no
lifespan events), on the first connection of any kind: a load balancer's first /readyz
probe is enough. Loading runs in a thread, so probes answer "loading" meanwhile and
requests wait for the engine up to `INFERENCE["LOAD_WAIT_S"]`.

    settings.INFERENCE --(engine_config)--> EngineConfig --(loader thread)--> LLMEngine
                                                                  AsyncEngine <--'
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from django.conf import settings

from inference import heap
from inference.engine.errors import ConfigError

# The engine (and torch) are imported when the engine is built, not with this module:
# the probes and operator views import it, and `manage.py` commands must stay light
# (`engine.errors` is plain Python).
if TYPE_CHECKING:
    from inference.engine.async_engine import AsyncEngine
    from inference.engine.config import EngineConfig
    from inference.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

NOT_STARTED, LOADING, READY, FAILED = "not started", "loading", "ready", "failed"


def engine_config() -> EngineConfig:
    """The frozen engine configuration, from the one `INFERENCE` settings dict."""
    from inference.engine.config import EngineConfig

    conf = settings.INFERENCE
    return EngineConfig(
        model=conf["MODEL"],
        device=conf["DEVICE"],
        dtype=conf["DTYPE"],
        kv_cache_bytes=conf["KV_CACHE_BYTES"],
        swap_space_bytes=conf["SWAP_BYTES"],
        max_num_seqs=conf["MAX_NUM_SEQS"],
        max_num_batched_tokens=conf["MAX_BATCHED_TOKENS"],
        max_model_len=conf["MAX_MODEL_LEN"] or None,
        policy=conf["POLICY"],
        aging_threshold_s=conf["AGING_S"],
        tenant_queue_share=conf["TENANT_QUEUE_SHARE"],
        crowd_sit_out_seqs=conf["CROWD_SIT_OUT_SEQS"],
        crowd_sit_out_every=conf["CROWD_SIT_OUT_EVERY"],
        crowd_prefill_tokens=conf["CROWD_PREFILL_TOKENS"],
        kernels=conf["KERNELS"],
        quantization=conf["QUANTIZATION"],
        speculative=conf["SPECULATIVE"],
        draft_model=conf["DRAFT_MODEL"] or None,
        num_speculative_tokens=conf["NUM_SPECULATIVE_TOKENS"],
        speculative_max_batch=conf["SPECULATIVE_MAX_BATCH"],
        speculative_adaptive=conf["SPECULATIVE_ADAPTIVE"],
        ngram_min=conf["NGRAM_MIN"],
        cache_dir=conf["CACHE_DIR"] or None,
        cpu_threads=conf["CPU_THREADS"] or serving_threads(),
    )


def serving_threads() -> int:
    """The engine's CPU threads when INFERENCE_CPU_THREADS is 0: a core fewer than this process
    may run on, at least one. The web process (the event loop, admission, tokenizing) keeps a
    core; sharing every core with it, the engine's team of threads waited at each parallel
    region for the one the web process had taken (see EngineConfig.cpu_threads)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores - 1)


class EngineUnavailable(Exception):
    """No engine to serve with: still loading, failed to load, or stopped."""

    def __init__(self, state: str, detail: str = ""):
        super().__init__(detail or f"the engine is {state}")
        self.state = state


class EngineHost:
    """Owns this process's `AsyncEngine` and the state of getting it ready."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = NOT_STARTED
        self._error = ""
        self._engine: AsyncEngine | None = None
        self._ready = threading.Event()
        self.started_at: float | None = None

    @property
    def state(self) -> str:
        if self._state == READY and not self._engine.is_ready():
            return FAILED
        return self._state

    @property
    def error(self) -> str:
        if self._state == READY and not self._engine.is_ready():  # an engine process that died, restarting
            return getattr(self._engine, "error", "") or "the engine stopped"
        return self._error

    def start(self) -> None:
        """Begin loading in a background thread; a no-op once started."""
        with self._lock:
            if self._state != NOT_STARTED:
                return
            self._state = LOADING
            self.started_at = time.monotonic()
        threading.Thread(target=self._load, name="llm-engine-loader", daemon=True).start()

    def _load(self) -> None:
        try:
            config = engine_config()
            shared = settings.INFERENCE["ENGINE_SOCKET"] or None
            if shared or settings.INFERENCE["PROCESS"]:
                if shared:
                    log.info("connecting to the engine server on %s", shared)
                else:
                    log.info("loading model %s (device %s, dtype %s, kernels %s) in a process of its own",
                             config.model, config.device, config.dtype, config.kernels)
                from inference.engine.process import EngineProcess

                async_engine = EngineProcess(config, shared=shared, name=settings.REPLICA_ID)
                async_engine.start()
                engine = async_engine.engine
            else:  # the engine on a thread of this process, and torch with it
                log.info("loading model %s (device %s, dtype %s, kernels %s)", config.model, config.device,
                         config.dtype, config.kernels)
                from inference.engine.async_engine import AsyncEngine
                from inference.engine.engine import LLMEngine
                from inference.engine.metrics import EngineMetrics

                engine = LLMEngine.from_config(config)
                async_engine = AsyncEngine(engine, metrics=EngineMetrics())
                async_engine.start()
        except Exception as exc:  # a bad model path, out of memory...: say so on /readyz and to callers
            if isinstance(exc, ConfigError):  # the settings, not the code: the operator's to fix, no traceback
                log.error("the engine cannot start with these INFERENCE settings: %s", exc)
            else:
                log.exception("the engine failed to load")
            self._error = f"{type(exc).__name__}: {exc}"
            self._state = FAILED
        else:
            heap.freeze()  # what the process holds now is never garbage: see inference.heap
            self.serve(async_engine)
            log.info("engine ready in %.1f s: %d KV blocks of %d tokens", time.monotonic() - self.started_at,
                     engine.block_manager.num_blocks, engine.block_manager.block_size)
        finally:
            self._ready.set()

    def serve(self, engine: AsyncEngine) -> None:
        """Serve with a started engine (what loading ends with; tests hand one in directly)."""
        self._engine = engine
        self._state = READY
        self._ready.set()

    def engine(self) -> AsyncEngine:
        """The running engine, or EngineUnavailable saying why there is none."""
        state = self.state
        if state != READY:
            raise EngineUnavailable(state, self._error if state == FAILED else "")
        return self._engine

    async def wait_engine(self, timeout: float | None = None) -> AsyncEngine:
        """The engine, waiting for it while it loads (at most `timeout`, default LOAD_WAIT_S)."""
        self.start()
        if not self._ready.is_set():
            wait = settings.INFERENCE["LOAD_WAIT_S"] if timeout is None else timeout
            await asyncio.to_thread(self._ready.wait, wait)
        return self.engine()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine().engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine().engine.max_model_len

    def shutdown(self) -> None:
        engine = self._engine
        if engine is not None:
            engine.shutdown()


host = EngineHost()


class EngineLifespan:
    """ASGI wrapper that starts the engine when the server starts serving, and calls each of
    `on_serve` then (on every connection: they must be idempotent)."""

    def __init__(self, app: Any, on_serve: tuple[Callable[[], None], ...] = ()) -> None:
        self.app = app
        self.on_serve = on_serve

    def _serving(self) -> None:
        host.start()
        for call in self.on_serve:
            call()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    self._serving()
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await asyncio.to_thread(host.shutdown)
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        self._serving()
        await self.app(scope, receive, send)
