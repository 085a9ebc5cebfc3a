"""The playground: static HTML, CSS and JavaScript modules in `playground/`, served at `/` (the page) and
`/playground/` (its files). No build step: the browser loads the files as they are in the package."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

PLAYGROUND_DIR = Path(__file__).parent / "playground"
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")  # binds on which `mstar serve` turns the playground on by default


def wants_playground(host: str, ui: bool | None) -> bool:
    """Whether `mstar serve --host host [--ui | --no-ui]` serves the playground: the flag when given, else
    only on a local bind (a page that drives the model is not offered to the network unasked)."""
    return host in LOCAL_HOSTS if ui is None else ui


def install_playground(app: FastAPI) -> None:
    """Serve the playground page at `GET /` and its files under `/playground/`."""
    app.mount("/playground", StaticFiles(directory=PLAYGROUND_DIR), name="playground")

    @app.get("/", include_in_schema=False)
    async def playground_page() -> FileResponse:
        return FileResponse(PLAYGROUND_DIR / "index.html")
