"""The deployment's admin key, below every layer that needs it: the launcher hands it to the servers, the
restricted Triton APIs and the operator ops check it, the KV wire keys its tags with it (kv/wire.py), the clients
send it (client.admin_parameters, kv/transport registrations). server.py re-exports these names."""
from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Dict

from . import config

REPO_ROOT = Path(__file__).resolve().parents[2]
ADMIN_HEADER = "hetserve-admin-key"  # HTTP header / gRPC metadata (prefixed) carrying HETSERVE_ADMIN_KEY
GRPC_HEADER_PREFIX = "triton-grpc-protocol-"


class AdminKeyError(RuntimeError):
    """The admin key file cannot be used (readable by other users)."""


ADMIN_PARAM = "hetserve_admin_key"  # the request parameter that carries the admin key to the operator ops


def admin_key_file() -> Path:
    return Path(config.get("HETSERVE_ADMIN_KEY_FILE") or REPO_ROOT / ".hetserve" / "run" / "admin-key")


def admin_key() -> str:
    """The deployment's admin key: HETSERVE_ADMIN_KEY; else the local key file (mode 0600, made once with a random
    key), so `hetserve up` and the local tools (`hetserve doctor`) agree without a secret on the command line.
    Exported to this process's environment, so the servers it starts (and their KV sender) share it."""
    k = config.get("HETSERVE_ADMIN_KEY")
    if k:
        return k
    f = admin_key_file()
    try:
        k = f.read_text().strip()
    except OSError:
        k = ""
    if not k:
        f.parent.mkdir(parents=True, exist_ok=True)
        k = secrets.token_urlsafe(24)
        fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(k + "\n")
    elif f.stat().st_mode & 0o077:
        raise AdminKeyError(f"{f} is readable by other users (mode {oct(f.stat().st_mode & 0o777)}); chmod 600 it")
    os.environ["HETSERVE_ADMIN_KEY"] = k
    return k


def admin_headers(protocol: str = "grpc") -> Dict[str, str]:
    """Headers for a tritonclient call to a restricted API (shm registration, model control). Triton's gRPC
    frontend expects the key under its `triton-grpc-protocol-` prefix, the HTTP frontend as it is."""
    name = ADMIN_HEADER if protocol == "http" else GRPC_HEADER_PREFIX + ADMIN_HEADER
    return {name: admin_key()}
