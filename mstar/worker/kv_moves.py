"""Moving a sequence's KV pages between workers (prefill/decode disaggregation).

The conductor names, in `StartWalk.kv_sources`, the rank that prefilled a component this worker decodes.
The component's first item here is held while its pages are pulled (`KVPull`); the prefill worker answers
with `KVPages`, and the engine places them and runs the item (`KVHandoff` in engines/base.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mstar.engines.base import Engine, StepItem
from mstar.engines.kv_handoff import KVExport, KVHandoff, KVPositions
from mstar.transport import wire
from mstar.transport.messages import discard_message


def _hash_bytes(hashes: list[int]) -> list[bytes]:
    """128-bit page hashes as msgpack carries them (its ints stop at 64 bits)."""
    return [h.to_bytes(16, "little") for h in hashes]


def _hash_ints(hashes: list[bytes]) -> list[int]:
    return [int.from_bytes(h, "little") for h in hashes]


class KVMoves:
    """A worker's side of moving sequences: the ranks to pull from and the items held until pages arrive."""

    def __init__(self, rank: int, engines: dict[str, Engine], send: Callable[[int, Any], None], codec,
                 to_device: Callable[[Any], Any]) -> None:
        """`send(rank, msg)` sends to another worker; `codec` packs tensors for the wire."""
        self.rank, self.engines, self.send, self.codec, self.to_device = rank, engines, send, codec, to_device
        self._sources: dict[tuple[str, str], int] = {}  # (rid, component) -> rank holding the sequence
        self._waiting: dict[tuple[str, str, str], StepItem] = {}  # (rid, component, kv_slot) -> held item

    def start(self, msg: wire.StartWalk) -> None:
        """Note the ranks this walk's components move their sequences from."""
        for component, rank in msg.kv_sources.items():
            if isinstance(self.engines.get(component), KVHandoff):
                self._sources[(msg.rid, component)] = rank

    def pull(self, component: str, item: StepItem) -> bool:
        """Hold `item` and ask for its sequence if it is the first of a moved one; False: submit it as usual."""
        if not self._sources or (source := self._sources.pop((item.request_id, component), None)) is None:
            return False
        engine = self.engines[component]
        assert isinstance(engine, KVHandoff)  # only such engines get a kv source (start)
        held = engine.hold_prefix(item)
        self._waiting[(item.request_id, component, item.kv_slot)] = item
        self.send(source, wire.KVPull(item.request_id, component, item.kv_slot, _hash_bytes(held),
                                                   self.rank))
        return True

    def handle(self, msg: wire.KVPull | wire.KVPages) -> None:
        if isinstance(msg, wire.KVPull):
            self._send(msg)
        else:
            self._receive(msg)

    def release(self, rid: str) -> None:
        for table in (self._sources, self._waiting):
            for key in [k for k in table if k[0] == rid]:
                del table[key]

    def __len__(self) -> int:
        return len(self._sources) + len(self._waiting)

    def _send(self, msg: wire.KVPull) -> None:
        engine = self.engines.get(msg.component)
        export = engine.export_kv(msg.rid, msg.kv_slot, _hash_ints(msg.held)) if isinstance(engine, KVHandoff) else None
        if export is None:
            reply = wire.KVPages(msg.rid, msg.component, msg.kv_slot, False)
        else:
            p = export.positions
            positions = None if p is None else wire.KVPositionsWire(p.start, p.offset, p.multi_row, p.fractional,
                                                                    p.num_shareable)
            k = None if export.k is None else self.codec.pack(export.k, msg.reply_to)
            v = None if export.v is None else self.codec.pack(export.v, msg.reply_to)
            reply = wire.KVPages(msg.rid, msg.component, msg.kv_slot, True, export.tokens, _hash_bytes(export.page_hashes),
                                 export.skip, k, v, positions)
        self.send(msg.reply_to, reply)

    def _receive(self, msg: wire.KVPages) -> None:
        item = self._waiting.pop((msg.rid, msg.component, msg.kv_slot), None)
        if item is None:  # released meanwhile
            discard_message(msg, self.codec.discard)
            return
        export = None
        if msg.found:
            p = msg.positions
            positions = None if p is None else KVPositions(p.start, p.offset, p.multi_row, p.fractional, p.num_shareable)
            k = None if msg.k is None else self.to_device(self.codec.unpack(msg.k))
            v = None if msg.v is None else self.to_device(self.codec.unpack(msg.v))
            export = KVExport(msg.tokens, _hash_ints(msg.page_hashes), msg.skip, k, v, positions)
        engine = self.engines[msg.component]
        assert isinstance(engine, KVHandoff)
        engine.submit_with_kv(item, export)
