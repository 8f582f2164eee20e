"""Object-store emulators on localhost for tests/objstore/objstore_test.py.

Two stores, each started as a child process on a free port:

- S3: moto's server (PyPI `moto[server]`), served by werkzeug with
  `threaded=False`. Why not `moto_server`: it serves each request on its own
  thread, and moto's PutObject checks `If-None-Match: *` and then stores the
  object in two steps with no lock between them, so two writers racing for
  one key can both be told they created it. A real S3 does not do that, and a
  test that could fail because the emulator did would tell us nothing about
  the program. Served one request at a time, the check and the store are one
  step, as they are on S3.
- Azure Blob: Azurite 3.35.0 (npm), which checks `If-None-Match: *` within
  the request (a race of many writers on one blob has one winner).

And one store that is wrong on purpose, the negative control: moto behind a
WSGI layer that drops the `If-None-Match` header, so every put overwrites,
as a store without conditional writes would. Two writers committing at once
must be seen to lose a commit there; a check that passed on it too would be
checking nothing.

GCS is not here: no emulator installable on this machine honours
`x-goog-if-generation-match: 0` (README, "Object stores").

Run as a program, it serves moto: `python stores.py moto PORT [--overwriting]`.
"""

import os
import socket
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))

# Azurite's well-known development account (public, the same in every
# install: it is no secret, and the test passes it by env: reference anyway).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port, proc, what, seconds=60):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before it listened on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{what} did not listen on {port} within {seconds}s")


class Store:
    """A running emulator: `kind` ('s3' or 'azure'), `env` (the variables a
    workflow's `env:` references read), `options` (the workflow's
    storage_options), `url(bucket, path)`, and `keys(prefix)` to list what
    is stored, read by the store's own SDK (not through the program)."""

    def __init__(self, kind, proc, port, log_path, name):
        self.kind, self.proc, self.port, self.log_path, self.name = kind, proc, port, log_path, name

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class S3Store(Store):
    def __init__(self, proc, port, log_path, name):
        super().__init__("s3", proc, port, log_path, name)
        self.endpoint = f"http://127.0.0.1:{port}"
        self.env = {"OBJSTORE_TEST_KEY_ID": "test-key-id", "OBJSTORE_TEST_SECRET": "test-secret"}
        # Credentials by reference only: the program refuses literal secrets.
        self.options = {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ALLOW_HTTP": "true",
            "AWS_REGION": "us-east-1",
            "AWS_ACCESS_KEY_ID": "env:OBJSTORE_TEST_KEY_ID",
            "AWS_SECRET_ACCESS_KEY": "env:OBJSTORE_TEST_SECRET",
        }
        import boto3

        self.client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="test-key-id",
            aws_secret_access_key="test-secret",
            region_name="us-east-1",
        )

    def make_bucket(self, bucket):
        self.client.create_bucket(Bucket=bucket)

    def url(self, bucket, path):
        return f"s3://{bucket}/{path}"

    def keys(self, bucket, prefix):
        out = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            out += [o["Key"] for o in page.get("Contents", [])]
        return out

    def read(self, bucket, key):
        return self.client.get_object(Bucket=bucket, Key=key)["Body"].read()


class AzureStore(Store):
    def __init__(self, proc, port, log_path, name):
        super().__init__("azure", proc, port, log_path, name)
        self.endpoint = f"http://127.0.0.1:{port}/{AZURITE_ACCOUNT}"
        self.env = {"OBJSTORE_TEST_ACCOUNT_KEY": AZURITE_KEY}
        self.options = {
            "AZURE_STORAGE_USE_EMULATOR": "true",
            "AZURE_STORAGE_ACCOUNT_NAME": AZURITE_ACCOUNT,
            "AZURE_STORAGE_ACCOUNT_KEY": "env:OBJSTORE_TEST_ACCOUNT_KEY",
        }
        # object_store takes the emulator's address from this variable.
        self.env["AZURITE_BLOB_STORAGE_URL"] = f"http://127.0.0.1:{port}"
        from azure.storage.blob import BlobServiceClient

        conn = (
            f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
            f"BlobEndpoint={self.endpoint};"
        )
        self.client = BlobServiceClient.from_connection_string(conn)

    def make_bucket(self, bucket):
        self.client.create_container(bucket)

    def url(self, bucket, path):
        return f"az://{bucket}/{path}"

    def keys(self, bucket, prefix):
        return [b.name for b in self.client.get_container_client(bucket).list_blobs(name_starts_with=prefix)]

    def read(self, bucket, key):
        return self.client.get_container_client(bucket).download_blob(key).readall()


def start_s3(tmp, overwriting=False):
    port = free_port()
    log_path = os.path.join(tmp, f"moto-{port}.log")
    args = [sys.executable, os.path.join(HERE, "stores.py"), "moto", str(port)]
    if overwriting:
        args.append("--overwriting")
    proc = subprocess.Popen(args, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    wait_for_port(port, proc, "moto")
    return S3Store(proc, port, log_path, "s3 (moto, overwriting)" if overwriting else "s3 (moto)")


def start_azure(tmp, azurite_bin):
    port = free_port()
    log_path = os.path.join(tmp, f"azurite-{port}.log")
    # Run from the temp dir: Azurite writes its own files to its working folder.
    proc = subprocess.Popen(
        [
            azurite_bin,
            "--blobHost", "127.0.0.1",
            "--blobPort", str(port),
            "--inMemoryPersistence",
            "--skipApiVersionCheck",
            "--disableTelemetry",
            "--silent",
        ],
        stdout=open(log_path, "w"),
        stderr=subprocess.STDOUT,
        cwd=tmp,
    )
    wait_for_port(port, proc, "azurite")
    return AzureStore(proc, port, log_path, "azure (azurite)")


def serve_moto(port, overwriting):
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import run_simple

    app = DomainDispatcherApplication(create_backend_app)
    if overwriting:
        inner = app

        def app(environ, start_response):  # noqa: F811 (the wrapped app)
            # The store without conditional writes: the header is gone, so
            # every put of a commit file replaces whatever is there.
            environ.pop("HTTP_IF_NONE_MATCH", None)
            return inner(environ, start_response)

    # One request at a time, and HTTP/1.0 (werkzeug's choice for a server
    # without threads): each connection closes after its response, so one
    # client's idle connection never holds the others back.
    run_simple(
        "127.0.0.1", port, app, threaded=False, processes=1, use_reloader=False, request_handler=MotoRequestHandler
    )


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "moto":
        os.environ.setdefault("MOTO_PORT", sys.argv[2])
        serve_moto(int(sys.argv[2]), "--overwriting" in sys.argv[3:])
    else:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
