"""The FastAPI application: OpenAI's completions, chat completions and models, plus health,
metrics, version, tokenize and detokenize, over an `EngineLoop` (the engine's process).

Every failure answers OpenAI's error body with a 4xx naming the field (a 5xx only when the engine
itself is down: the `openai` client retries every 5xx). A client that disconnects, mid-stream or
while waiting for a whole response, has its requests aborted at once: a task per request watches
the connection for `http.disconnect` instead of waiting for the next write to fail."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import fms_paged
from fms_paged.serve.loop import EngineLoop, State
from fms_paged.serve.metrics import ServerMetrics
from fms_paged.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse
from fms_paged.serve.requests import Run, ServeContext, chat_prompt, prepare_chat, prepare_completion
from fms_paged.serve.responses import Renderer
from fms_paged.serve.tools import check_tools

MAX_BODY_BYTES = 8 << 20


async def read_json(request: Request, limit: int = MAX_BODY_BYTES):
    """The body as JSON: 413 past `limit` bytes (declared or streamed), 400 when it does not parse."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body has {declared} bytes; the limit is {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body is over the limit of {limit} bytes")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _respond_unless_disconnected(request: Request, run: Run, renderer: Renderer):
    """The whole response, or None when the client left first (its requests are aborted)."""
    work = asyncio.ensure_future(renderer.response())
    watch = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        work.cancel()
        return None
    finally:
        watch.cancel()
        run.close()


async def _stream(request: Request, run: Run, renderer: Renderer, metrics: ServerMetrics):
    watch = asyncio.ensure_future(_until_disconnect(request))
    watch.add_done_callback(lambda t: t.cancelled() or run.close())
    first = True
    try:
        async for chunk in renderer.stream():
            yield chunk  # resumed once the chunk is handed to the connection
            if first and run.first_token_at is not None:
                metrics.first_chunk_delay.observe(time.perf_counter() - run.first_token_at)
                first = False
    finally:
        watch.cancel()
        run.close()


class BearerAuth:
    """A plain ASGI middleware (no per-chunk cost on streams, unlike a `BaseHTTPMiddleware`): paths
    under /v1 need `Authorization: Bearer <api_key>`, else 401."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                err = APIError(401, "a valid API key is required: 'Authorization: Bearer <key>'",
                               code="invalid_api_key")
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(ctx: ServeContext, metrics: ServerMetrics, api_key: str | None = None) -> FastAPI:
    loop: EngineLoop = ctx.loop

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # the engine process warms up meanwhile: /health says 503
        try:
            yield
        finally:
            await asyncio.to_thread(loop.stop)

    app = FastAPI(title="fms-paged", version=fms_paged.__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ctx, app.state.metrics = ctx, metrics

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException):
        err = APIError(e.status_code, str(e.detail))
        return JSONResponse(err.body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def server_error(_: Request, e: Exception):  # a bug of ours: still OpenAI's error shape
        err = APIError(500, f"internal error: {type(e).__name__}: {e}")
        return JSONResponse(err.body(), status_code=500)

    if api_key is not None:
        app.add_middleware(BearerAuth, api_key=api_key)

    def ready() -> None:
        if loop.state is not State.READY:
            why = f": {loop.error!r}" if loop.error else ""
            raise APIError(503, f"the engine is {loop.state.value}{why}", headers={"Retry-After": "5"})

    async def run_request(request: Request, prep, chat: bool):
        arrival = time.perf_counter()
        ready()
        run = Run(ctx, prep, arrival)
        run.submit()
        renderer = Renderer(run, ctx.model_name, chat)
        if prep.stream:
            return StreamingResponse(_stream(request, run, renderer, metrics), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        body = await _respond_unless_disconnected(request, run, renderer)
        return Response(status_code=499) if body is None else JSONResponse(body)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse(CompletionRequest, await read_json(request))
        return await run_request(request, prepare_completion(ctx, req), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse(ChatCompletionRequest, await read_json(request))
        return await run_request(request, prepare_chat(ctx, req), chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": ctx.model_name, "object": "model", "created": int(time.time()), "owned_by": "fms_paged",
            "root": ctx.model_root, "max_model_len": ctx.max_model_len}]}

    @app.get("/health")
    async def health():
        ready()
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/version")
    async def version():
        return {"version": fms_paged.__version__}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await read_json(request)
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        if "messages" in body:
            req = parse(ChatCompletionRequest, body)
            tools = None if req.tools is None else check_tools(req.tools)
            ids = chat_prompt(ctx, req.messages, req.add_generation_prompt, tools)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise APIError(400, f"prompt: expected a string, got {type(prompt).__name__}",
                               param="prompt")
            add = body.get("add_special_tokens", True)
            if not isinstance(add, bool):
                raise APIError(400, f"add_special_tokens: expected a bool, got {add!r}",
                               param="add_special_tokens")
            ids = ctx.tokenizer.encode(prompt, add_special_tokens=add) if prompt else []
        return {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await read_json(request)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise APIError(400, f"tokens: expected a list of token ids, got {tokens!r:.80}", param="tokens")
        bad = [t for t in tokens if not 0 <= t < ctx.vocab_size]
        if bad:
            raise APIError(400, f"tokens: {bad[0]} is outside the vocabulary [0, {ctx.vocab_size})",
                           param="tokens")
        return {"prompt": ctx.tokenizer.decode(tokens)}

    return app
