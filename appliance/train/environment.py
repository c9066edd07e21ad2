"""The environment horovodrun forwards to every rank.

horovodrun copies the launcher's *entire* environment onto the ssh command line of every rank,
so the launcher runs with an environment built from an allow-list, and anything that looks
like a credential is refused even when a user asks for it.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

# Names (fnmatch patterns, matched case-insensitively) that must never reach a rank.
DENY_PATTERNS = (
    "OS_*",
    "AWS_*",
    "*_SECRET*",
    "*SECRET*",
    "*TOKEN*",
    "*PASSWORD*",
    "*PASSWD*",
    "*CREDENTIAL*",
    "*_KEY",
    "*PRIVATE_KEY*",
    "ST_AUTH",
    "ST_USER",
    "SWIFT_*",
    "SSH_AUTH_SOCK",
)

# Variables kept from the launcher's own environment, if set.
ALLOW_FROM_LAUNCHER = ("LANG", "LC_ALL", "TZ", "TERM")

# Always set for ranks.
BASE_RANK_ENV = {
    "TF_USE_LEGACY_KERAS": "1",  # Horovod 0.28.1 needs tf.keras (tf_keras), not Keras 3
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "PYTHONUNBUFFERED": "1",
    "PYTHONDONTWRITEBYTECODE": "1",
}


def is_denied(name: str) -> bool:
    up = name.upper()
    return any(fnmatch.fnmatchcase(up, pat) for pat in DENY_PATTERNS)


def denied_names(env: Mapping[str, str]) -> set[str]:
    return {k for k in env if is_denied(k)}


def rank_environment(*, path: str, home: str, nic: str | None, extra: Mapping[str, str] | None = None,
                     launcher_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The complete environment for horovodrun (and so for every rank).

    Raises ValueError if ``extra`` names a denied variable: a spec that asks to forward a
    credential is an error, not something to drop silently.
    """
    env: dict[str, str] = {"PATH": path, "HOME": home, "LANG": "C.UTF-8"}
    for k in ALLOW_FROM_LAUNCHER:
        if launcher_env and k in launcher_env and not is_denied(k):
            env[k] = launcher_env[k]
    env.update(BASE_RANK_ENV)
    if nic:
        env["GLOO_SOCKET_IFNAME"] = nic
        env["NCCL_SOCKET_IFNAME"] = nic
        env["HOROVOD_GLOO_IFACE"] = nic
    if extra:
        bad = denied_names(extra)
        if bad:
            raise ValueError(f"refusing to forward credential-like variables to ranks: {', '.join(sorted(bad))}")
        env.update(extra)
    assert not denied_names(env), denied_names(env)
    return env
