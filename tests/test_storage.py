"""olmo3eqx.storage against real servers on 127.0.0.1 (tests/stores.py): fake-gcs-server, moto's S3 and a web
server whose Range handling the tests switch. Every read returns exactly the bytes asked or an error naming the URL."""

import os
import re
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from olmo3eqx import exits, storage
from olmo3eqx.config import ConfigError

BUCKETS = ("gs", "s3")


@pytest.fixture
def prefix(stores, request):
    """A fresh prefix in the test bucket of each store."""
    name = re.sub(r"[^A-Za-z0-9_-]", "-", request.node.name)[:40]
    return lambda scheme: stores.url(scheme, f"{name}-{uuid.uuid4().hex[:6]}")


# --- paths -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["az://container/x", "hdfs://namenode/data", "ftp://host/file.npy", "hf://org/x"])
def test_a_scheme_nothing_reads_is_refused_with_one_sentence_naming_it(url):
    with pytest.raises(storage.UnsupportedPath) as e:
        storage.check(url, "data.paths")
    scheme = url.split("://")[0]
    assert f"{scheme}://" in str(e.value) and "data.paths" in str(e.value) and str(e.value).count(".") <= 3
    with pytest.raises(storage.UnsupportedPath):
        storage.path(url, "run.dir", write=True)


def test_http_is_read_only_and_never_a_directory():
    assert storage.check("https://olmo-data.org/x.npy", "data.paths") == "https://olmo-data.org/x.npy"
    with pytest.raises(storage.UnsupportedPath, match="only reads"):
        storage.check("https://olmo-data.org/runs", "run.dir", write=True)
    with pytest.raises(storage.UnsupportedPath, match="cannot be listed"):
        storage.path("https://olmo-data.org/ckpt", "init_from")
    with pytest.raises(storage.UnsupportedPath, match="cannot be listed"):
        storage.glob("https://olmo-data.org/*.npy")


def test_local_paths_stay_pathlib_and_urls_never_become_local(tmp_path, stores):
    assert storage.path("~/x", "run.dir") == Path(os.path.expanduser("~/x"))
    assert type(storage.path(str(tmp_path), "run.dir")) is type(tmp_path)
    for scheme in BUCKETS:
        p = storage.path(f"{scheme}://bucket/run", "run.dir", write=True) / "checkpoints"
        assert str(p) == f"{scheme}://bucket/run/checkpoints"
    assert storage.join("s3://b/run/", "tb", "events") == "s3://b/run/tb/events"
    assert storage.parent("gs://b/run/metrics.jsonl") == "gs://b/run" and storage.basename("gs://b/a/x.npy") == "x.npy"


def test_redact_removes_credentials_and_signatures():
    assert storage.redact("https://user:secret@host/a.npy?X-Amz-Signature=abc&X-Amz-Credential=k") == \
        "https://***@host/a.npy?***"
    assert storage.redact("gs://bucket/a.npy") == "gs://bucket/a.npy"
    assert storage.redact_tree({"data": {"paths": ["https://u:p@h/a.npy", "local.npy"]}, "n": 3}) == \
        {"data": {"paths": ["https://***@h/a.npy", "local.npy"]}, "n": 3}


# --- buckets ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", BUCKETS)
def test_bucket_reads_and_writes(prefix, scheme):
    base = prefix(scheme)
    data = np.arange(5000, dtype=np.uint32).tobytes()
    storage.write_bytes(storage.join(base, "d", "a.npy"), data)
    storage.write_bytes(storage.join(base, "d", "sub", "b.npy"), data[:400])
    storage.write_text(storage.join(base, "d", "c.txt"), "hello")
    assert storage.size(storage.join(base, "d", "a.npy")) == len(data)
    assert storage.read_bytes(storage.join(base, "d", "a.npy"), 4000, 4008) == data[4000:4008]
    assert storage.read_bytes(storage.join(base, "d", "c.txt")) == b"hello"
    assert storage.isdir(storage.join(base, "d")) and not storage.isfile(storage.join(base, "d"))
    assert storage.isfile(storage.join(base, "d", "a.npy")) and not storage.exists(storage.join(base, "d", "zz"))
    assert storage.glob(storage.join(base, "d", "*.npy")) == [storage.join(base, "d", "a.npy")]
    assert storage.glob(storage.join(base, "d", "**", "*.npy")) == [storage.join(base, "d", "a.npy"),
                                                                     storage.join(base, "d", "sub", "b.npy")]
    assert storage.listdir(storage.join(base, "d")) == [storage.join(base, "d", x) for x in ("a.npy", "c.txt", "sub")]
    got = storage.read_many([(storage.join(base, "d", "a.npy"), 4 * i, 4 * i + 40) for i in range(30)])
    assert got == [data[4 * i:4 * i + 40] for i in range(30)]
    storage.remove(storage.join(base, "d", "c.txt"))
    assert not storage.exists(storage.join(base, "d", "c.txt"))
    with pytest.raises(FileNotFoundError, match=storage.join(base, "d", "missing.npy")):
        storage.read_bytes(storage.join(base, "d", "missing.npy"), 0, 8)


