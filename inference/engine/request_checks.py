"""The engine's checks of a request against the model and its KV cache, apart from the engine:
the web process runs them on the engine process's shape (process.EngineShape) without
importing torch."""

from __future__ import annotations

from inference.engine.errors import InvalidRequestError


class RequestChecks:
    """Needs `vocab_size`, `max_model_len` and a `block_manager` (its `num_blocks`,
    `block_size` and `blocks_needed`). The API runs these two checks before it reserves a
    request's tokens, for every prompt of the request at once; `LLMEngine.add_request` runs
    them again for each one it queues."""

    def check_token_ids(self, token_ids: list[int]) -> None:
        """Refuse token ids outside the model's vocabulary."""
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"Token id {bad} is outside the vocabulary (0..{self.vocab_size - 1}).",
                                      param="prompt", code="invalid_token_id")

    def check_context(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        """Refuse a prompt that leaves no room in the context, or that with `max_tokens` (None:
        not asked for yet) exceeds the context or the whole KV cache."""
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens, but the prompt has {num_prompt_tokens} tokens.",
                param="prompt", code="context_length_exceeded",
            )
        if max_tokens is None:
            return
        total = num_prompt_tokens + max_tokens
        if total > limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens, but {total} were requested "
                f"({num_prompt_tokens} in the prompt, {max_tokens} for the completion). Lower max_tokens or shorten the prompt.",
                param="max_tokens", code="context_length_exceeded",
            )
        bm = self.block_manager
        if bm.blocks_needed(total) > bm.num_blocks:
            raise InvalidRequestError(
                f"{total} tokens need more KV cache than this engine has ({bm.num_blocks * bm.block_size} tokens).",
                param="max_tokens", code="context_length_exceeded",
            )
