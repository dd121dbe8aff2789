"""The models this deployment serves, as clients name them."""
import time
from pathlib import Path

from django.conf import settings

# OpenAI's `created` is when a model was published; ours is when this process started serving it.
_STARTED = int(time.time())


def served_model_id() -> str:
    """`INFERENCE_SERVED_MODEL_NAME`, else the model's name (a file or folder's stem)."""
    conf = settings.INFERENCE
    if conf["SERVED_MODEL_NAME"]:
        return conf["SERVED_MODEL_NAME"]
    model = conf["MODEL"]
    return Path(model).stem if ("/" in model or model.endswith(".gguf")) else model


def served_models(max_model_len: int | None = None) -> list[dict[str, object]]:
    """The OpenAI model objects for GET /v1/models, with vLLM's `max_model_len` (the context in
    tokens; None until the engine has loaded the model and knows it)."""
    return [{"id": served_model_id(), "object": "model", "created": _STARTED, "owned_by": "platform",
             "max_model_len": max_model_len}]
