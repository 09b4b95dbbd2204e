"""An S3-compatible server in a process of its own (moto's ``moto_server``: real S3 over HTTP on a free
port), with a bucket, and the environment boto3 reads to reach it."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.serving.support import free_port


class S3Server:
    """``with S3Server() as s3: s3.env`` -> the AWS_* variables of a server with bucket ``s3.bucket``."""

    def __init__(self, bucket: str = "fv-artifacts") -> None:
        self.bucket, self.port = bucket, free_port()
        self.env = {
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.port}",
            "AWS_ACCESS_KEY_ID": "fv-test",
            "AWS_SECRET_ACCESS_KEY": "fv-test-secret",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def __enter__(self) -> S3Server:
        command = shutil.which("moto_server") or str(Path(sys.executable).parent / "moto_server")
        self.proc = subprocess.Popen(
            [command, "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto_server did not start") from None
                time.sleep(0.1)
        self.saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        import boto3

        boto3.client("s3").create_bucket(Bucket=self.bucket)
        return self

    def __exit__(self, *exc: object) -> None:
        for key, value in self.saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self.proc.terminate()
        self.proc.wait(10)
