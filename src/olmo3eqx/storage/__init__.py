"""One notion of a path for everything a run reads or writes: a local path, or a URL.

- `gs://bucket/key` (Google Cloud Storage) and `s3://bucket/key` (Amazon S3 and S3-compatible stores: R2, MinIO, ...):
  read and written, through fsspec's gcsfs and s3fs (the `cloud` extra: `pip install -e ".[cloud]"`), which
  orbax's paths (etils.epath) use too, so a checkpoint and a metrics file reach a bucket with the same credentials.
- `http://` and `https://`: read only (token files, mix roots, task files), one HTTP Range request per read
  (requests, a core dependency); a server that ignores Range is an error, never a whole-file download.
- Any other scheme is refused with one sentence naming it (`check`), before any work; a URL never becomes a local
  path (`pathlib.Path("s3://b/x")` is the relative path `s3:/b/x`: nothing here builds one from a URL).

Credentials are each ecosystem's own: GCS application-default credentials (anonymous when there are none), the AWS
chain (environment, profiles, instance roles; unsigned requests when there are none), none for http(s). The endpoint
variables are honoured: `STORAGE_EMULATOR_HOST` (and, from it, tensorstore's `TENSORSTORE_GCS_HTTP_URL`),
`AWS_ENDPOINT_URL` / `AWS_ENDPOINT_URL_S3`. `redact` strips credentials and signatures from a URL before it is
printed or stored.

Failures are told apart by the exception's type (`failure_kind`): a missing object is FileNotFoundError, a denied
one (401/403, or no credentials) `AccessDenied`, another 4xx answer or a malformed URL `BadRequest`, each permanent
and named in one sentence at once. Transient ones (connection errors, timeouts, 408/425/429/5xx) are retried with
exponential backoff for up to `retry_seconds()` (120 s; `OLMO3EQX_STORAGE_RETRY_SECONDS`), then `StorageError`
(exit 74: relaunch to resume once the store is back), as is a ranged read that stays short.

The package, one job a module (the names below are its API, imported from here: `from olmo3eqx import storage`):
`paths` (schemes, joining, redaction), `stores` (fsspec file systems, endpoints, credentials, path objects),
`retry` (what a failure means, retrying transient ones), `ranged` (http(s) Range reads), `files` (reads and writes),
`append` (appending to an object exactly once), `versioned` (conditional writes: the run lease).
"""

from olmo3eqx.errors import StorageError  # noqa: F401 - storage.StorageError, as before
from olmo3eqx.storage.paths import (  # noqa: F401
    WRITABLE, READ_ONLY, CLOUD_EXTRA, UnsupportedPath, MissingExtra, scheme, is_url, check, join, basename, parent,
    redact, redact_tree, local_cache_dir,
)
from olmo3eqx.storage.stores import (  # noqa: F401
    StorePath, path, configure_endpoints, s3_anonymous, filesystem, forget_listings, describe,
)
from olmo3eqx.storage.retry import (  # noqa: F401
    RETRY_SECONDS, RETRY_FIRST_S, RETRY_MAX_S, AccessDenied, BadRequest, HttpStatus, TRANSIENT_HTTP,
    TRANSIENT_ERRNOS, http_kind, failure_kind, retry_seconds, first_line, WARN_EVERY_S, retrying, credentials_hint,
)
from olmo3eqx.storage.ranged import (  # noqa: F401
    HTTP_TIMEOUT_S, RangeIgnored, HEAD_REFUSED,
)
from olmo3eqx.storage.files import (  # noqa: F401
    SHORT_READ_TRIES, READ_THREADS, size, exists, isfile, isdir, listdir, glob, read_bytes, read_many, read_text,
    makedirs, write_bytes, write_text, remove, rmtree, upload_tree,
)
from olmo3eqx.storage.append import (  # noqa: F401
    S3_MIN_PART, Version, append_bytes,
)
from olmo3eqx.storage.versioned import (  # noqa: F401
    read_versioned, write_versioned,
)
