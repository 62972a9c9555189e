"""The artifact store: where rollouts, scored batches and checkpoints live.

Keys are POSIX paths like `demo/00003/adapter`. `LocalStore` maps them under a directory;
`S3Store` maps them under `s3://bucket/prefix/` through boto3, with a configurable endpoint
(AWS, MinIO, moto's server, ...). Both return a URI for metadata and can fetch a directory to
local disk for loading.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from tinker_pipelines.tracking import codec

RECORD = "record.json"
"""A checkpoint's record (`checkpoint.RECORD`; not imported: that module loads torch, and the Dagster
daemon and webserver open this package without the ML stack)."""


class ArtifactStore(Protocol):
    def uri(self, key: str) -> str: ...
    def put_bytes(self, key: str, data: bytes) -> str: ...
    def get_bytes(self, key: str) -> bytes: ...
    def exists(self, key: str) -> bool: ...
    def put_dir(self, local: Path, key: str) -> str: ...
    def local_dir(self, key: str) -> Path: ...


class LocalStore:
    """A directory on local disk (the embedded default, or a shared file system)."""

    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()

    def path(self, key: str) -> Path:
        return self.root / key

    def uri(self, key: str) -> str:
        return str(self.path(key))

    def put_bytes(self, key: str, data: bytes) -> str:
        p = self.path(key)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.tmp")
        tmp.write_bytes(data)
        tmp.replace(p)
        return str(p)

    def get_bytes(self, key: str) -> bytes:
        return self.path(key).read_bytes()

    def exists(self, key: str) -> bool:
        return self.path(key).exists()

    def put_dir(self, local: Path, key: str) -> str:
        dest = self.path(key)
        if Path(local).resolve() != dest:
            shutil.rmtree(dest, ignore_errors=True)
            shutil.copytree(local, dest)
        return str(dest)

    def local_dir(self, key: str) -> Path:
        """The directory itself: nothing to download."""
        p = self.path(key)
        if not p.is_dir():
            raise FileNotFoundError(f"no directory {key!r} in the artifact store {self.root}")
        return p

    def write_dir(self, key: str) -> Path:
        """Where a writer can build the directory in place (checkpoints are atomic already)."""
        return self.path(key)


class ArtifactStoreError(OSError):
    """The artifact store cannot be reached or refuses a request; the message names the bucket and the cause."""


_CREDENTIAL_CODES = ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ExpiredToken",
                     "InvalidToken", "InvalidClientTokenId", "AuthorizationHeaderMalformed")


class S3Store:
    """`s3://bucket/prefix` through boto3; `endpoint_url` for MinIO, moto, other S3-compatibles.

    botocore's errors are turned into `ArtifactStoreError` naming the bucket (a missing bucket,
    refused credentials, an unreachable endpoint) and a missing object into `FileNotFoundError`,
    as `LocalStore` does."""

    def __init__(self, uri: str, endpoint_url: str | None = None, cache_dir: str | Path = ".tinker/cache",
                 **client_kwargs: Any):
        import boto3

        u = urlparse(uri)
        if u.scheme != "s3" or not u.netloc:
            raise ValueError(f"artifact store uri must look like s3://bucket/prefix, got {uri!r}")
        self.bucket, self.prefix = u.netloc, u.path.strip("/")
        self.cache_dir = Path(cache_dir)
        self.endpoint_url = endpoint_url
        self.client = boto3.client("s3", endpoint_url=endpoint_url or None, **client_kwargs)

    @contextlib.contextmanager
    def _errors(self, key: str):
        import botocore.exceptions as be
        from boto3.exceptions import S3TransferFailedError, S3UploadFailedError

        where = f"s3://{self.bucket}" + (f" at {self.endpoint_url}" if self.endpoint_url else "")
        try:
            yield
        except (be.NoCredentialsError, be.PartialCredentialsError) as e:
            raise ArtifactStoreError(f"no usable AWS credentials for {where} ({e}); set AWS_ACCESS_KEY_ID "
                                     "and AWS_SECRET_ACCESS_KEY or a profile") from None
        except be.EndpointConnectionError as e:
            raise ArtifactStoreError(f"cannot reach the S3 endpoint for {where}: {e}") from None
        except (be.ClientError, S3UploadFailedError, S3TransferFailedError) as e:
            # boto3's transfer errors wrap the ClientError that says what went wrong
            cause = e if isinstance(e, be.ClientError) else e.__cause__ or e.__context__
            err = cause.response.get("Error", {}) if isinstance(cause, be.ClientError) else {}
            code, msg = str(err.get("Code", "")), err.get("Message", "") or str(e)
            if code == "NoSuchBucket":
                raise ArtifactStoreError(f"S3 bucket {self.bucket!r} does not exist ({where}); create it or fix the "
                                         "artifact store URI") from None
            if code in _CREDENTIAL_CODES or code == "403":
                raise ArtifactStoreError(f"S3 refused the credentials for {where} ({code}: {msg}); check "
                                         "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and the bucket's policy") from None
            if code in ("NoSuchKey", "404"):
                raise FileNotFoundError(f"no object {self.uri(key)!r} in the artifact store") from None
            raise ArtifactStoreError(f"S3 request for {self.uri(key)} failed ({code or type(e).__name__}: {msg})") from None

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._key(key)}"

    def put_bytes(self, key: str, data: bytes) -> str:
        with self._errors(key):
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)
        return self.uri(key)

    def get_bytes(self, key: str) -> bytes:
        with self._errors(key):
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()

    def exists(self, key: str) -> bool:
        with self._errors(key):
            resp = self.client.list_objects_v2(Bucket=self.bucket, Prefix=self._key(key), MaxKeys=1)
        return resp.get("KeyCount", 0) > 0

    def put_dir(self, local: Path, key: str) -> str:
        """Upload every file under `local`; a checkpoint's `record.json` goes last, so a crash
        mid-upload never leaves a record beside missing tensors (the record is the commit marker)."""
        local = Path(local)
        files = sorted((f for f in local.rglob("*") if f.is_file()), key=lambda f: (f == local / RECORD, f))
        with self._errors(key):
            for f in files:
                self.client.upload_file(str(f), self.bucket, self._key(f"{key}/{f.relative_to(local).as_posix()}"))
        return self.uri(key)

    def local_dir(self, key: str) -> Path:
        """Download every object under `key/` into the local cache and return that directory."""
        dest = self.cache_dir / self.bucket / self._key(key)
        prefix = self._key(key).rstrip("/") + "/"
        found = False
        with self._errors(key):
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
                for obj in page.get("Contents", []):
                    found = True
                    target = dest / obj["Key"][len(prefix):]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    self.client.download_file(self.bucket, obj["Key"], str(target))
        if not found:
            raise FileNotFoundError(f"no directory {self.uri(key)!r} in the artifact store")
        return dest

    def write_dir(self, key: str) -> Path:
        """A local staging directory; call `put_dir(path, key)` after writing it."""
        return self.cache_dir / self.bucket / self._key(key)


def open_store(uri: str | Path, endpoint_url: str | None = None, cache_dir: str | Path = ".tinker/cache",
               **client_kwargs: Any) -> LocalStore | S3Store:
    """`s3://bucket/prefix` -> `S3Store`; anything else is a local directory."""
    if str(uri).startswith("s3://"):
        return S3Store(str(uri), endpoint_url=endpoint_url, cache_dir=cache_dir, **client_kwargs)
    return LocalStore(uri)


def dumps(obj: Any) -> bytes:
    """Serialize trajectories / datums / preference pairs for the store (tagged JSON: `codec`)."""
    return codec.encode(obj)


def loads(data: bytes) -> Any:
    """Inverse of `dumps`; refuses pickles and anything else that is not the codec's JSON, running nothing."""
    return codec.decode(data)
