"""Which storage errors are transient (worth a retry), and why, in words for a person.

``is_transient`` looks through an error's chain of causes for throttling, 5xx/429/408
answers, dropped or refused connections and timeouts of any client library (matched by class
name, so none is imported); ``reason`` names the cause and the endpoint, for the notice a
waiting program shows (``connection refused to 127.0.0.1:9000``).
"""

from __future__ import annotations

from urllib.parse import urlsplit

from shardkeeper.core.errors import CheckpointNotFoundError, CommitConflictError, CorruptCheckpointError

_TRANSIENT_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "TooManyRequests",
        "503",
        "500",
        "502",
        "504",
        "429",
    }
)
# Exception classes (by name, so that no client library is imported) of dropped connections,
# timeouts and truncated responses in botocore, aiohttp, urllib3, requests and fsspec.
_TRANSIENT_CLASSES = frozenset(
    {
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ReadTimeoutError",
        "ConnectTimeoutError",
        "ResponseStreamingError",
        "IncompleteReadError",
        "IncompleteRead",
        "ProtocolError",
        "ServerDisconnectedError",
        "ClientConnectionError",
        "ClientOSError",
        "ClientPayloadError",
        "ServerTimeoutError",
        "ClientConnectorError",
        "FSTimeoutError",
        "ChunkedEncodingError",
        "RemoteDisconnected",
    }
)


def _chain(e: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    cur: BaseException | None = e
    while cur is not None and all(cur is not x for x in out):
        out.append(cur)
        cur = cur.__cause__ or (None if cur.__suppress_context__ else cur.__context__)
    return out


def is_transient(e: BaseException) -> bool:
    """True for throttling, 5xx/429/408 answers, dropped connections and timeouts anywhere in
    ``e``'s chain of causes; False for missing files, conflicts and corruption."""
    if isinstance(e, (CheckpointNotFoundError, CommitConflictError, CorruptCheckpointError)):
        return False
    for cur in _chain(e):
        if isinstance(cur, (ConnectionError, TimeoutError)):
            return True
        if any(c.__name__ in _TRANSIENT_CLASSES for c in type(cur).__mro__):
            return True
        response = getattr(cur, "response", None)
        if isinstance(response, dict):
            code = str((response.get("Error") or {}).get("Code") or "")
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if code in _TRANSIENT_CODES or status in _TRANSIENT_STATUSES:
                return True
        for attr in ("status", "code"):  # aiohttp (whose .code is deprecated), gcsfs HttpError
            value = getattr(cur, attr, None)
            if isinstance(value, int):
                if value in _TRANSIENT_STATUSES:
                    return True
                break
        text = str(cur)
        if "SlowDown" in text or "reduce your request rate" in text:
            return True
    return False


def reason(e: BaseException) -> str:
    """A short why of a transient error, for a person: ``connection refused to host:port``,
    ``timed out``, ``HTTP 503 SlowDown``, else the error's class and first line."""
    chain = _chain(e)
    what = None
    for cur in chain:
        if isinstance(cur, ConnectionRefusedError):
            what = "connection refused"
        elif isinstance(cur, TimeoutError) or "Timeout" in type(cur).__name__:
            what = "timed out"
        else:
            response = getattr(cur, "response", None)
            if isinstance(response, dict):
                code = str((response.get("Error") or {}).get("Code") or "")
                status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
                what = " ".join(x for x in (f"HTTP {status}" if status else "", code) if x) or None
        if what:
            break
    host = None
    for cur in chain:
        h, port = getattr(cur, "host", None), getattr(cur, "port", None)
        kwargs = getattr(cur, "kwargs", None)  # botocore: EndpointConnectionError(endpoint_url=...)
        if isinstance(h, str) and isinstance(port, int):
            host = f"{h}:{port}"
        elif isinstance(kwargs, dict) and isinstance(kwargs.get("endpoint_url"), str):
            host = urlsplit(kwargs["endpoint_url"]).netloc or None
        if host:
            break
    if what is None:
        first = (str(e).splitlines() or [""])[0][:120]
        what = f"{type(e).__name__}: {first}" if first else type(e).__name__
    return f"{what} to {host}" if host else what


__all__ = ["is_transient", "reason"]