@pytest.mark.parametrize("scheme", BUCKETS)
def test_a_read_past_the_end_is_an_error_never_fewer_bytes(prefix, scheme):
    url = storage.join(prefix(scheme), "short.npy")
    storage.write_bytes(url, b"x" * 100)
    with pytest.raises(storage.StorageError, match=f"{url} returned 10 bytes for bytes 90-109") as e:
        storage.read_bytes(url, 90, 110)
    assert e.value.code == exits.STORAGE  # the file changed or the store truncates: a relaunch reads it again


@pytest.mark.parametrize("scheme", BUCKETS)
def test_append_keeps_every_line_in_order(prefix, scheme):
    url = storage.join(prefix(scheme), "metrics.jsonl")
    lines = [f'{{"step": {i}}}\n'.encode() for i in range(5)]
    for line in lines:
        storage.append_bytes(url, line)
    assert storage.read_bytes(url) == b"".join(lines)
    assert storage.listdir(storage.parent(url)) == [url]  # no part object left beside it


class AnswerLost(Exception):
    pass


def lose_first_answer(monkeypatch, owner, name: str, when=lambda *a, **k: True):
    """`owner.name` does its work, then (the first time `when` holds for its arguments) raises the ConnectionError of
    an answer lost on the way back: the write landed, the client cannot know."""
    import requests

    real, lost = getattr(owner, name), []

    def answer_lost(*args, **kwargs):
        out = real(*args, **kwargs)
        if not lost and when(*args, **kwargs):
            lost.append(name)
            raise requests.exceptions.ConnectionError("connection reset before the answer (test)")
        return out

    monkeypatch.setattr(owner, name, answer_lost)
    return lost


def test_an_append_whose_answer_is_lost_is_not_appended_again(prefix, monkeypatch):
    """GCS: the compose lands and its answer is lost; the retry finds the object at its old generation plus the
    line and adds nothing. S3: the same for the conditional put (small objects) and the multipart completion (an
    object of S3_MIN_PART and more, appended by a server-side copy). And an object's first write, on both."""
    from google.cloud.storage import Blob

    fs = storage.filesystem("s3")
    cases = [  # (scheme, owner, method, which calls lose their answer, bytes already there (None: no object))
        ("gs", Blob, "compose", lambda *a, **k: True, b"0\n"),
        ("gs", Blob, "upload_from_string", lambda *a, **k: k.get("if_generation_match") == 0, None),
        ("s3", fs, "call_s3", lambda method, **k: method == "put_object" and "IfMatch" in k, b"0\n"),
        ("s3", fs, "call_s3", lambda method, **k: method == "complete_multipart_upload",
         b"h" * storage.S3_MIN_PART + b"\n"),
        ("s3", fs, "call_s3", lambda method, **k: method == "put_object" and "IfNoneMatch" in k, None)]
    for scheme, owner, name, when, there in cases:
        url = storage.join(prefix(scheme), "metrics.jsonl")
        if there is not None:
            storage.write_bytes(url, there)
        with monkeypatch.context() as m:
            lost = lose_first_answer(m, owner, name, when)
            storage.append_bytes(url, b'{"step": 1}\n')
        assert lost == [name], (scheme, name)
        assert storage.read_bytes(url) == (there or b"") + b'{"step": 1}\n', (scheme, name)
        assert storage.listdir(storage.parent(url)) == [url]  # no part object left beside it


def test_a_versioned_write_whose_answer_is_lost_is_still_ours(prefix, monkeypatch):
    from google.cloud.storage import Blob

    fs = storage.filesystem("s3")
    for scheme, owner, name in (("gs", Blob, "upload_from_string"), ("s3", fs, "call_s3")):
        url = storage.join(prefix(scheme), "trainer.lock")
        with monkeypatch.context() as m:
            lost = lose_first_answer(m, owner, name)
            version = storage.write_versioned(url, b"mine", None)
        assert lost == [name] and version is not None and storage.read_versioned(url)[:2] == (b"mine", version)


