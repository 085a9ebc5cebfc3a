"""Client outputs of a worker, sent to the conductor in batches."""

from __future__ import annotations

from typing import Any

from mstar.transport import wire


class BatchingOutbox:
    """Wraps an outbox: `ClientOutput`s to `conductor` are held and leave as one `ClientOutputs` at
    `flush()` (a worker flushes after each engine step and each receive), or before any other message
    to the conductor, so a `WalkDone` never overtakes the outputs emitted before it. Messages to other
    peers pass straight through (only the order of one peer's messages is kept by a transport)."""

    def __init__(self, outbox: Any, conductor: str) -> None:
        self._outbox, self._conductor = outbox, conductor
        self._held: list[wire.ClientOutput] = []

    def send(self, peer: str, msg: Any) -> None:
        if peer == self._conductor:
            if type(msg) is wire.ClientOutput:
                self._held.append(msg)
                return
            if self._held:
                self.flush()
        self._outbox.send(peer, msg)

    def flush(self) -> None:
        """Send the held outputs (a lone one as itself)."""
        if not self._held:
            return
        held, self._held = self._held, []
        self._outbox.send(self._conductor, held[0] if len(held) == 1 else wire.ClientOutputs(held))
