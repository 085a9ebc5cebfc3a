"""Media sources: inline forms, local-path refusal, the remote-fetch policy and size caps."""

import base64
import http.server
import threading

import numpy as np
import pytest

from mstar.server.media import MediaError, MediaPolicy, decode_image, encode_image, load_media_bytes

PNG = encode_image(np.full((4, 6, 3), 200, dtype=np.uint8), "png")


def test_inline_forms_give_the_same_bytes():
    b64 = base64.b64encode(PNG).decode()
    assert load_media_bytes(PNG) == PNG
    assert load_media_bytes(b64) == PNG
    assert load_media_bytes(f"data:image/png;base64,{b64}") == PNG
    assert load_media_bytes(base64.urlsafe_b64encode(PNG).decode().rstrip("=")) == PNG


def test_local_paths_and_file_urls_are_never_read(tmp_path):
    real = tmp_path / "image_file-without_ext"
    real.write_bytes(PNG)
    for src in (str(real), f"file://{real}", str(tmp_path / "x.png"), "./x.png", "~/x.png"):
        with pytest.raises(MediaError) as info:
            decode_image(src)
        assert info.value.status_code == 400, src
    assert "file://" in str(pytest.raises(MediaError, load_media_bytes, f"file://{real}").value)


def test_malformed_inputs_are_400():
    for src in ("", "data:image/png,notbase64", "data:nocomma", "ftp://host/x.png", "a" * 5):
        with pytest.raises(MediaError) as info:
            load_media_bytes(src)
        assert info.value.status_code == 400, src


def test_remote_is_off_by_default():
    with pytest.raises(MediaError) as info:
        load_media_bytes("https://example.com/cat.png")
    assert info.value.status_code == 403
    assert "disabled" in info.value.message


def test_oversized_inline_input_is_413():
    policy = MediaPolicy(max_bytes=100)
    for src in (b"x" * 101, base64.b64encode(b"x" * 200).decode()):
        with pytest.raises(MediaError) as info:
            load_media_bytes(src, policy)
        assert info.value.status_code == 413


def test_policy_validation_names_the_value():
    with pytest.raises(ValueError, match="max_bytes"):
        MediaPolicy(max_bytes=0)
    with pytest.raises(ValueError, match="tuple"):
        MediaPolicy(allowed_hosts="example.com")


def test_host_allow_list():
    p = MediaPolicy(allow_remote=True, allowed_hosts=("cdn.example.com", ".images.org"))
    assert p.host_allowed("cdn.example.com") and p.host_allowed("a.images.org") and p.host_allowed("images.org")
    assert not p.host_allowed("example.com") and not p.host_allowed("evilimages.org")
    assert MediaPolicy(allow_remote=True).host_allowed("anything.net")
    assert not MediaPolicy().host_allowed("anything.net")


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server API)
        if self.path == "/img.png":
            body, length = PNG, len(PNG)
        elif self.path == "/big-no-length":
            body, length = b"x" * 5000, None  # streams past the cap without announcing it
        elif self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{self.server.server_port}/img.png")
            self.end_headers()
            return
        else:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        if length is not None:
            self.send_header("Content-Length", str(length))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def http_base():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def test_remote_fetch_when_allowed(http_base):
    policy = MediaPolicy(allow_remote=True, allowed_hosts=("127.0.0.1",))
    img = decode_image(f"{http_base}/img.png", policy)
    assert img.shape == (4, 6, 3) and img[0, 0, 0] == 200


def test_remote_fetch_caps_size_while_streaming(http_base):
    policy = MediaPolicy(allow_remote=True, max_bytes=1000)
    with pytest.raises(MediaError) as info:
        load_media_bytes(f"{http_base}/big-no-length", policy)
    assert info.value.status_code == 413


def test_remote_fetch_checks_hosts_and_redirect_targets(http_base):
    with pytest.raises(MediaError) as info:
        load_media_bytes(f"{http_base}/img.png", MediaPolicy(allow_remote=True, allowed_hosts=("cdn.example.com",)))
    assert info.value.status_code == 403
    # The redirect goes to "localhost", which this allow-list does not name.
    with pytest.raises(MediaError) as info:
        load_media_bytes(f"{http_base}/redirect", MediaPolicy(allow_remote=True, allowed_hosts=("127.0.0.1",)))
    assert info.value.status_code == 403
    policy = MediaPolicy(allow_remote=True, allowed_hosts=("127.0.0.1", "localhost"))
    assert load_media_bytes(f"{http_base}/redirect", policy) == PNG


def test_remote_http_error_is_400(http_base):
    with pytest.raises(MediaError) as info:
        load_media_bytes(f"{http_base}/missing", MediaPolicy(allow_remote=True))
    assert info.value.status_code == 400 and "404" in info.value.message
