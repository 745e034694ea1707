"""The secret that authenticates (and, with encryption on, encrypts) the disk and Redis chunks.

In order: the one given (``--kv-tier-secret`` / ``LLM(kv_tier_secret=...)``), the
``KVSERVE_KV_TIER_SECRET`` environment variable, else a random one generated once and kept in
kvserve's state directory (``KVSERVE_STATE_DIR``, else ``$XDG_STATE_HOME/kvserve``, else
``~/.local/state/kvserve``), file mode 0600. So a restart on the same host reads its own chunks,
and processes on other hosts share chunks only when given the same secret. The file never lives
inside a tier: whoever can read the chunks must not also find the key beside them.
"""
from __future__ import annotations

import os
import secrets

from kvserve import envs
from kvserve.errors import ConfigError

FILE_NAME = "kv_tier_secret"


def state_dir() -> str:
    d = envs.get(envs.KVSERVE_STATE_DIR)
    if not d:
        base = envs.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
        d = os.path.join(base, "kvserve")
    return os.path.abspath(d)


def _inside(path: str, root: str) -> bool:
    path, root = os.path.realpath(path), os.path.realpath(root)
    return path == root or path.startswith(root + os.sep)


def _read(path: str) -> bytes:
    st = os.stat(path)
    if st.st_mode & 0o077:
        raise ConfigError("kv_tier_secret", f"{path} is readable by others (mode {st.st_mode & 0o777:o}); "
                          f"chmod 600 it")
    with open(path, "rb") as f:
        value = f.read().strip()
    if len(value) < 32:
        raise ConfigError("kv_tier_secret", f"{path} holds {len(value)} bytes, expected a 64-hex-digit secret")
    return value


def tier_secret(given: str | None, disk_dir: str | None = None) -> bytes:
    """The secret's bytes. ``disk_dir``: the disk tier, which must not hold the secret file."""
    value = given if given is not None else envs.get(envs.KVSERVE_KV_TIER_SECRET)
    if value is not None:
        if len(value) < 16:
            raise ConfigError("kv_tier_secret", f"must be at least 16 characters, got {len(value)}")
        return value.encode()
    d = state_dir()
    path = os.path.join(d, FILE_NAME)
    if disk_dir is not None and _inside(d, disk_dir):
        raise ConfigError("kv_tier_secret", f"the state directory {d} is inside disk_kv_dir {disk_dir}: "
                          f"the secret must not sit beside the chunks it protects")
    if os.path.exists(path):
        return _read(path)
    try:
        os.makedirs(d, mode=0o700, exist_ok=True)
        # Written whole under a private name, then linked into place: a process starting at the
        # same time either wins the link or reads the winner's complete file.
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_hex(32).encode() + b"\n")
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass
        finally:
            os.unlink(tmp)
    except OSError as e:
        raise ConfigError("kv_tier_secret", f"cannot create {path} ({e.strerror}); give --kv-tier-secret or "
                          f"set {envs.KVSERVE_KV_TIER_SECRET}") from None
    return _read(path)
