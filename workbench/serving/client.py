"""A remote engine: any OpenAI-compatible server (vLLM, vLLM-Ascend, `workbench serve`) as a
token source with client-side timings, plus its Prometheus /metrics as a dict.

    from .client import RemoteEngine

    with RemoteEngine("http://127.0.0.1:8000", api_key=None) as remote:
        for ev in remote.stream("Why is the sky blue?", max_tokens=64, chat=True):
            print(ev.text, end="", flush=True)        # ev.time, ev.since_start, ev.gap ...
        print(ev.stats.ttft, ev.stats.tpot)           # the last event carries the summary
        remote.poll_metrics()["num_requests_running"]

Events look like the local engine's TokenEvent (request_id, text, index, time, finished,
finish_reason), so a UI can consume either. Times are the client's `time.monotonic()` when a
chunk arrived. A request's token count is `RemoteStats.num_tokens`: the server's usage report
when it sends one, else the text chunks (one token each on workbench and vLLM, except where a
server holds text back for a multi-byte character or a stop string).

Servers differ (vLLM, `workbench serve`, strict ones such as `transformers serve`), so the
client sends only OpenAI's base fields plus what the caller asked for: vLLM's extensions
(`VLLM_EXTENSIONS`) go out only when given, and a server that refuses one gets an error that
names the field, the server and the way to leave it out. `probe()` asks once what the server
offers (`/v1/models`, `/metrics`, `/version`, `/health`).

The serving benchmark over this client is `workbench.bench.serving`.

Needs httpx (the 'serve' extra); from the workbench only its latency definitions
(`workbench.telemetry`), so TTFT/TPOT mean the same here as in the engine.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterator

import httpx

from .prometheus import parse_prometheus, summarize_metrics
from .stream_events import (RemoteError, RemoteStats, RemoteTokenEvent, SSEParser, _error,  # noqa: F401
                            _Tracker, sse_data)

__all__ = ["RemoteEngine", "RemoteError", "RemoteTokenEvent", "RemoteStats", "ServerInfo",
           "VLLM_EXTENSIONS"]

ENDPOINTS = ("completions", "chat", "responses")
"""The APIs a request can go to: /v1/completions, /v1/chat/completions, /v1/responses."""

VLLM_EXTENSIONS = ("ignore_eos", "min_tokens", "top_k", "min_p", "repetition_penalty",
                   "stop_token_ids", "skip_special_tokens", "include_stop_str_in_output")
"""Request fields vLLM adds to OpenAI's. Strict servers refuse them (`transformers serve`
answers 422), so nothing here sends one unless the caller asked for it."""

_LEAVE_OUT = {"ignore_eos": "workbench bench --no-ignore-eos, SamplingParams(ignore_eos=False)",
              "top_k": "top_k=0", "stop_token_ids": "stop_token_ids=[]"}
"""How to stop sending an extension, for the error that says a server refused it."""


@dataclass
class ServerInfo:
    """What a server offers, asked once when connecting (`RemoteEngine.probe()`)."""
    url: str
    models: list[str]
    """GET /v1/models (may be empty: a server started without a model loads one on request)."""
    metrics: bool
    """Whether GET /metrics answers with vLLM's metric names."""
    metrics_why: str
    """How /metrics answered, in a few words ('vLLM names', '404', 'no vLLM names', ...)."""
    version: str | None
    """GET /version's `version` (vLLM, workbench serve); None where there is none."""
    health: bool | None
    """GET /health answered 200 (None: the server has no /health)."""


