"""A KV-event subscriber written from vLLM's published schema (vllm/distributed/kv_events.py),
not from stoker's code: what a router sees on the wire."""

from typing import Any

import msgspec
import zmq


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def _schema(array_like: bool):
    class KVCacheEvent(
        msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True
    ):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[int | bytes]
        parent_block_hash: int | bytes | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int | bytes]
        medium: str | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    return KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared


class Replica:
    """One replica's cache as a router tracks it: hash -> (parent hash, tokens)."""

    def __init__(self, encoding: str = "array") -> None:
        batch, self.Stored, self.Removed, self.Cleared = _schema(encoding == "array")
        self.decoder = msgspec.msgpack.Decoder(batch)
        self.index: dict[int | bytes, tuple[int | bytes | None, tuple[int, ...]]] = {}
        self.block_size = 0

    def apply(self, payload: bytes) -> Any:
        batch = self.decoder.decode(payload)
        for e in batch.events:
            if isinstance(e, self.Stored):
                bs = e.block_size
                assert bs > 0 and len(e.token_ids) == bs * len(e.block_hashes)
                self.block_size = bs
                parent = e.parent_block_hash
                for i, h in enumerate(e.block_hashes):
                    assert h not in self.index, f"block {h!r} stored twice"
                    self.index[h] = (parent, tuple(e.token_ids[i * bs : (i + 1) * bs]))
                    parent = h
            elif isinstance(e, self.Removed):
                for h in e.block_hashes:
                    del self.index[h]
            else:
                self.index.clear()
        return batch

    def prefix_hit(self, prompt: list[int]) -> int:
        """Tokens of prompt[:-1] this replica holds, as a prefix scorer computes them."""
        by_key = {(p, t): h for h, (p, t) in self.index.items()}
        bs, parent, hit = self.block_size, None, 0
        if not bs:
            return 0
        body = prompt[:-1]  # the engine always computes the last prompt token
        for i in range(len(body) // bs):
            h = by_key.get((parent, tuple(body[i * bs : (i + 1) * bs])))
            if h is None:
                break
            parent, hit = h, hit + bs
        return hit


def replay(ctx: zmq.Context, endpoint: str, start: int = 0) -> list[tuple[int, bytes]]:
    """Ask the replay socket for every batch from `start`: [(seq, payload)]."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    try:
        while True:
            if not sock.poll(10_000):
                raise TimeoutError("no replay answer")
            empty, seq, payload = sock.recv_multipart()
            assert empty == b""
            n = int.from_bytes(seq, "big", signed=True)
            if n == -1:
                assert payload == b""
                return out
            out.append((n, payload))
    finally:
        sock.close()
