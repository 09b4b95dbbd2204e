"""Where artifacts (and a fleet's weight payloads) live, by key (``videos/<id>.mp4``): a folder every
node mounts, or an S3-compatible bucket.

``artifacts:`` in the deploy file picks it: ``file:///mnt/shared/fv`` (or a plain path), or
``s3://bucket/prefix`` through boto3 (endpoint and credentials from boto3's usual environment:
``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...). Unset: the data dir itself, as before.
Writers stage a file locally (``staging``), then ``put`` it; on a folder backend the staging path
is the final one, so nothing is copied.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from fv_core.errors import ConfigError

CHUNK = 1 << 20


class Storage(Protocol):
    """Artifacts by key, readable from every replica."""

    where: str  # for messages

    def local(self, key: str) -> Path | None:
        """The file of ``key`` where it lives on this node's file system (a folder backend), else None."""

    def staging(self, key: str) -> Path:
        """Where a writer saves ``key`` before ``put``."""

    def put(self, key: str) -> int:
        """Publish the staged file of ``key``; returns its size in bytes."""

    def put_bytes(self, key: str, data: bytes) -> None: ...

    def read(self, key: str) -> bytes: ...

    def chunks(self, key: str) -> Iterator[bytes]: ...

    def exists(self, key: str) -> bool: ...

    def size(self, key: str) -> int:
        """Its size in bytes (0 when it does not exist)."""

    def delete(self, key: str) -> None:
        """Remove ``key`` (and its staged file); missing keys are fine."""

    def link(self, key: str, expires_s: int) -> str | None:
        """A presigned download link (S3), or None."""


class FolderStorage:
    """A folder every node mounts (NFS, a cluster file system), or the data dir of one host."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.where = f"folder {str(self.root)!r}"

    def local(self, key: str) -> Path | None:
        return self.root / key

    def staging(self, key: str) -> Path:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def put(self, key: str) -> int:
        return self.size(key)

    def put_bytes(self, key: str, data: bytes) -> None:
        path = self.staging(key)
        partial = path.with_name(f".{path.name}.partial")  # readers never see half a file
        partial.write_bytes(data)
        partial.replace(path)

    def read(self, key: str) -> bytes:
        return (self.root / key).read_bytes()

    def chunks(self, key: str) -> Iterator[bytes]:
        with (self.root / key).open("rb") as f:
            while block := f.read(CHUNK):
                yield block

    def exists(self, key: str) -> bool:
        return (self.root / key).is_file()

    def size(self, key: str) -> int:
        path = self.root / key
        return path.stat().st_size if path.is_file() else 0

    def delete(self, key: str) -> None:
        (self.root / key).unlink(missing_ok=True)

    def link(self, key: str, expires_s: int) -> str | None:
        return None


class S3Storage:
    """An S3-compatible bucket (AWS S3, MinIO, Ceph, ...): objects under ``prefix``; files are staged in
    this node's ``staging_dir`` and uploaded."""

    def __init__(self, bucket: str, prefix: str, staging_dir: Path) -> None:
        try:
            import boto3
        except ImportError:
            raise ConfigError(
                f"artifacts s3://{bucket}/{prefix} need boto3, which is not installed. "
                "Fix: pip install 'fv-core[s3]'."
            ) from None
        self.bucket, self.prefix, self.stage = bucket, prefix.strip("/"), staging_dir
        self.where = f"bucket s3://{bucket}/{self.prefix}"
        self.s3: Any = boto3.client("s3")
        try:
            self.s3.head_bucket(Bucket=bucket)
        except Exception as exc:
            raise ConfigError(
                f"cannot reach {self.where}: {exc}. Fix: create the bucket, or set AWS_ENDPOINT_URL and "
                "the credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) for it."
            ) from None

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def local(self, key: str) -> Path | None:
        return None

    def staging(self, key: str) -> Path:
        path = self.stage / key
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def put(self, key: str) -> int:
        path = self.stage / key
        size = path.stat().st_size
        self.s3.upload_file(str(path), self.bucket, self._key(key))
        path.unlink()
        return size

    def put_bytes(self, key: str, data: bytes) -> None:
        self.s3.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def read(self, key: str) -> bytes:
        return b"".join(self.chunks(key))

    def chunks(self, key: str) -> Iterator[bytes]:
        try:
            body = self.s3.get_object(Bucket=self.bucket, Key=self._key(key))["Body"]
        except self.s3.exceptions.NoSuchKey:
            raise FileNotFoundError(key) from None
        yield from body.iter_chunks(CHUNK)

    def exists(self, key: str) -> bool:
        return self.size(key) > 0

    def size(self, key: str) -> int:
        try:
            return int(self.s3.head_object(Bucket=self.bucket, Key=self._key(key))["ContentLength"])
        except Exception:
            return 0

    def delete(self, key: str) -> None:
        self.s3.delete_object(Bucket=self.bucket, Key=self._key(key))
        (self.stage / key).unlink(missing_ok=True)

    def link(self, key: str, expires_s: int) -> str | None:
        params = {"Bucket": self.bucket, "Key": self._key(key)}
        return str(self.s3.generate_presigned_url("get_object", Params=params, ExpiresIn=expires_s))


def open_storage(url: str | None, data_dir: Path) -> Storage:
    """The backend ``url`` names (None: the data dir)."""
    if url is None:
        return FolderStorage(data_dir)
    parts = urlsplit(url)
    if parts.scheme == "s3":
        return S3Storage(parts.netloc, parts.path, data_dir / "staging")
    if parts.scheme in ("file", ""):
        return FolderStorage(os.path.expanduser(parts.path if parts.scheme else url))
    raise ConfigError(
        f"artifacts {url!r}: unknown scheme {parts.scheme!r}. Fix: file:///a/shared/path or s3://bucket/prefix."
    )
