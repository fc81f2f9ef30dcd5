"""Appending to an object exactly once (GCS compose, S3 multipart copy), for the run's line-by-line files."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import uuid

from olmo3eqx.errors import ConfigError, StorageError
from olmo3eqx.storage.files import _read_remote, _writable
from olmo3eqx.storage.paths import redact, scheme
from olmo3eqx.storage.retry import _precondition_failed, first_line, retrying
from olmo3eqx.storage.stores import _gcs_client, _key, filesystem


S3_MIN_PART = 5 << 20
"""S3's smallest part of a multipart upload but the last: an object this large is appended to by a server-side copy
into a multipart upload, a smaller one is written again whole (read back, put with the new bytes)."""


@dataclasses.dataclass(frozen=True)
class Version:
    """An object's version as its store names it (GCS generation, S3 ETag) and its size."""

    tag: str
    size: int


def _version(s: str, p: str) -> Version | None:
    bucket, _, key = _key(p).partition("/")
    if s == "gs":
        blob = _gcs_client().bucket(bucket).get_blob(key, retry=None)
        return None if blob is None else Version(str(blob.generation), int(blob.size))
    try:
        head = filesystem(s).call_s3("head_object", Bucket=bucket, Key=key)
    except FileNotFoundError:
        return None
    return Version(head["ETag"], int(head["ContentLength"]))


def append_bytes(p: str, data: bytes) -> None:
    """Add `data` at the end of object `p` (created if absent), once: GCS composes the object with a part uploaded
    beside it, S3 copies it server-side into a multipart upload (an object under S3_MIN_PART is put again whole).
    Each append is atomic (readers see it whole or not at all) and never doubled: the object's version is read
    first, every write is conditional on it, and every retry first looks whether an earlier try landed with its
    answer lost (the object is then that version plus `data`), so a retried append adds nothing. The part object
    of a GCS append is deleted after, apart from the append's retries: a deletion that fails leaves it behind, with
    a warning, and appends nothing again. One writer per object: another's write in between is a StorageError."""
    s = scheme(_writable(p))
    if s is None:
        with open(p, "ab") as f:
            f.write(data)
        return
    before = retrying(lambda: _version(s, p), p)
    part = f"{_key(p)}.part-{uuid.uuid4().hex}" if s == "gs" and before is not None else None

    def append():
        if _appended(s, p, before, data):
            return
        try:
            (_gcs_append if s == "gs" else _s3_append)(p, data, before, part)
        except Exception as e:  # noqa: BLE001 - a refused precondition may be our own earlier try: look
            if not _precondition_failed(e):
                raise
            if not _appended(s, p, before, data):
                raise StorageError(f"Appending to {redact(p)} was refused as if it had changed, but it has not "
                                   f"({first_line(e)}); check the store and relaunch.") from None

    retrying(append, p, "writing")
    if part is not None:
        _remove_part(part)


def _appended(s: str, p: str, before: Version | None, data: bytes) -> bool:
    """Whether object `p` is `before` plus `data` (an earlier try of this append landed): False while it is still
    `before`; StorageError when another writer changed it."""
    now = _version(s, p)
    if now == before:
        return False
    size = before.size if before is not None else 0
    if now is not None and now.size == size + len(data) and _read_remote(s, p, size, now.size) == data:
        return True
    raise StorageError(f"{redact(p)} changed while olmo3eqx appended to it: another process writes it too (one "
                       f"writer per file: give each its own run directory) or it was replaced; relaunch to resume.")


def _gcs_append(p: str, data: bytes, before: Version | None, part: str | None) -> None:
    bucket_name, _, key = _key(p).partition("/")
    bucket = _gcs_client().bucket(bucket_name)
    if before is None:
        bucket.blob(key).upload_from_string(data, if_generation_match=0, retry=None)
        return
    part_blob = bucket.blob(part.partition("/")[2])
    part_blob.upload_from_string(data, retry=None)
    bucket.blob(key).compose([bucket.blob(key), part_blob], if_generation_match=int(before.tag), retry=None)


def _s3_append(p: str, data: bytes, before: Version | None, _part: None) -> None:
    fs = filesystem("s3")
    bucket, _, key = _key(p).partition("/")
    if before is None:
        fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
    elif before.size < S3_MIN_PART:
        old = _read_remote("s3", p, 0, before.size) if before.size else b""
        fs.call_s3("put_object", Bucket=bucket, Key=key, Body=old + data, IfMatch=before.tag)
    else:
        upload = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
        try:
            copied = fs.call_s3("upload_part_copy", Bucket=bucket, Key=key, UploadId=upload, PartNumber=1,
                                CopySource={"Bucket": bucket, "Key": key}, CopySourceIfMatch=before.tag)
            added = fs.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload, PartNumber=2, Body=data)
            fs.call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload, IfMatch=before.tag,
                       MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": copied["CopyPartResult"]["ETag"]},
                                                  {"PartNumber": 2, "ETag": added["ETag"]}]})
        except BaseException:
            with contextlib.suppress(Exception):  # after a lost answer to the completion there is nothing to abort
                fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload)
            raise


def _remove_part(part: str) -> None:
    """Delete a GCS append's part object (bucket/key); a failure leaves it behind with a warning: the append it
    served is done either way."""
    bucket_name, _, key = part.partition("/")
    url = f"gs://{part}"
    try:
        retrying(lambda: _gcs_client().bucket(bucket_name).blob(key).delete(retry=None), url, "deleting")
    except FileNotFoundError:
        pass
    except (StorageError, ConfigError) as e:
        print(f"warning: {e}; the append it was a part of is complete: delete {redact(url)} by hand.",
              file=sys.stderr, flush=True)
