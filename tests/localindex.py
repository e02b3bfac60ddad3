"""A local HTTPS package index for tests that build real uv environments without the internet.

`make_tls` makes a throwaway CA and a server certificate for 127.0.0.1 (the CA file is what SSL_CERT_FILE names);
`Index` serves PEP 503 pages and pure wheels made by `make_wheel`, records every request, and holds each wheel
download while its `gate` is closed: a build that takes as long as the test wants, with no timing in the test.
`uv_lock` is the agent's side: `uv lock` of a pyproject against the index.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import http.server
import io
import ipaddress
import shutil
import ssl
import subprocess
import threading
import zipfile
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kernel.io.envcache import uv_binary


def make_tls(tmp: Path) -> tuple[Path, ssl.SSLContext]:
    """A throwaway CA (its certificate is what SSL_CERT_FILE names) and a server context for 127.0.0.1 signed by
    it, as a site's own CA bundle would hold."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "syscall test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    ca_file, cert_file, key_file = tmp / "ca.pem", tmp / "server.pem", tmp / "server.key"
    ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_file.write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_file, key_file)
    return ca_file, context


def make_wheel(
    name: str, version: str, files: dict[str, str], *, entry_points: str | None = None
) -> tuple[str, bytes]:
    """(file name, bytes) of a pure wheel of `name` holding `files` (path -> text), with `entry_points` as its
    dist-info's entry_points.txt (console scripts, whose launchers uv writes at install time) if given."""
    info = f"{name}-{version}.dist-info"
    files = {
        **files,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: syscall-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    if entry_points is not None:
        files[f"{info}/entry_points.txt"] = entry_points
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    record.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = "\n".join(record) + "\n"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return f"{name}-{version}-py3-none-any.whl", buf.getvalue()


class Index:
    """A PEP 503 simple index on 127.0.0.1 over HTTPS serving `wheels` (package -> (file name, bytes)).

    A wheel download waits while `gate` is clear (set at start: the index answers at once); `served` counts the
    wheel downloads answered in full, `asked` those begun. A package removed from `wheels` is 404."""

    def __init__(self, context: ssl.SSLContext, wheels: dict[str, tuple[str, bytes]]) -> None:
        self.wheels = dict(wheels)
        self.gate = threading.Event()
        self.gate.set()
        self.asked = 0
        self.served = 0
        self.requests: list[str] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.reply(head=False)

            def do_HEAD(self) -> None:  # uv asks whether the server takes range requests
                self.reply(head=True)

            def reply(self, *, head: bool) -> None:
                server.requests.append(self.path)
                body, kind, wheel = server.answer(self.path)
                if wheel and not head:
                    server.asked += 1
                    server.gate.wait(300)
                self.send_response(200 if body is not None else 404)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body or b"")))
                self.end_headers()
                if not head:
                    self.wfile.write(body or b"")
                    if wheel:
                        server.served += 1

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.handle_error = lambda request, client_address: None  # type: ignore[method-assign]  # a client gone
        self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self.url = f"https://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def answer(self, path: str) -> tuple[bytes | None, str, bool]:
        for package, (file, data) in self.wheels.items():
            if path == f"/files/{file}":
                return data, "application/octet-stream", True
            if path.rstrip("/") == f"/simple/{package}":
                digest = hashlib.sha256(data).hexdigest()
                link = f'<a href="{self.url}/files/{file}#sha256={digest}">{file}</a>'
                return f"<!DOCTYPE html><html><body>{link}</body></html>".encode(), "text/html", False
        return None, "text/plain", False

    def reset(self) -> None:
        """Forget the requests so far (the agent's `uv lock` reads the wheel too)."""
        self.asked = self.served = 0
        self.requests.clear()

    def close(self) -> None:
        self.gate.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(10)


def uv_lock(tmp: Path, pyproject: str, index: str, ca: Path, python: str) -> str:
    """The agent's side: `uv lock` of `pyproject` against the local index (resolving, not installing)."""
    proj = tmp / "lockgen"
    shutil.rmtree(proj, ignore_errors=True)
    proj.mkdir()
    (proj / "pyproject.toml").write_text(pyproject)
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp),
        "UV_CACHE_DIR": str(tmp / "lockgen-cache"),
        "SSL_CERT_FILE": str(ca),
        "NO_PROXY": "127.0.0.1",
        "no_proxy": "127.0.0.1",
    }
    done = subprocess.run(
        [uv_binary(), "lock", "--no-config", "--python", python, "--index-url", f"{index}/simple"],
        cwd=proj,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    shutil.rmtree(tmp / "lockgen-cache", ignore_errors=True)
    return (proj / "uv.lock").read_text()
