"""Orbax checkpoints written straight to s3://, as orbax writes them to gs://.

orbax-checkpoint (0.12) special-cases `gs://` in two places: its tensorstore specs (arrays go through tensorstore's
`gcs` kvstore; any other path must be an absolute local one: "Checkpoint path should be absolute. Got s3:/...") and
its atomicity (a step on GCS is written under its final name and committed by a `commit_success.txt` written last,
instead of a temporary directory renamed into place, which an object store cannot do atomically). `install()` makes
both treat `s3://` as they treat `gs://`, with tensorstore's `s3` kvstore for the arrays and the commit file for
atomicity; everything else (directories, JSON items, deletion of old steps) already goes through etils.epath, i.e.
s3fs. So every guarantee orbax gives on GCS holds on S3: async saves, several processes writing one checkpoint (each
its own `ocdbt.process_<i>/`), the commit marker written last, an uncommitted step ignored, max_to_keep.

The patch replaces five module attributes and checks that each still exists, so an orbax that moved them fails
loudly at install rather than writing to a local `s3:` folder.
"""

from __future__ import annotations

import os
import threading

_installed = False
_lock = threading.Lock()


def is_s3(path) -> bool:
    return str(path).startswith("s3://")


def s3_kvstore(path: str) -> dict:
    """tensorstore's kvstore spec for an s3:// path: the bucket, the key prefix, and the endpoint and region the AWS
    variables name (R2, MinIO, an emulator), and credentials as the AWS chain finds them: the environment's keys,
    else none at all (a public bucket: unsigned), else tensorstore's default chain (profiles, instance roles)."""
    from olmo3eqx.storage import s3_anonymous

    bucket, _, key = path[len("s3://"):].partition("/")
    spec = {"driver": "s3", "bucket": bucket, "path": key}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        spec["endpoint"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        spec["aws_region"] = region
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        spec["aws_credentials"] = {"type": "environment"}  # the default chain would look for profiles first
    elif s3_anonymous():
        spec["aws_credentials"] = {"type": "anonymous"}
    return spec


def install() -> None:
    """Teach this process's orbax to write and read s3:// checkpoints (idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        from orbax.checkpoint._src.path import atomicity, atomicity_defaults, gcs_utils
        from orbax.checkpoint._src.serialization import tensorstore_utils as tsu

        targets = [(tsu, "_use_gcs_driver"), (tsu, "_normalize_path"), (gcs_utils, "get_kvstore_for_gcs"),
                   (atomicity_defaults, "get_default_temporary_path_class"),
                   (atomicity_defaults, "get_item_default_temporary_path_class")]
        missing = [f"{m.__name__}.{name}" for m, name in targets if not callable(getattr(m, name, None))]
        if missing:
            raise RuntimeError(f"This orbax-checkpoint has no {', '.join(missing)}; olmo3eqx's s3:// checkpoints "
                               f"need orbax-checkpoint 0.12 (pip install 'orbax-checkpoint>=0.12.8,<0.13').")
        use_gcs_driver, normalize, gcs_kvstore = tsu._use_gcs_driver, tsu._normalize_path, gcs_utils.get_kvstore_for_gcs
        default_cls = atomicity_defaults.get_default_temporary_path_class
        item_cls = atomicity_defaults.get_item_default_temporary_path_class

        tsu._use_gcs_driver = lambda directory: is_s3(directory) or use_gcs_driver(directory)
        tsu._normalize_path = lambda p: ("s3://" + os.path.normpath(p[len("s3://"):]) if is_s3(p) else normalize(p))
        gcs_utils.get_kvstore_for_gcs = lambda p: s3_kvstore(p) if is_s3(p) else gcs_kvstore(p)

        def commit_file_on_s3(original):
            def choose(path, *, atomicity_options=None):
                cls = original(path, atomicity_options=atomicity_options)
                # a rename of a directory of objects is a copy: never atomic on a bucket
                return atomicity.CommitFileTemporaryPath if is_s3(path) and cls is rename else cls
            return choose

        rename = atomicity.AtomicRenameTemporaryPath
        atomicity_defaults.get_default_temporary_path_class = commit_file_on_s3(default_cls)
        atomicity_defaults.get_item_default_temporary_path_class = commit_file_on_s3(item_cls)
        _installed = True
