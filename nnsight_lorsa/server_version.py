"""The remote server's nnsight version, checked against this client's before a request is sent.

NDIF runs a request with the nnsight it has installed, and a request is nnsight's own pickle of the traced block
(``nnsight.intervention.serialization``), whose format follows nnsight's version: a client on another version
fails deep in unpickling on the server, or later. The server reports its environment at ``GET {host}/env`` —
``{"python_version": ..., "packages": {import name: version}}`` (``ndif-team/ndif`` at
``b7ac71f4e4a96fa95b1f155d613eba6069441db1``: ``src/services/api/src/app.py``, ``@app.get("/env")``, filled by the
controller's ``env()`` in ``src/services/ray/src/ray/deployments/controller/controller.py``; nnsight 0.8.1 reads it
in ``nnsight.ndif.get_remote_env`` for ``nnsight.compare()``, but never before a request). The server's own gate
(``validate_nnsight_version`` in ``src/services/api/src/dependencies.py``) refuses only a client *older* than its
minimum, and only when one is configured; a newer client passes it. nnsight itself sends its version in the
``nnsight-version`` header and checks nothing.

:func:`check_server_version` (called by :class:`~nnsight_lorsa.remote.MeasuredRemoteBackend` before each
request, after :func:`nnsight_lorsa.remote.register`) reads the server's version once per host
(:func:`server_nnsight_version`, cached) and raises :class:`~nnsight_lorsa.errors.ServerVersionError` when it is
not the client's — or when the server's Python (``/env``'s ``python_version``, :func:`server_python_version`) is
another ``major.minor`` than the client's: the code a request carries by value includes CPython bytecode (methods
dataclasses generate have no source for nnsight's serializer), which runs only on the Python that compiled it (a
3.11 request unpickled on 3.12 segfaulted: a helper's probe, 2026-11-29). NDIF's API refuses only a client Python
*older* than its minimum. Client side only (httpx, as nnsight's remote backend).
"""

from __future__ import annotations

import sys
import warnings

from .errors import ServerVersionError, ServerVersionWarning

#: ``{host: (the server's nnsight version, its Python's "major.minor"), each None when it does not report it}``,
#: filled on first use per host.
_VERSIONS: dict[str, tuple[str | None, str | None]] = {}
#: The nnsight versions this package supports (pyproject's ``nnsight>=0.8.1,<0.9``).
SUPPORTED = "0.8.x (>= 0.8.1)"


def client_nnsight_version() -> str:
    """The nnsight version installed here (its distribution metadata, as nnsight's ``nnsight-version`` header)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nnsight")
    except PackageNotFoundError:  # a source tree on the path
        import nnsight

        return str(nnsight.__version__)


def server_nnsight_version(host: str, *, refresh: bool = False, timeout: float = 30.0) -> str | None:
    """The nnsight version the server at ``host`` runs, from its ``GET {host}/env`` (cached per host).

    Returns None when the server does not report it (no ``/env`` endpoint: HTTP 404, or no ``nnsight`` among its
    packages); that answer is cached too. A network error is not cached (the next request asks again).

    Raises:
        httpx.HTTPError: the server could not be reached, or answered ``/env`` with an error other than 404.
    """
    return _server_env(host, refresh, timeout)[0]


def server_python_version(host: str, *, refresh: bool = False, timeout: float = 30.0) -> str | None:
    """The ``"major.minor"`` of the Python the server at ``host`` runs, from its ``GET {host}/env``
    (``python_version``: ``sys.version`` there; cached per host with :func:`server_nnsight_version`), or None when it
    does not report it.

    Raises:
        httpx.HTTPError: as :func:`server_nnsight_version`.
    """
    return _server_env(host, refresh, timeout)[1]


def _server_env(host: str, refresh: bool, timeout: float) -> tuple[str | None, str | None]:
    import re

    import httpx

    host = host.rstrip("/")
    if refresh or host not in _VERSIONS:
        response = httpx.get(f"{host}/env", timeout=timeout)
        if response.status_code == 404:
            _VERSIONS[host] = (None, None)
        else:
            response.raise_for_status()
            env = response.json()
            packages = env.get("packages") or {}
            found = {str(k).lower().replace("_", "-"): v for k, v in packages.items()}.get("nnsight")
            python = re.match(r"\s*(\d+\.\d+)", str(env.get("python_version") or ""))
            _VERSIONS[host] = (None if found is None else str(found), python.group(1) if python else None)
    return _VERSIONS[host]


def same_version(a: str, b: str) -> bool:
    """Whether two nnsight versions are the same release (PEP 440; a local label ``+...`` is ignored)."""
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError:  # packaging ships with transformers; plain strings without it
        return a.split("+")[0] == b.split("+")[0]
    try:
        return Version(a).public == Version(b).public
    except InvalidVersion:
        return a.split("+")[0] == b.split("+")[0]


def check_server_version(host: str, enabled: bool = True) -> None:
    """Before a request to ``host``: raise when its server runs another nnsight than this client, or another Python
    (``major.minor``: the bytecode a request carries runs on its own Python only).

    Args:
        host: the server's address (``RemoteBackend.host``, e.g. ``https://api.ndif.us``).
        enabled: False skips the check (``remote_backend(..., check_version=False)``).

    Raises:
        ServerVersionError: the nnsight or the Python versions differ (the message names both and what to do).

    Warns:
        ServerVersionWarning: the server does not report its version, or ``/env`` could not be read (the request
            is sent unchecked; a server that cannot be reached fails the request itself).
    """
    if not enabled:
        return
    import httpx

    try:
        server = server_nnsight_version(host)
    except httpx.HTTPError as e:
        warnings.warn(f"could not read the nnsight version of the server at {host} ({type(e).__name__}: {e}); "
                      "sending the request unchecked", ServerVersionWarning, stacklevel=3)
        return
    if server is None:
        warnings.warn(f"the server at {host} does not report its nnsight version (GET /env); sending the request "
                      "unchecked", ServerVersionWarning, stacklevel=3)
        return
    client = client_nnsight_version()
    if not same_version(client, server):
        raise ServerVersionError(
            f"the server at {host} runs nnsight {server}, this client nnsight {client}: a remote request is "
            "nnsight's pickle of the traced block and the server unpickles and runs it with its own nnsight, so the "
            f"two must be the same version. Install the server's: `pip install nnsight=={server}` — nnsight-lorsa "
            f"supports nnsight {SUPPORTED}; if the server's version is outside that, run locally or on a server with "
            "a supported nnsight until NDIF upgrades. Nothing was sent. (check_version=False on "
            "nnsight_lorsa.remote.remote_backend skips this check, for a server you know to be compatible.)",
            host, client, server)
    here, there = "{}.{}".format(*sys.version_info[:2]), server_python_version(host)
    if there is not None and there != here:
        raise ServerVersionError(
            f"the server at {host} runs Python {there}, this client Python {here}: the functions a request carries "
            "by value (nnsight_lorsa.remote.register) include CPython bytecode where nnsight's serializer has no "
            "source — every dataclass-generated method (SpliceChain.__init__, which each replace() calls, "
            "LorsaConfig.__init__, LorsaHead.__eq__, ...) — and bytecode runs only on the Python that compiled it "
            f"(a 3.11 request unpickled on 3.12 crashed the server's process). Use Python {there} here. Nothing "
            "was sent. (check_version=False on nnsight_lorsa.remote.remote_backend skips this check.)",
            host, f"Python {here}", f"Python {there}")