# ---- the client -----------------------------------------------------------------------------
class RemoteEngine:
    """One OpenAI-compatible server.

    url: the server's root (`http://host:8000`; a trailing `/v1` is accepted too).
    model: the model id to request; None asks /v1/models and takes the first.
    api_key: sent as `Authorization: Bearer ...` when given.
    """

    def __init__(self, url: str, model: str | None = None, api_key: str | None = None,
                 timeout: float = 600.0):
        url = url.rstrip("/")
        if url.endswith("/v1"):
            url = url[:-3]
        self.url = url
        self.api_key = api_key
        self._model = model
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = httpx.Timeout(timeout, connect=10.0)
        self._client = httpx.Client(base_url=url, headers=self._headers, timeout=self._timeout)
        self._aclient: httpx.AsyncClient | None = None

    # ---- plumbing ----
    def close(self) -> None:
        self._client.close()

    async def aclose(self) -> None:
        if self._aclient is not None:
            await self._aclient.aclose()
            self._aclient = None

    def __enter__(self) -> "RemoteEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _async_client(self) -> httpx.AsyncClient:
        if self._aclient is None:
            self._aclient = httpx.AsyncClient(base_url=self.url, headers=self._headers,
                                              timeout=self._timeout,
                                              limits=httpx.Limits(max_connections=None))
        return self._aclient

    # ---- server info ----
    def health(self) -> bool:
        """Whether GET /health answers 200."""
        try:
            return self._client.get("/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def models(self) -> list[str]:
        r = self._client.get("/v1/models")
        if r.status_code != 200:
            raise _error(r.status_code, r.text)
        return [m["id"] for m in r.json().get("data", [])]

    @property
    def model(self) -> str:
        """The model id requests name: the one given, else the first /v1/models lists."""
        if self._model is None:
            names = self.models()
            if not names:
                raise RemoteError(None, f"the server at {self.url} lists no models; name the "
                                  "one to request (model=..., or --model on the command line)",
                                  param="model", where="GET /v1/models")
            self._model = names[0]
        return self._model

    @model.setter
    def model(self, name: str) -> None:
        self._model = name

    def probe(self) -> ServerInfo:
        """Ask once what this server offers. /v1/models must answer (a refused key or a wrong
        URL raises here); /metrics, /version and /health may be missing."""
        models = self.models()
        try:
            r = self._client.get("/metrics", timeout=10.0)
            if r.status_code != 200:
                metrics, why = False, str(r.status_code)
            else:
                metrics = any(k.startswith("vllm:") for k in parse_prometheus(r.text))
                why = "vLLM names" if metrics else "no vLLM names"
        except httpx.HTTPError as e:
            metrics, why = False, type(e).__name__
        version = None
        try:
            r = self._client.get("/version", timeout=5.0)
            if r.status_code == 200:
                version = str(r.json().get("version"))
        except (httpx.HTTPError, ValueError, AttributeError):
            pass
        try:
            status = self._client.get("/health", timeout=5.0).status_code
            health = None if status == 404 else status == 200
        except httpx.HTTPError:
            health = False
        return ServerInfo(self.url, models, metrics, why, version, health)

    def poll_metrics(self) -> dict | None:
        """GET /metrics, parsed; None when the server has none (404). Keys: time (time.time()),
        num_requests_running, num_requests_waiting, kv_cache_usage_perc (0..1),
        num_preemptions_total, prompt_tokens_total, generation_tokens_total,
        request_success_total ({reason: n}), histograms ({name: {count, sum, mean, buckets}}),
        samples (every parsed sample). Other failures raise RemoteError."""
        return self._metrics(self._client.get("/metrics"))

    async def apoll_metrics(self) -> dict | None:
        """asyncio version of `poll_metrics`."""
        return self._metrics(await self._async_client().get("/metrics"))

    @staticmethod
    def _metrics(r: httpx.Response) -> dict | None:
        if r.status_code == 404:
            return None
        if r.status_code != 200:
            raise _error(r.status_code, r.text)
        samples = parse_prometheus(r.text)
        return {"time": time.time(), **summarize_metrics(samples), "samples": samples}

    def _refused(self, status: int, text: str, body: dict) -> RemoteError:
        """The error for a refused request; where the server refused a vLLM extension that
        was sent, it says which field, which server, and how to leave the field out."""
        err = _error(status, text)
        if status in (400, 422):
            for name in VLLM_EXTENSIONS:
                if name in body and (err.param == name or re.search(rf"\b{name}\b", err.message)):
                    how = _LEAVE_OUT.get(name, f"leave {name} out")
                    return RemoteError(status, f"the server at {self.url} refuses {name!r}, a vLLM "
                                       f"extension to the OpenAI API ({err.message}); send it only "
                                       f"to servers that take it ({how})", name,
                                       "unsupported_extension", err.body)
        return err

    # ---- requests ----
    def _request(self, prompt, max_tokens: int, chat: bool | None, temperature: float,
                 extra: dict, endpoint: str | None = None) -> tuple[str, dict]:
        if endpoint is None:
            if chat is None:
                chat = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)
            endpoint = "chat" if chat else "completions"
        if endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint: must be one of {', '.join(ENDPOINTS)} (got {endpoint!r})")
        if endpoint == "responses":     # a text, or messages (which are Responses items too)
            body = {"model": self.model, "input": prompt, "max_output_tokens": max_tokens,
                    "temperature": temperature, "stream": True, **extra}
            return "/v1/responses", body
        body: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens,
                                "temperature": temperature, "stream": True,
                                "stream_options": {"include_usage": True}}
        if endpoint == "chat":
            if isinstance(prompt, str):
                prompt = [{"role": "user", "content": prompt}]
            body["messages"] = prompt
            path = "/v1/chat/completions"
        else:
            body["prompt"] = prompt
            path = "/v1/completions"
        body.update(extra)
        return path, body

    def stream(self, prompt, max_tokens: int = 128, *, chat: bool | None = None,
               temperature: float = 0.0, endpoint: str | None = None,
               **params) -> Iterator[RemoteTokenEvent]:
        """Stream one request. `prompt`: text (completions; chat=True wraps it as a user turn),
        chat messages (chat completions) or token ids. `endpoint` (ENDPOINTS) names the API
        instead: "responses" sends the prompt as the Responses API's `input` and reads its
        typed events (text and reasoning deltas are the chunks). Extra keyword arguments go into the
        request body as is, and nothing else is added (top_p, seed, stop; vLLM's top_k,
        ignore_eos, ...). Yields one event per text chunk, then a final event (finished=True)
        whose `stats` hold the timings.
        Closing the iterator early closes the connection (the server aborts the request)."""
        path, body = self._request(prompt, max_tokens, chat, temperature, params, endpoint)
        tracker = _Tracker(time.monotonic())
        with self._client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                r.read()
                raise self._refused(r.status_code, r.text, body)
            for data in sse_data(r.iter_lines()):
                if data.strip() == "[DONE]":
                    break
                ev = tracker.feed(data)
                if ev is not None:
                    yield ev
        yield tracker.final()

    async def astream(self, prompt, max_tokens: int = 128, *, chat: bool | None = None,
                      temperature: float = 0.0, endpoint: str | None = None,
                      **params) -> AsyncIterator[RemoteTokenEvent]:
        """asyncio version of `stream` (many may run at once)."""
        path, body = self._request(prompt, max_tokens, chat, temperature, params, endpoint)
        tracker = _Tracker(time.monotonic())
        async with self._async_client().stream("POST", path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                raise self._refused(r.status_code, r.text, body)
            parser = SSEParser()
            async for line in r.aiter_lines():
                data = parser.feed(line)
                if data is not None and data.strip() == "[DONE]":
                    break
                ev = tracker.feed(data) if data is not None else None
                if ev is not None:
                    yield ev
            else:
                data = parser.end()
                if data is not None and data.strip() != "[DONE]":
                    ev = tracker.feed(data)
                    if ev is not None:
                        yield ev
        yield tracker.final()

    def generate(self, prompt, max_tokens: int = 128, **kw) -> RemoteStats:
        """Run one request to the end; its text and timings."""
        ev = None
        for ev in self.stream(prompt, max_tokens, **kw):
            pass
        assert ev is not None and ev.stats is not None
        return ev.stats
