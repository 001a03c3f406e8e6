"""msgspec encoders/decoders for each socket, created once (they cache type info)."""

from __future__ import annotations

import msgspec

from stoker.common.messages import (
    ApiFromScheduler,
    ApiInbound,
    SchedulerInbound,
    StepResult,
    TokenBatch,
    TokenizeRequest,
    WorkerInbound,
    WorkerReady,
)

encoder = msgspec.msgpack.Encoder()
plan_decoder = msgspec.msgpack.Decoder(WorkerInbound)
worker_outbound_decoder = msgspec.msgpack.Decoder(StepResult | WorkerReady)
scheduler_inbound_decoder = msgspec.msgpack.Decoder(SchedulerInbound)
tokenizer_inbound_decoder = msgspec.msgpack.Decoder(TokenBatch)
tokenize_request_decoder = msgspec.msgpack.Decoder(TokenizeRequest)
api_inbound_decoder = msgspec.msgpack.Decoder(ApiInbound)
api_from_scheduler_decoder = msgspec.msgpack.Decoder(ApiFromScheduler)
