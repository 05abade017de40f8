"""The kubelet side of `npusnap k8s checkpoint` against a local HTTPS endpoint that answers as the
kubelet's checkpoint API is documented to (kubernetes/website, docs/reference/node/
kubelet-checkpoint-api.md: POST /checkpoint/{namespace}/{pod}/{container}?timeout=S, client
certificate authentication, `{"items": ["/var/lib/kubelet/checkpoints/checkpoint-....tar"]}`).
No kubelet runs here: this checks the request npusnap makes and how it reads the answers."""

from __future__ import annotations

import datetime
import http.server
import json
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from npusnap_cli.errors import CriuError
from npusnap_cli.k8s import jobcheckpoint as jc


def _cert(path: Path, name: str) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .sign(key, hashes.SHA256())
    )
    crt, pem = path / f"{name}.crt", path / f"{name}.key"
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return crt, pem


@pytest.fixture
def kubelet(tmp_path: Path) -> Iterator[tuple[int, Path, Path, list[dict[str, object]]]]:
    server_crt, server_key = _cert(tmp_path, "kubelet")
    client_crt, client_key = _cert(tmp_path, "apiserver-kubelet-client")
    seen: list[dict[str, object]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            peer = self.connection.getpeercert()  # type: ignore[attr-defined]
            seen.append({"path": self.path, "client_cert": bool(peer)})
            if "/missing/" in self.path:
                self.send_response(404)
                self.end_headers()
                self.wfile.write(b"container not found")
                return
            name = self.path.split("?")[0].split("/")[2:]
            body = json.dumps(
                {"items": [f"/var/lib/kubelet/checkpoints/checkpoint-{name[1]}_{name[0]}-{name[2]}-T.tar"]}
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(server_crt, server_key)
    ctx.verify_mode = ssl.CERT_REQUIRED  # the kubelet authenticates its clients by certificate
    ctx.load_verify_locations(client_crt)
    httpd.socket = ctx.wrap_socket(httpd.socket, server_side=True)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd.server_address[1], client_crt, client_key, seen
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_checkpoint_request_and_answer(kubelet: tuple[int, Path, Path, list[dict[str, object]]]) -> None:
    port, crt, key, seen = kubelet
    backend = jc.KubeletBackend(crt, key, None, port=port)
    member = jc.parse_member(0, "default/trainer-0/trainer@localhost")
    archive = backend.checkpoint(member, Path("unused"), 600)
    assert archive == Path("/var/lib/kubelet/checkpoints/checkpoint-trainer-0_default-trainer-T.tar")
    assert seen == [{"path": "/checkpoint/default/trainer-0/trainer?timeout=600", "client_cert": True}]
    assert backend.running(member) is None  # the kubelet's API does not say


def test_an_error_answer_names_the_node_and_container(
    kubelet: tuple[int, Path, Path, list[dict[str, object]]],
) -> None:
    port, crt, key, _ = kubelet
    backend = jc.KubeletBackend(crt, key, None, port=port)
    with pytest.raises(
        CriuError, match=r"kubelet on localhost could not checkpoint default/missing/c: HTTP 404"
    ):
        backend.checkpoint(jc.parse_member(0, "default/missing/c@localhost"), Path("unused"), 60)
