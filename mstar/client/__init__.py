"""The mstar Python SDK: `MStarClient` (blocking) and `AsyncMStarClient` (asyncio), over httpx.

    from mstar.client import MStarClient
    client = MStarClient("http://127.0.0.1:8000")
    print(client.chat("Hello!").text)
    client.tts("Hi there", voice="tara").to_wav("hi.wav")
    for chunk in client.generate(text="Describe", files=["cat.png"], stream=True):
        ...

In-band stream errors and HTTP errors raise `MStarError(status, message)`.
"""

from mstar.client.async_client import AsyncMStarClient
from mstar.client.errors import MStarError
from mstar.client.results import AudioBuffer, GenerateResult, collect
from mstar.client.sync_client import MStarClient

__all__ = ["AsyncMStarClient", "AudioBuffer", "GenerateResult", "MStarClient", "MStarError", "collect"]
