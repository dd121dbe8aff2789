"""Tokenizer, chat template and an incremental detokenizer.

The tokenizer comes from the GGUF metadata or the model folder's tokenizer.json
(through `transformers`). Converting a GGUF vocabulary takes seconds, so the
converted tokenizer is kept in a cache folder keyed by the file's identity.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from inference.engine.sources import ModelSource, cache_root, file_key


def _load_hf_tokenizer(source: ModelSource, cache_dir: str | os.PathLike | None = None):
    if source.kind == "hf":
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(source.path))
    cached = cache_root(cache_dir) / "tokenizers" / file_key(source.path)
    if (cached / "tokenizer.json").is_file():
        # The class AutoTokenizer picks for what save_pretrained wrote below, named directly:
        # AutoTokenizer imports transformers' model configurations and with them torch (~1.3 s
        # and ~80 MB in the web process, which tokenizes but runs no model).
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(cached))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cached.parent))
    tok.save_pretrained(str(tmp))
    try:
        tmp.rename(cached)  # atomic: concurrent processes never see half a folder
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return tok


class Tokenizer:
    def __init__(self, hf_tokenizer):
        self.hf = hf_tokenizer
        self.vocab_size = len(hf_tokenizer)
        eos = hf_tokenizer.eos_token_id
        self.eos_token_ids = frozenset(() if eos is None else (eos,))
        self.chat_template = hf_tokenizer.chat_template

    @classmethod
    def load(cls, source: ModelSource, cache_dir: str | os.PathLike | None = None) -> Tokenizer:
        """`cache_dir`: where a GGUF's converted tokenizer is kept (sources.cache_root)."""
        return cls(_load_hf_tokenizer(source, cache_dir))

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

    @property
    def knows_tools(self) -> bool:
        """Whether the chat template renders a `tools` list itself (Qwen2.5 and Hermes models do;
        SmolLM2's does not)."""
        return "tools" in (self.chat_template or "")

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template")
        extra = {"tools": tools} if tools else {}
        return self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False, **extra)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt, tools))

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self)


class IncrementalDetokenizer:
    """Turns a growing list of output tokens into text deltas.

    A token may end in the middle of a UTF-8 character (byte-level BPE splits emoji
    and CJK across tokens). Text is only released once it decodes without the
    replacement character, and always as the difference of two decodes that start
    at the same token, so the deltas concatenate to exactly the full decode.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # decodes start here, so leading-space rules apply alike to both
        self.read_offset = 0  # text up to here has been released
        self.text = ""

    def push(self, token_ids) -> str:
        self.token_ids.extend(token_ids)
        decode = self.tokenizer.decode
        prefix_text = decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = decode(self.token_ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Release whatever is held back, even an incomplete character (the sequence ended)."""
        decode = self.tokenizer.decode
        prefix_text = decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = decode(self.token_ids[self.prefix_offset :])
        delta = new_text[len(prefix_text) :] if new_text.startswith(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.text += delta
        return delta
