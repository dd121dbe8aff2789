"""The API key format: `sk-<prefix>_<secret>`, and how it is stored and checked.

The prefix is public: it finds the row. The secret is 256 random bits, so one SHA-256
of the key is enough to store (a slow password hash protects low-entropy secrets; this
one cannot be guessed), and it keeps verification cheap on every request.
"""
import hashlib
import hmac
import secrets
from dataclasses import dataclass

KEY_PREFIX = "sk-"
PREFIX_BYTES = 6  # 12 hex characters: collisions are retried, enumeration gains nothing.
SECRET_BYTES = 32


@dataclass(frozen=True)
class ParsedKey:
    prefix: str
    plaintext: str


def generate() -> ParsedKey:
    """A new key. Its prefix is hex, so the first `_` after `sk-` always ends it."""
    prefix = secrets.token_hex(PREFIX_BYTES)
    return ParsedKey(prefix=prefix, plaintext=f"{KEY_PREFIX}{prefix}_{secrets.token_urlsafe(SECRET_BYTES)}")


def parse(plaintext: str) -> ParsedKey | None:
    """Split a presented key; None when it does not have the key's shape."""
    if not plaintext.startswith(KEY_PREFIX):
        return None
    prefix, sep, secret = plaintext[len(KEY_PREFIX):].partition("_")
    if not sep or not secret or len(prefix) != 2 * PREFIX_BYTES:
        return None
    return ParsedKey(prefix=prefix, plaintext=plaintext)


def digest(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode()).hexdigest()


def matches(plaintext: str, stored_digest: str) -> bool:
    """Constant-time comparison, so response timing leaks nothing about the digest."""
    return hmac.compare_digest(digest(plaintext), stored_digest)
