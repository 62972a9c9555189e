"""Who is asking: the keys the Tinker service accepts, and the tenant each key names.

A deployment has no key (any key is accepted, on loopback only, and every client is the tenant
`local`), one key (`--api-key-env`), or a file of keys (`--api-keys-file`, one `KEY [NAME]` a
line), each a tenant of its own. A tenant sees only its own sessions, training runs, checkpoints,
samplers and futures; anything else answers as unknown (404), so one tenant cannot learn another's
ids. A published checkpoint is readable (sampled, loaded, its weights fetched) by every tenant,
and still only its owner may change or delete it.

The tenant of the request being served is a context variable set by the HTTP guard: it follows
the request into the tasks and threads that do its work, so the service reads it where it
records or checks an owner instead of threading it through every call.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path

LOCAL = "local"
"""The tenant of every client when the service has no key."""

KEY_PREFIXES = ("tml-",)
"""What the SDK accepts as an API key (`ApiKeyAuthProvider`: `tml-...`; JWTs are not served here)."""

_current: contextvars.ContextVar[str] = contextvars.ContextVar("tinker_tenant", default=LOCAL)


def current() -> str:
    """The tenant of the request being served (`LOCAL` outside a request)."""
    return _current.get()


def serve_as(tenant: str) -> contextvars.Token:
    """Make `tenant` the current one (the guard does this for each request)."""
    return _current.set(tenant)


def reset(token: contextvars.Token) -> None:
    """Back to the tenant before `serve_as` (the guard, once its request is answered)."""
    _current.reset(token)


def check_key(key: str, where: str) -> str:
    """`key` if the SDK would send it; else a ValueError naming `where` it came from and why."""
    if not isinstance(key, str) or not key.strip():
        raise ValueError(f"{where}: the key is empty")
    if key != key.strip() or any(c.isspace() for c in key):
        raise ValueError(f"{where}: the key holds whitespace")
    if not key.startswith(KEY_PREFIXES):
        raise ValueError(f"{where}: the key does not start with 'tml-', so the tinker SDK would refuse to send it "
                         "('The api_key must start with the tml- prefix')")
    return key


@dataclass(frozen=True)
class Keys:
    """The keys a service accepts and the tenant of each; `open` accepts any key as `LOCAL`."""

    by_key: dict[str, str]
    open: bool = False

    @classmethod
    def any_key(cls) -> Keys:
        return cls({}, open=True)

    @classmethod
    def single(cls, key: str, where: str = "the API key") -> Keys:
        return cls({check_key(key, where): LOCAL})

    @classmethod
    def from_file(cls, path: str | Path) -> Keys:
        """`KEY [NAME]` a line (`#` starts a comment); a key without a name is its tenant by the
        first 12 hex digits of its sha256, so a listing never shows a key."""
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as e:
            raise ValueError(f"--api-keys-file {p}: cannot read it ({e.strerror or e})") from None
        by_key: dict[str, str] = {}
        for n, line in enumerate(text.splitlines(), 1):
            parts = line.split("#", 1)[0].split()
            if not parts:
                continue
            if len(parts) > 2:
                raise ValueError(f"--api-keys-file {p}:{n}: expected 'KEY [NAME]', got {len(parts)} words")
            key = check_key(parts[0], f"--api-keys-file {p}:{n}")
            name = parts[1] if len(parts) == 2 else "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]
            if key in by_key:
                raise ValueError(f"--api-keys-file {p}:{n}: this key is listed twice")
            if name in by_key.values():
                raise ValueError(f"--api-keys-file {p}:{n}: tenant name {name!r} is given to two keys")
            by_key[key] = name
        if not by_key:
            raise ValueError(f"--api-keys-file {p}: no keys in it")
        return cls(by_key)

    def tenant(self, given: str | None) -> str | None:
        """The tenant of key `given`, or None when it is not accepted (compared in constant time)."""
        if self.open:
            return LOCAL
        found = None
        for key, name in self.by_key.items():  # every key compared, so timing tells nothing of which matched
            if given is not None and hmac.compare_digest(given.encode(), key.encode()):
                found = name
        return found
