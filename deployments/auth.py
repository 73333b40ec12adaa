"""The API key: where it comes from (the args, a named environment variable, a file) and how a
presented one is checked. The key is never logged."""
from __future__ import annotations

import hmac

from pydantic import SecretStr

DEFAULT_API_KEY_ENV = "TANDEM_API_KEY"


def resolve_api_key(api_key: SecretStr | None, api_key_env: str | None, api_key_file: str | None) -> SecretStr | None:
    """The key from the args (CLI), a named environment variable, or a file; never logged."""
    import os

    if api_key is not None:
        return api_key
    if not api_key_file and not api_key_env and os.environ.get(DEFAULT_API_KEY_ENV):
        api_key_env = DEFAULT_API_KEY_ENV
    if api_key_file:
        with open(api_key_file, encoding="utf-8") as f:
            value = f.read().strip()
        if not value:
            raise ValueError("api_key_file is empty")
        return SecretStr(value)
    if api_key_env:
        value = os.environ.get(api_key_env, "")
        if not value:
            raise ValueError(f"api_key_env names {api_key_env!r}, but that environment variable is not set")
        return SecretStr(value)
    return None


def key_matches(presented: str | bytes | None, expected: SecretStr) -> bool:
    """`presented` is an Authorization value; constant-time comparison against 'Bearer <key>'."""
    if presented is None:
        return False
    if isinstance(presented, str):
        presented = presented.encode("utf-8", "replace")
    return hmac.compare_digest(presented, f"Bearer {expected.get_secret_value()}".encode())
