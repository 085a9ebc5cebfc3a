"""The playground's serving (its browser behaviour is tests/e2e/test_playground.py): `mstar serve` turns it on
for local binds unless --no-ui, off elsewhere unless --ui; the app serves the page at `/` and its files under
/playground/ (open without the API key, which its requests then send), and nothing at `/` without it;
/v1/models carries the modalities the page picks its tabs by; every module the page imports ships."""

from __future__ import annotations

import re

import httpx
import pytest

from mstar.cli.main import build_parser
from mstar.server.routes_playground import PLAYGROUND_DIR, wants_playground
from tests.e2e.server_thread import running_server


@pytest.mark.parametrize(("host", "flag", "wanted"), [
    ("127.0.0.1", None, True), ("localhost", None, True), ("::1", None, True), ("0.0.0.0", None, False),
    ("10.1.2.3", None, False), ("127.0.0.1", False, False), ("0.0.0.0", True, True),
])
def test_default_is_on_only_for_local_binds(host, flag, wanted) -> None:
    assert wants_playground(host, flag) is wanted


def test_ui_flags_parse() -> None:
    parse = build_parser().parse_args
    assert parse(["serve", "toy"]).ui is None
    assert parse(["serve", "toy", "--no-ui"]).ui is False
    assert parse(["serve", "toy", "--host", "0.0.0.0", "--ui"]).ui is True


def test_page_and_files_are_served_and_open() -> None:
    with running_server({"model": "toy"}, api_key="k", ui=True) as base:
        page = httpx.get(base + "/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert '<script type="module" src="/playground/app.js">' in page.text
        script = httpx.get(base + "/playground/app.js")
        assert script.status_code == 200 and "javascript" in script.headers["content-type"]
        assert httpx.get(base + "/v1/models").status_code == 401  # the page is open, the API is not
        card = httpx.get(base + "/v1/models", headers={"Authorization": "Bearer k"}).json()["data"][0]
    assert card["input_modalities"] == ["text", "image", "audio", "video"]
    assert card["output_modalities"] == ["text", "image", "audio", "video"] and card["reports_progress"] is True


def test_no_page_without_ui() -> None:
    with running_server({"model": "toy"}) as base:
        assert httpx.get(base + "/").status_code == 404
        assert httpx.get(base + "/playground/app.js").status_code == 404


def test_every_imported_module_ships() -> None:
    names = {path.name for path in PLAYGROUND_DIR.iterdir()}
    imported = set()
    for script in PLAYGROUND_DIR.glob("*.js"):
        imported |= set(re.findall(r'from "\./([\w.]+)"', script.read_text()))
    assert imported and imported <= names, imported - names
    assert {"index.html", "style.css", "app.js"} <= names