def test_a_part_that_cannot_be_deleted_is_left_with_a_warning_and_nothing_appended_twice(prefix, monkeypatch, capfd):
    from google.api_core import exceptions as gexc
    from google.cloud.storage import Blob

    url = storage.join(prefix("gs"), "metrics.jsonl")
    storage.append_bytes(url, b"1\n")
    monkeypatch.setenv("OLMO3EQX_STORAGE_RETRY_SECONDS", "1")

    def unavailable(*args, **kwargs):
        raise gexc.ServiceUnavailable("deleting is down (test)")

    with monkeypatch.context() as m:
        m.setattr(Blob, "delete", unavailable)
        storage.append_bytes(url, b"2\n")
    assert storage.read_bytes(url) == b"1\n2\n"
    err = capfd.readouterr().err
    assert "metrics.jsonl.part-" in err and "the append it was a part of is complete" in err, err
    left = [p for p in storage.listdir(storage.parent(url)) if p != url]
    assert len(left) == 1 and storage.basename(left[0]).startswith("metrics.jsonl.part-")
    storage.append_bytes(url, b"3\n")
    assert storage.read_bytes(url) == b"1\n2\n3\n"


def test_an_append_refuses_to_write_over_another_writers_change(prefix, monkeypatch):
    """Between reading an object's version and appending, another writer replaced it: a StorageError, nothing
    written over its bytes."""
    for scheme in BUCKETS:
        url = storage.join(prefix(scheme), "metrics.jsonl")
        storage.append_bytes(url, b"1\n")
        real = storage.append._version
        with monkeypatch.context() as m:
            def version_then_replaced(s, p, calls=[]):
                out = real(s, p)
                if not calls:
                    calls.append(1)
                    storage.write_bytes(url, b"someone else\n")
                return out
            m.setattr(storage.append, "_version", version_then_replaced)
            with pytest.raises(storage.StorageError, match="changed while olmo3eqx appended to it"):
                storage.append_bytes(url, b"2\n")
        assert storage.read_bytes(url) == b"someone else\n", scheme


@pytest.mark.parametrize("scheme", BUCKETS)
def test_versioned_writes_let_one_writer_win(prefix, scheme):
    url = storage.join(prefix(scheme), "trainer.lock")
    assert storage.read_versioned(url) is None
    v1 = storage.write_versioned(url, b"a", None)
    assert v1 is not None and storage.write_versioned(url, b"b", None) is None  # exists: a second create loses
    data, version, written = storage.read_versioned(url)
    assert (data, version) == (b"a", v1) and abs(written - time.time()) < 120
    v2 = storage.write_versioned(url, b"c", v1)
    assert v2 is not None and v2 != v1 and storage.write_versioned(url, b"d", v1) is None  # v1 is stale
    assert storage.read_versioned(url)[0] == b"c"


# --- http(s) ---------------------------------------------------------------------------------------


@pytest.fixture
def served(stores, tmp_path):
    data = np.random.default_rng(0).integers(0, 2**32, 10_000, dtype=np.uint32).tobytes()
    name = f"tokens-{uuid.uuid4().hex[:6]}.npy"
    (tmp_path / name).write_bytes(data)
    return stores.publish(tmp_path / name, "data", name), data


def test_http_reads_one_range_request_each(stores, served):
    url, data = served
    assert storage.size(url) == len(data)
    stores.http.server.requests.clear()
    assert storage.read_bytes(url, 4096, 4096 + 256) == data[4096:4096 + 256]
    assert stores.http.server.requests == [("GET", url.split(stores.http.url)[1], "bytes=4096-4351")]


def test_a_server_that_ignores_range_is_an_error_naming_the_url(stores, served):
    url, _ = served
    with stores.http.mode("ignore"), pytest.raises(storage.RangeIgnored) as e:
        storage.read_bytes(url, 4096, 4096 + 256)
    assert url in str(e.value) and "Range" in str(e.value)


def test_a_short_body_is_an_error_never_fewer_tokens(stores, served):
    url, _ = served
    with stores.http.mode("truncate"), pytest.raises(storage.StorageError) as e:
        storage.read_bytes(url, 4096, 4096 + 256)
    assert url in str(e.value) and "returned 128 bytes" in str(e.value) and e.value.code == exits.STORAGE


