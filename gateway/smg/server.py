"""The SMG router's gRPC worker protocol (``sglang.grpc.scheduler.SglangScheduler``, vendored
from smg-grpc-proto: ``protos/tandem/smg``), a second public service of the gateway on its own
port (``--smg-port``), so ``smg launch --worker-urls grpc://HOST:PORT`` puts the SGLang Model
Gateway's OpenAI API, chat templates and load-aware routing in front of Tandem.

Thin by design: ``Generate`` turns a worker request into a native one (``gateway.smg.convert``)
and runs it through ``GatewayServicer.Generate`` under the caller's own call context, so it
gets the native path whole: admission and RESOURCE_EXHAUSTED with RetryInfo, lanes, stop
strings, failover, the slow-reader cut-off, principal-scoped ids, and abort at the target when
the router drops the stream. Speculation stays invisible: the router sees verified tokens
only, and each completion's acceptance counts (``spec_accepted_tokens``/``spec_draft_tokens``).
Not served (UNIMPLEMENTED): Embed, FlushCache, profiling, LoRA, and SubscribeKvEvents (the
router then polls ``GetLoads``).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import time
import zipfile
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import grpc
from google.protobuf import struct_pb2, timestamp_pb2

from gateway.server import GatewayServicer
from gateway.smg import convert
from gateway.target_client import TargetUnavailable
from tandem import __version__
from tandem.smg import common_pb2 as smg_common_pb2
from tandem.smg import sglang_scheduler_pb2 as smg_pb2
from tandem.smg import sglang_scheduler_pb2_grpc as smg_grpc
from tandem.v1 import common_pb2, gateway_pb2

SERVICE_NAME = smg_pb2.DESCRIPTOR.services_by_name["SglangScheduler"].full_name
TOKENIZER_CHUNK_BYTES = 1 << 20
# What a router needs to build the tokenizer and the chat template without a hub.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.json",
    "config.json",
    "generation_config.json",
)


class SmgWorkerServicer(smg_grpc.SglangSchedulerServicer):
    def __init__(self, gateway: GatewayServicer) -> None:
        self.gateway = gateway
        self.started_s = time.time()
        self._tokenizer_zip: tuple[bytes, str] | None = None  # built on first ask

    def screen(self, data: bytes) -> None:
        """A Generate request's bytes, checked before they are parsed (``convert.screen``)."""
        if (info := self.gateway.client.info) is not None:
            convert.screen(data, max_model_len=info.max_model_len)

    async def Generate(
        self, request: smg_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[smg_pb2.GenerateResponse]:
        native = convert.to_gateway(request)
        num_prompt = len(native.token_ids.ids)
        asked = request.return_logprob  # the gateway sends logprobs only then
        # Per completion (sampling_params.n of them, by index): tokens, logprobs, top-N.
        outputs: dict[int, tuple[list[int], list[float], list[common_pb2.TopLogprobs]]] = {}
        # aclosing: a dropped router stream closes the native generator at once, which ends
        # the request at the target (GatewayServicer._close).
        generate = cast(
            Callable[..., AsyncGenerator[gateway_pb2.GenerateResponse]], self.gateway.Generate
        )
        async with contextlib.aclosing(generate(native, context)) as responses:
            async for response in responses:
                which = response.WhichOneof("payload")
                output_ids, logprobs, tops = outputs.setdefault(response.index, ([], [], []))
                if which == "chunk":
                    tokens, scores = list(response.chunk.token_ids), list(response.chunk.logprobs)
                    top = list(response.chunk.top_logprobs)
                    output_ids += tokens
                    logprobs += scores
                    tops += top
                    if request.stream:
                        chunk = convert.chunk(
                            tokens, scores if asked else None, num_prompt, len(output_ids), top
                        )
                        chunk.index = response.index
                        yield smg_pb2.GenerateResponse(request_id=request.request_id, chunk=chunk)
                elif which == "complete":
                    if request.stream:  # the chunks carried the tokens
                        done = convert.complete(response.complete, [], None)
                    else:
                        scored = logprobs if asked else None
                        done = convert.complete(response.complete, output_ids, scored, tops)
                    done.index = response.index
                    yield smg_pb2.GenerateResponse(request_id=request.request_id, complete=done)
                # An error payload is followed by the call's status: the gateway aborts it.

    async def Abort(
        self, request: smg_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> smg_pb2.AbortResponse:
        answer = await self.gateway.Abort(
            gateway_pb2.AbortRequest(request_ids=[request.request_id]), context
        )
        aborted = request.request_id in answer.aborted_request_ids
        return smg_pb2.AbortResponse(
            success=aborted, message="aborted" if aborted else "not running"
        )

    async def HealthCheck(
        self, request: smg_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> smg_pb2.HealthCheckResponse:
        client = self.gateway.client
        if client.info is None or not client.connected:
            return smg_pb2.HealthCheckResponse(healthy=False, message=client.lost or "starting")
        return smg_pb2.HealthCheckResponse(healthy=True, message="serving")

    async def GetModelInfo(
        self, request: smg_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> smg_pb2.GetModelInfoResponse:
        try:
            info = await self.gateway.client.get_info()
        except TargetUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        checkpoint = self.gateway.config.tokenizer
        config = _read_json(checkpoint / "config.json")
        tokenizer = self.gateway.tokenizer
        return smg_pb2.GetModelInfoResponse(
            model_path=str(checkpoint),
            tokenizer_path=str(checkpoint),
            is_generation=True,
            served_model_name=info.model_id,
            max_context_length=info.max_model_len,
            vocab_size=info.vocab_size,
            model_type=str(config.get("model_type", "")),
            architectures=[str(a) for a in config.get("architectures", [])],
            eos_token_ids=list(info.eos_token_ids),
            pad_token_id=tokenizer.pad_token_id or 0,
            bos_token_id=tokenizer.bos_token_id or 0,
            max_req_input_len=info.max_model_len - 1,  # room for one new token
        )

    async def GetServerInfo(
        self, request: smg_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> smg_pb2.GetServerInfoResponse:
        native = await self.gateway.GetServerInfo(gateway_pb2.GetServerInfoRequest(), context)
        info = self.gateway.client.info
        server_args = struct_pb2.Struct()
        server_args.update(
            {
                "model_path": str(self.gateway.config.tokenizer),
                "served_model_name": info.model_id if info else "",
                "max_running_requests": self.gateway.config.max_running,
                "max_queued_requests": self.gateway.config.max_queue,
                "speculative_draft_kind": native.speculation.draft_kind,
            }
        )
        scheduler_info = struct_pb2.Struct()
        scheduler_info.update(
            {
                "max_total_num_tokens": _kv_tokens(native.target_kv_usage)[1],
                "num_waiting": native.num_waiting,
                "target_connected": native.target_connected,
            }
        )
        started = timestamp_pb2.Timestamp()
        started.FromSeconds(int(self.started_s))
        return smg_pb2.GetServerInfoResponse(
            server_args=server_args,
            scheduler_info=scheduler_info,
            active_requests=native.num_running,
            uptime_seconds=time.time() - self.started_s,
            sglang_version=f"tandem-{__version__}",
            server_type="grpc",
            start_time=started,
            max_total_num_tokens=_kv_tokens(native.target_kv_usage)[1],
        )

    async def GetLoads(
        self, request: smg_pb2.GetLoadsRequest, context: grpc.aio.ServicerContext
    ) -> smg_pb2.GetLoadsResponse:
        native = await self.gateway.GetServerInfo(gateway_pb2.GetServerInfoRequest(), context)
        used, total = _kv_tokens(native.target_kv_usage)
        load = smg_pb2.SchedulerLoad(
            dp_rank=0,
            num_running_reqs=native.num_running,
            num_waiting_reqs=native.num_waiting,
            num_total_reqs=native.num_running + native.num_waiting,
            num_used_tokens=used,
            max_total_num_tokens=total,
            token_usage=used / total if total else 0.0,
            utilization=native.num_running / self.gateway.config.max_running,
            max_running_requests=self.gateway.config.max_running,
        )
        accept = [lane.accept_length for lane in native.lanes if lane.accept_length > 0]
        if accept:  # committed tokens per verify step; the rate is per draft token
            load.speculative.accept_length = sum(accept) / len(accept)
        return smg_pb2.GetLoadsResponse(
            timestamp=datetime.now(UTC).isoformat(),
            version=f"tandem-{__version__}",
            dp_rank_count=1,
            loads=[load],
            aggregate=smg_pb2.AggregateMetrics(
                total_running_reqs=load.num_running_reqs,
                total_waiting_reqs=load.num_waiting_reqs,
                total_reqs=load.num_total_reqs,
                avg_token_usage=load.token_usage,
                avg_utilization=load.utilization,
            ),
        )

    async def GetTokenizer(
        self, request: smg_common_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[smg_common_pb2.GetTokenizerChunk]:
        if self._tokenizer_zip is None:
            self._tokenizer_zip = tokenizer_zip(self.gateway.config.tokenizer)
        data, digest = self._tokenizer_zip
        for start in range(0, len(data), TOKENIZER_CHUNK_BYTES):
            end = start + TOKENIZER_CHUNK_BYTES
            last = end >= len(data)
            yield smg_common_pb2.GetTokenizerChunk(
                data=data[start:end], sha256=digest if last else ""
            )

    async def _unimplemented(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not served by Tandem")

    Embed = FlushCache = StartProfile = StopProfile = _unimplemented
    LoadLoRAAdapter = UnloadLoRAAdapter = ListLoadedLoRAAdapters = _unimplemented

    async def SubscribeKvEvents(
        self, request: smg_common_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[smg_common_pb2.KvEventBatch]:
        # No prefix cache to report yet; the router falls back to polling GetLoads.
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Tandem publishes no KV events")
        yield smg_common_pb2.KvEventBatch()  # never reached: makes this an async generator


def tokenizer_zip(checkpoint: Path) -> tuple[bytes, str]:
    """The checkpoint's tokenizer files (and any ``*.jinja`` chat template) as a zip, with
    fixed timestamps so the same files give the same bytes; and its sha256 in hex."""
    names = [n for n in TOKENIZER_FILES if (checkpoint / n).is_file()]
    names += sorted(p.name for p in checkpoint.glob("*.jinja") if p.is_file())
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in names:
            entry = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            archive.writestr(entry, (checkpoint / name).read_bytes(), zipfile.ZIP_DEFLATED)
    data = buffer.getvalue()
    return data, hashlib.sha256(data).hexdigest()


def _kv_tokens(usage: common_pb2.KvUsage) -> tuple[int, int]:
    """(tokens in use, tokens in the pool) of the target's KV pool."""
    return usage.pages_used * usage.page_size, usage.pages_total * usage.page_size


def _read_json(path: Path) -> dict[str, Any]:
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}
