"""The API key: read from a file or MSTAR_API_KEY, refused on the command line, never printed."""

from __future__ import annotations

import pytest

from mstar.cli.main import build_parser, read_api_key, snippets

SECRET = "s3cret-key-value"


def _args(*argv):
    return build_parser().parse_args(["serve", "toy", *argv])


def test_the_key_comes_from_a_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("MSTAR_API_KEY", raising=False)
    assert read_api_key(_args()) is None
    monkeypatch.setenv("MSTAR_API_KEY", "from-env")
    assert read_api_key(_args()) == "from-env"
    key_file = tmp_path / "key"
    key_file.write_text(f"{SECRET}\n")
    assert read_api_key(_args("--api-key-file", str(key_file))) == SECRET


@pytest.mark.parametrize("argv,message", [
    (("--api-key", SECRET), "process list"),
    (("--api-key-file", "/nonexistent/key"), "cannot read"),
])
def test_a_key_on_the_command_line_or_a_missing_file_is_refused(argv, message):
    with pytest.raises(SystemExit, match=message) as exc:
        read_api_key(_args(*argv))
    assert SECRET not in str(exc.value)


def test_the_banner_never_shows_the_key():
    text = snippets("http://127.0.0.1:8000", "toy", SECRET)
    assert SECRET not in text and "$MSTAR_API_KEY" in text and 'os.environ["MSTAR_API_KEY"]' in text
    assert "MSTAR_API_KEY" not in snippets("http://127.0.0.1:8000", "toy", None)