def test_a_url_presigned_for_get_is_sized_by_a_ranged_get(stores, tmp_path):
    """A URL signed for GET refuses HEAD with 403 (stores.py's /get-only/): its size comes from the Content-Range of
    a one-byte ranged GET, and it is read as any other."""
    data = bytes(range(256)) * 40
    (tmp_path / "t.npy").write_bytes(data)
    url = stores.publish(tmp_path / "t.npy", "get-only", f"t-{uuid.uuid4().hex[:6]}.npy") + "?X-Amz-Signature=abc"
    stores.http.server.requests.clear()
    assert storage.size(url) == len(data) and storage.exists(url)
    assert stores.http.server.requests[0] == ("GET", url.split(stores.http.url)[1].split("?")[0], "bytes=0-0")
    assert storage.read_bytes(url, 1000, 1010) == data[1000:1010]


def test_a_malformed_url_and_a_refused_request_fail_at_once(stores, monkeypatch):
    """A URL requests cannot send and a 4xx other than 401/403/404/408/425/429 are permanent: one sentence naming
    the URL at once, not two minutes of retries."""
    monkeypatch.setenv("OLMO3EQX_STORAGE_RETRY_SECONDS", "30")
    t = time.monotonic()
    for url in ("http://127.0.0.1:notaport/x.npy", "http://u:secret@[127.0.0.1/x.npy?sig=secret"):
        with pytest.raises(storage.BadRequest, match="was refused .*check the URL") as e:
            storage.read_bytes(url, 0, 8)
        assert e.value.code == exits.BAD_INPUT and "secret" not in str(e.value)
    with pytest.raises(storage.BadRequest, match="bad-request/x.npy was refused .*HTTP 400"):
        storage.read_bytes(stores.url("http", "bad-request", "x.npy"), 0, 8)
    assert time.monotonic() - t < 5


def test_http_missing_and_denied_are_permanent(stores):
    with pytest.raises(FileNotFoundError, match="nothing-here.npy does not exist"):
        storage.read_bytes(stores.url("http", "nothing-here.npy"), 0, 8)
    t = time.monotonic()
    with pytest.raises(storage.AccessDenied, match="denied/x.npy was denied"):
        storage.size(stores.url("http", "denied", "x.npy"))
    assert time.monotonic() - t < 5  # not retried


def test_transient_http_failures_are_retried(stores, served, capfd, monkeypatch):
    url, data = served
    monkeypatch.setattr(storage.retry, "_warned", {})  # a warning earlier in the session would silence this one
    stores.http.server.failures[url.split(stores.http.url)[1]] = 2  # two 503s, then the file
    assert storage.read_bytes(url, 0, 64) == data[:64]
    err = capfd.readouterr().err
    assert err.count("warning: reading") == 1 and "503" in err and "retrying" in err


def test_a_store_that_stays_away_stops_with_a_storage_error(stores, prefix, monkeypatch):
    url = storage.join(prefix("s3"), "x.bin")
    storage.write_bytes(url, b"0123456789")
    monkeypatch.setenv("OLMO3EQX_STORAGE_RETRY_SECONDS", "3")
    with stores.down("s3"), pytest.raises(storage.StorageError) as e:
        storage.read_bytes(url, 0, 4)
    assert url in str(e.value) and "failed for 3 s" in str(e.value) and "relaunch" in str(e.value)


def test_a_store_back_within_the_retries_loses_nothing(stores, prefix):
    url = storage.join(prefix("s3"), "x.bin")
    storage.write_bytes(url, b"0123456789")
    with stores.down("s3"):
        threading.Timer(2.0, stores.relays["s3"].up).start()
        assert storage.read_bytes(url, 2, 6) == b"2345"
        stores.relays["s3"].down()  # the context manager brings it up again


