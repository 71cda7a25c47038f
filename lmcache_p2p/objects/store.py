"""The S3 client of the object tier: `obstore <https://developmental-seed.github.io/obstore>`_ (Rust's
``object_store`` behind asyncio) behind four calls, each bounded by an absolute deadline.

Chosen by measurement (``bench objects``; the comparison is in docs/guides/object-tier.md): against the same
SeaweedFS on this machine, 2 MiB objects, 8 in flight, obstore moved the bytes with about half the
client CPU of aiobotocore (1.2-2.5 vs 3.6-5.1 ms per MB) at a higher rate, and its requests run on
its own threads, not on the agent's event loop that also serves pulls.

Credentials come from the usual places and never from the config: the ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN`` environment variables, else the shared
credentials file (``AWS_SHARED_CREDENTIALS_FILE`` or ``~/.aws/credentials``, profile ``AWS_PROFILE``
or ``default``). They are never logged and never published in a node record.

Every failure (connection refused, a timeout, a 5xx, a denied request) becomes
:class:`~lmcache_p2p.errors.ObjectStoreError`; a missing object is :class:`ObjectMissing`; an object a
bounded GET refuses by its size is :class:`ObjectSizeRefused` (the object's fault, not the store's: the
caller does not back the store off for it). Retries are the caller's business: obstore's own are limited
to one, so a dead store costs one deadline.
"""

from __future__ import annotations

import asyncio
import configparser
import datetime
import os
import time
from pathlib import Path
from typing import Any

from ..aio import remaining
from ..config import ObjectsConfig
from ..errors import ObjectMissing, ObjectSizeRefused, ObjectStoreError


def credentials(env: dict[str, str] | None = None) -> dict[str, str]:
    """``access_key_id`` / ``secret_access_key`` (/ ``token``) from the environment, else the shared
    credentials file; empty when neither has them (obstore then tries the instance metadata)."""
    env = dict(os.environ) if env is None else env
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        out = {"access_key_id": env["AWS_ACCESS_KEY_ID"], "secret_access_key": env["AWS_SECRET_ACCESS_KEY"]}
        if env.get("AWS_SESSION_TOKEN"):
            out["token"] = env["AWS_SESSION_TOKEN"]
        return out
    path = Path(env.get("AWS_SHARED_CREDENTIALS_FILE") or Path.home() / ".aws" / "credentials")
    parser = configparser.ConfigParser()
    try:
        parser.read(path)
    except (OSError, configparser.Error):
        return {}
    section = parser[env.get("AWS_PROFILE", "default")] if parser.has_section(env.get("AWS_PROFILE", "default")) \
        else None
    if section is None or not section.get("aws_access_key_id") or not section.get("aws_secret_access_key"):
        return {}
    out = {"access_key_id": section["aws_access_key_id"], "secret_access_key": section["aws_secret_access_key"]}
    if section.get("aws_session_token"):
        out["token"] = section["aws_session_token"]
    return out


class ObjectStore:
    """One bucket of an S3-compatible store (``objects.url``; ``objects.bucket``)."""

    def __init__(self, config: ObjectsConfig, *, env: dict[str, str] | None = None) -> None:
        import obstore.store

        if config.url is None:
            raise ObjectStoreError("objects.url is not set")
        self.config = config
        self.url = config.url
        timeout = datetime.timedelta(seconds=config.timeout_s)
        self._store = obstore.store.S3Store(
            config.bucket, endpoint=config.url, region=config.region, virtual_hosted_style_request=False,
            client_options={"allow_http": config.url.startswith("http://"), "timeout": timeout,
                            "connect_timeout": datetime.timedelta(seconds=min(config.timeout_s, 2.0))},
            retry_config={"max_retries": 1, "retry_timeout": timeout},
            **credentials(env))  # type: ignore[arg-type]
        self.calls = 0
        self.bytes_read = 0  # object bytes GETs returned (bounded: see :meth:`get`)

    def __repr__(self) -> str:  # never the credentials
        return f"ObjectStore({self.url}, bucket={self.config.bucket})"

    async def _bounded(self, what: str, name: str, deadline: float, call: Any) -> Any:
        left = remaining(deadline)
        if left <= 0:
            call.close()
            raise ObjectStoreError(f"{what} {name}: deadline passed before the call")
        self.calls += 1
        try:
            return await asyncio.wait_for(call, left)
        except TimeoutError as exc:
            raise ObjectStoreError(f"{what} {name}: no answer in {left:.3f} s") from exc
        except FileNotFoundError as exc:  # obstore's NotFoundError subclasses it
            raise ObjectMissing(f"{what} {name}: not found") from exc
        except ObjectSizeRefused:
            raise
        except Exception as exc:  # obstore raises its own error classes for every failure
            if type(exc).__name__ == "NotFoundError":
                raise ObjectMissing(f"{what} {name}: not found") from exc
            if what == "GET" and "416 Range Not Satisfiable" in str(exc):  # an empty object: no byte 0
                raise ObjectSizeRefused(f"{what} {name}: an empty object", 0) from exc
            raise ObjectStoreError(f"{what} {name}: {type(exc).__name__}: {_short(exc)}") from exc

    async def put(self, name: str, data: bytes | bytearray | memoryview, deadline: float) -> None:
        import obstore

        await self._bounded("PUT", name, deadline, obstore.put_async(self._store, name, data))

    async def get(self, name: str, deadline: float, *, limit: int) -> bytes:
        """The object's bytes, if it holds at most ``limit``: one ranged GET of ``[0, limit)``, so a larger
        object (anyone with write access to the bucket can put one) costs at most ``limit`` bytes on the wire
        and none in memory; it raises :class:`ObjectSizeRefused` (as does an empty one) before its body is
        read."""
        import obstore

        async def bounded() -> bytes:
            result = await obstore.get_async(self._store, name, options={"range": (0, limit)})
            size = int(result.meta["size"])
            if size > limit:  # the object's whole size, from the response's Content-Range
                raise ObjectSizeRefused(f"GET {name}: {size} bytes, more than the {limit} a reader takes", size)
            data = bytes(await result.bytes_async())
            self.bytes_read += len(data)
            return data

        data: bytes = await self._bounded("GET", name, deadline, bounded())
        return data

    async def delete(self, name: str, deadline: float) -> None:
        import obstore

        await self._bounded("DELETE", name, deadline, obstore.delete_async(self._store, name))

    async def head(self, name: str, deadline: float) -> int:
        """The object's size in bytes."""
        import obstore

        meta = await self._bounded("HEAD", name, deadline, obstore.head_async(self._store, name))
        return int(meta["size"])

    async def names(self, prefix: str, deadline: float, limit: int = 100_000) -> dict[str, int]:
        """Object name -> size under ``prefix`` (at most ``limit``)."""
        import obstore

        async def listing() -> dict[str, int]:
            out: dict[str, int] = {}
            async for page in obstore.list(self._store, prefix, chunk_size=1000):
                for meta in page:
                    out[meta["path"]] = int(meta["size"])
                if len(out) >= limit:
                    break
            return out

        found: dict[str, int] = await self._bounded("LIST", prefix, deadline, listing())
        return found

    async def ready(self, timeout: float) -> bool:
        """Whether the bucket answers a signed request (the server is up *and* serves S3)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                await self.names("lmcache-p2p-ready-probe/", min(deadline, time.monotonic() + 2.0), limit=1)
                return True
            except ObjectStoreError:
                if remaining(deadline) <= 0.1:
                    return False
                await asyncio.sleep(0.1)


def _short(exc: BaseException) -> str:
    """The first line of an obstore error (they carry the whole request chain, credentials never)."""
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else ""
