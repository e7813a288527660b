"""An S3-compatible object node (SeaweedFS, MinIO, Ceph RGW, AWS S3) through boto3.

URL: `s3://BUCKET/PREFIX?endpoint=http://host:8333&domain=rack1` with optional
`region=`, `profile=`, `access_key=`/`secret_key=`, `connect_timeout=`,
`read_timeout=`, `retries=` and `pool=` (max pooled connections). Without keys
boto3's usual sources apply (environment, ~/.aws, instance role); with none at
all requests go unsigned, which an auth-less SeaweedFS accepts.

Keys are `PREFIX/ab/<32 hex>`, derived only from the chunk id: no caller string
becomes a key. The two-hex fan-out keeps list pages and S3 partitions spread.
Timeouts are short and bounded (connect 2 s, read 10 s by default) so a dead
node fails a request in seconds, never hangs it; botocore's "standard" retry
mode adds exponential backoff with jitter for transient errors and throttling.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from urllib.parse import parse_qs, urlsplit

import boto3
import botocore
import botocore.session
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from chunkstore.ids import check_id, from_hex
from chunkstore.nodes import redact_url
from chunkstore.nodes.base import NodeError, NodeInfo, ObjectMissing, ObjectNode

log = logging.getLogger("ckptfs.s3node")

_MISSING_CODES = {"NoSuchKey", "404", "NotFound"}
_NO_BUCKET_CODES = {"NoSuchBucket"}


def _param(params: dict[str, list[str]], key: str, default: str | None = None) -> str | None:
    vals = params.get(key)
    return vals[0] if vals else default


def _number(params: dict[str, list[str]], key: str, default: float, url: str) -> float:
    text = _param(params, key)
    if text is None:
        return default
    try:
        val = float(text)
    except ValueError:
        raise ValueError(f"node {redact_url(url)!r}: {key}={text!r} is not a number") from None
    if val <= 0:
        raise ValueError(f"node {redact_url(url)!r}: {key} must be positive")
    return val


def _session(profile: str | None, credentials_file: str | None, info: NodeInfo):
    """A boto3 session whose credentials come by reference only: the environment, a
    profile of ~/.aws, an instance role, or a shared-credentials file named on the URL
    (which must not be readable by others, as ssh insists for its keys). The volume
    stores the reference, never a key."""
    if credentials_file is None:
        return boto3.session.Session(profile_name=profile)
    path = os.path.expanduser(credentials_file)
    try:
        st = os.stat(path)
    except OSError as e:
        raise ValueError(f"node {info.name}: credentials_file {path}: {e.strerror}") from None
    if st.st_mode & 0o077:
        raise ValueError(
            f"node {info.name}: credentials_file {path} is readable by others "
            f"(mode {st.st_mode & 0o777:o}): chmod 600 it"
        )
    core = botocore.session.Session()
    core.set_config_variable("credentials_file", path)
    return boto3.session.Session(botocore_session=core, profile_name=profile)


_EXISTS_CODES = ("PreconditionFailed", "ConditionalRequestConflict")


def _status(e: ClientError) -> int:
    return int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


def _code(e: ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


class S3Node(ObjectNode):
    def __init__(self, info: NodeInfo) -> None:
        self.info = info
        parts = urlsplit(info.url)
        self.bucket = parts.netloc
        self.prefix = parts.path.strip("/")
        params = parse_qs(parts.query)
        self.endpoint = _param(params, "endpoint")
        connect = _number(params, "connect_timeout", 2.0, info.url)
        read = _number(params, "read_timeout", 10.0, info.url)
        retries = int(_number(params, "retries", 3, info.url))
        pool = int(_number(params, "pool", 32, info.url))
        session = _session(_param(params, "profile"), _param(params, "credentials_file"), info)
        signed = session.get_credentials() is not None
        config = Config(
            connect_timeout=connect,
            read_timeout=read,
            retries={"max_attempts": retries, "mode": "standard"},
            max_pool_connections=pool,
            signature_version=None if signed else botocore.UNSIGNED,
            # SeaweedFS and MinIO want path-style addressing; AWS accepts it too.
            s3={"addressing_style": "path"},
            # Every object already carries its own checksum (chunkstore.codec).
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        self._client = session.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=_param(params, "region", session.region_name or "us-east-1"),
            config=config,
        )
        self._lock = threading.Lock()
        self._conditional = True  # If-None-Match on puts, until the server refuses it

    # -- keys -------------------------------------------------------------
    def key(self, cid: bytes) -> str:
        h = check_id(cid).hex()
        return f"{self.prefix}/{h[:2]}/{h}" if self.prefix else f"{h[:2]}/{h}"

    def _err(self, op: str, cid: bytes | None, e: Exception) -> NodeError:
        what = f" {cid.hex()}" if cid is not None else ""
        if isinstance(e, ClientError):
            err = e.response.get("Error", {})
            code = str(err.get("Code", ""))
            if code in _MISSING_CODES:
                return ObjectMissing(f"node {self.name}: no object{what}")
            if code in _NO_BUCKET_CODES:
                return NodeError(f"node {self.name}: bucket {self.bucket} does not exist")
            return NodeError(f"node {self.name}: {op}{what}: {code} {err.get('Message', '')}")
        return NodeError(f"node {self.name}: {op}{what}: {e}")

    # -- the node interface ---------------------------------------------------
    def ensure(self) -> None:
        """Create the bucket if it is missing (format time)."""
        try:
            self._client.head_bucket(Bucket=self.bucket)
            return
        except ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            if code not in ("404", "NoSuchBucket", "NotFound"):
                raise self._err("head bucket", None, e) from e
        except BotoCoreError as e:
            raise self._err("head bucket", None, e) from e
        try:
            self._client.create_bucket(Bucket=self.bucket)
        except ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            if code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise self._err("create bucket", None, e) from e
        except BotoCoreError as e:
            raise self._err("create bucket", None, e) from e

    def put(self, cid: bytes, blob: bytes | memoryview) -> None:
        """A conditional put (If-None-Match: *): an object already under the key is not
        replaced, and is kept if whole (nodes/base.py). A server that refuses the
        condition (NotImplemented) gets head, then put, from then on: a put racing
        another writer's of the same id may then replace it, with the same bytes (ids are
        content), so only a writer that puts garbage under an id can hurt that race, and
        it can do that unconditionally anyway. A damaged or planted object found is
        replaced by an unconditional put (the same race, the same bytes)."""
        body = blob if isinstance(blob, bytes) else bytes(blob)
        key = self.key(cid)
        try:
            if self._conditional:
                try:
                    self._client.put_object(Bucket=self.bucket, Key=key, Body=body, IfNoneMatch="*")
                    return
                except ClientError as e:
                    if _status(e) in (501, 400) and _code(e) not in _EXISTS_CODES:
                        log.warning("node %s: no conditional puts (%s): head, then put",
                                    self.name, _code(e))  # fmt: skip
                        self._conditional = False
                    elif _status(e) not in (409, 412) and _code(e) not in _EXISTS_CODES:
                        raise
            try:
                old = self._client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
            except ClientError as e:
                if not isinstance(self._err("get", cid, e), ObjectMissing):
                    raise
                old = None
            if old is not None and self.keeps(cid, old):
                return
            self._client.put_object(Bucket=self.bucket, Key=key, Body=body)
        except (ClientError, BotoCoreError) as e:
            raise self._err("put", cid, e) from e

    def get(self, cid: bytes) -> bytes:
        try:
            resp = self._client.get_object(Bucket=self.bucket, Key=self.key(cid))
            return resp["Body"].read()
        except (ClientError, BotoCoreError) as e:
            raise self._err("get", cid, e) from e

    def exists(self, cid: bytes) -> bool:
        try:
            self._client.head_object(Bucket=self.bucket, Key=self.key(cid))
            return True
        except (ClientError, BotoCoreError) as e:
            err = self._err("head", cid, e)
            if isinstance(err, ObjectMissing):
                return False
            raise err from e

    def delete(self, cid: bytes) -> None:
        try:
            self._client.delete_object(Bucket=self.bucket, Key=self.key(cid))
        except (ClientError, BotoCoreError) as e:
            err = self._err("delete", cid, e)
            if not isinstance(err, ObjectMissing):
                raise err from e

    def list(self) -> Iterator[tuple[bytes, int, float]]:
        start = f"{self.prefix}/" if self.prefix else ""
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=start
        )
        try:
            for page in pages:
                for obj in page.get("Contents", ()):
                    rel = obj["Key"][len(start) :]
                    fan, _, name = rel.partition("/")
                    try:
                        cid = from_hex(name)
                    except ValueError:
                        continue  # a foreign key under our prefix: not ours to report
                    if fan != name[:2]:
                        continue
                    yield cid, int(obj["Size"]), obj["LastModified"].timestamp()
        except (ClientError, BotoCoreError) as e:
            raise self._err("list", None, e) from e

    def used_bytes(self) -> int:
        return sum(size for _, size, _ in self.list())

    def close(self) -> None:
        with self._lock:
            self._client.close()