def test_failures_are_classified_as_each_library_reports_them():
    """What gcsfs, s3fs/botocore, google-cloud-storage, requests, aiohttp and urllib3 raise for a denied, missing,
    refused or failing request, decided by type (the emulators check no credentials, so the denied cases are the
    libraries' own exception types). requests' exceptions are OSErrors without an errno: a malformed URL must not
    pass for a server error."""
    import aiohttp
    import botocore.exceptions
    import requests
    import urllib3.exceptions
    from google.api_core import exceptions as gexc

    def client_error(status, code):
        return botocore.exceptions.ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}},
                                               "GetObject")

    denied = [OSError("Forbidden: test/o\nAccess denied."), PermissionError("Access Denied"),
              botocore.exceptions.NoCredentialsError(), gexc.Forbidden("no"), storage.HttpStatus(403, "https://h/x"),
              client_error(403, "AccessDenied")]
    missing = [FileNotFoundError("test/x"), gexc.NotFound("no"), storage.HttpStatus(404, "https://h/x"),
               client_error(404, "NoSuchKey")]
    transient = [storage.HttpStatus(503, "https://h/x"), storage.HttpStatus(429, "https://h/x"),
                 gexc.ServiceUnavailable("later"), gexc.RetryError("gave up", None),
                 requests.exceptions.ConnectionError("refused"), requests.exceptions.ReadTimeout("slow"),
                 requests.exceptions.ChunkedEncodingError("cut"), ConnectionRefusedError(111, "refused"),
                 TimeoutError("slow"), botocore.exceptions.EndpointConnectionError(endpoint_url="http://h"),
                 botocore.exceptions.ReadTimeoutError(endpoint_url="http://h"), client_error(500, "InternalError"),
                 aiohttp.ServerDisconnectedError(), aiohttp.ClientPayloadError("cut"),
                 urllib3.exceptions.ProtocolError("reset"), OSError("server error")]
    refused = [storage.HttpStatus(400, "https://h/x"), storage.HttpStatus(416, "https://h/x"),
               requests.exceptions.InvalidURL("Failed to parse"), requests.exceptions.MissingSchema("no scheme"),
               requests.exceptions.SSLError("bad certificate"), aiohttp.InvalidURL("http://[x"),
               urllib3.exceptions.LocationParseError("h:port"), client_error(400, "InvalidRequest")]
    bugs = [ValueError("a bug"), KeyError("x"), FileExistsError("x"),
            botocore.exceptions.ParamValidationError(report="bad parameter")]
    for kind, errors in (("denied", denied), ("missing", missing), ("transient", transient), ("refused", refused),
                         (None, bugs)):
        got = [storage.failure_kind(e) for e in errors]
        assert got == [kind] * len(errors), [(type(e).__name__, k) for e, k in zip(errors, got) if k != kind]


def test_no_credential_or_signature_reaches_config_yaml(tmp_path):
    from olmo3eqx.config import DataConfig, TrainConfig, dump_yaml

    signed = "https://user:secret@data.example/x.npy?X-Amz-Signature=deadbeef"
    dump_yaml(TrainConfig(data=DataConfig(paths=(signed,))), tmp_path / "config.yaml")
    text = (tmp_path / "config.yaml").read_text()
    assert "secret" not in text and "deadbeef" not in text and "https://***@data.example/x.npy?***" in text


def test_an_ending_process_does_not_wait_out_its_readers_retries():
    """A reader thread retrying an unreachable store (grain's prefetch threads are concurrent.futures workers, joined
    at exit) gives up when the interpreter ends: the exit does not hang for the retry window (10 minutes here)."""
    import subprocess
    import sys

    code = ("import concurrent.futures, time; from olmo3eqx import storage; "
            "concurrent.futures.ThreadPoolExecutor(1).submit(storage.read_bytes, 'http://127.0.0.1:9/x.npy', 0, 8); "
            "time.sleep(1)")
    p = subprocess.run([sys.executable, "-c", code], env={**os.environ, "OLMO3EQX_STORAGE_RETRY_SECONDS": "600"},
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "retrying for up to 600 s" in p.stderr, p.stderr[-2000:]


def test_a_config_is_read_back_from_every_store(stores, prefix, tmp_path):
    """The config.yaml a run writes into its bucket, read back from gs://, s3:// and https:// (load_yaml, and train.py's
    --config); a missing one and an unknown scheme are one sentence naming the URL."""
    from olmo3eqx.config import DataConfig, TrainConfig, dump_yaml, load_yaml
    from olmo3eqx.train import parse_args

    cfg = TrainConfig(steps=7, data=DataConfig(seq_len=32, global_batch=4))
    dump_yaml(cfg, tmp_path / "config.yaml")
    urls = [stores.publish(tmp_path / "config.yaml", f"cfg-{uuid.uuid4().hex[:6]}", "config.yaml")]
    for scheme in BUCKETS:
        urls.append(storage.join(prefix(scheme), "config.yaml"))
        dump_yaml(cfg, urls[-1])
    for url in urls:
        assert load_yaml(url) == cfg, url
        assert parse_args(["--config", url, "--steps", "9"])[0].steps == 9
    missing = storage.join(prefix("s3"), "none.yaml")
    with pytest.raises(ConfigError, match=f"Config file {missing} does not exist"):
        load_yaml(missing)
    with pytest.raises(storage.UnsupportedPath, match="az://"):
        load_yaml("az://container/config.yaml")
