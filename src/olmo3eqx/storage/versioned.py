"""Conditional writes on an object's version (GCS generation, S3 ETag): the run lease's primitive."""

from __future__ import annotations

from olmo3eqx.storage.files import _writable
from olmo3eqx.storage.retry import _precondition_failed, failure_kind, retrying
from olmo3eqx.storage.paths import scheme
from olmo3eqx.storage.stores import _gcs_client, _key, filesystem


def _gcs_blob(url: str):
    bucket, _, key = _key(url).partition("/")
    return _gcs_client().bucket(bucket).blob(key)


def read_versioned(p: str) -> tuple[bytes, str, float] | None:
    """(content, version, server time of the last write in unix seconds) of object `p`, None when it does not exist;
    the version (a GCS generation, an S3 ETag) is what write_versioned compares against. The clients' own retries
    are off: `retrying` bounds them."""
    s = scheme(_writable(p))
    if s == "gs":
        def read():
            bucket, _, key = _key(p).partition("/")
            while True:
                blob = _gcs_client().bucket(bucket).get_blob(key, retry=None)  # metadata: generation, time
                if blob is None:
                    return None
                try:  # the content of that generation, or a new look when the object changed in between
                    data = blob.download_as_bytes(if_generation_match=blob.generation, retry=None)
                except Exception as e:  # noqa: BLE001
                    if failure_kind(e) == "missing" or getattr(e, "code", None) == 412:
                        continue
                    raise
                return data, str(blob.generation), blob.updated.timestamp()
        return retrying(read, p)
    fs = filesystem(s)
    bucket, _, key = _key(p).partition("/")

    async def get():
        out = await fs._call_s3("get_object", Bucket=bucket, Key=key)
        async with out["Body"] as body:
            return await body.read(), out["ETag"], out["LastModified"].timestamp()

    def read():
        import fsspec.asyn

        try:
            return fsspec.asyn.sync(fs.loop, get)
        except FileNotFoundError:
            return None
    return retrying(read, p)


def write_versioned(p: str, data: bytes, expect: str | None) -> str | None:
    """Write object `p` only if it is still at version `expect` (None: only if it does not exist yet); the new
    version, or None when another writer got there first (a refusal after a retry whose first try landed with its
    answer lost finds `data` there: the write is ours). (No conditional delete: fake-gcs-server ignores its
    precondition, so the lease releases by writing an empty record instead.)"""
    s = scheme(_writable(p))
    if s == "gs":
        def write():
            blob = _gcs_blob(p)
            try:
                blob.upload_from_string(data, if_generation_match=0 if expect is None else int(expect), retry=None)
            except Exception as e:  # noqa: BLE001
                if _precondition_failed(e):
                    return _ours(p, data)
                raise
            return str(blob.generation)
        return retrying(write, p, "writing")
    fs = filesystem(s)
    bucket, _, key = _key(p).partition("/")
    condition = {"IfNoneMatch": "*"} if expect is None else {"IfMatch": expect}

    def write():
        try:
            out = fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **condition)
        except OSError as e:
            if _precondition_failed(e):
                return _ours(p, data)
            raise
        return out["ETag"]
    return retrying(write, p, "writing")


def _ours(p: str, data: bytes) -> str | None:
    """After a conditional write of `data` was refused: the object's version if it holds `data` (an earlier try
    of the same write landed, its answer lost), else None (another writer's)."""
    current = read_versioned(p)
    return current[1] if current is not None and current[0] == data else None
