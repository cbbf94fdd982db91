"""The OpenAI request bodies we accept, checked into engine settings, and the error body every
failure is answered with (`{"error": {"message", "type", "param", "code"}}`, as the `openai`
client parses it).

Fields we do not implement are accepted and ignored (clients send their defaults, e.g. vLLM's
benchmark client sends `repetition_penalty: 1.0`), except those that would change the output
silently: a non-default value of one of those is a 400 naming it (`UNSUPPORTED`)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError


class APIError(Exception):
    """An answer other than 200: the HTTP status and OpenAI's error body."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code or self.status}}


def bad(param: str, message: str) -> APIError:
    """A 400 naming `param` (a field, or a path into one: `a.b[2].c`) in its message and `param`."""
    return APIError(400, f"{param}: {message}", param=param)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool = False


class _Common(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    return_token_ids: bool = False  # vLLM's extension: `token_ids` in each choice, `prompt_token_ids`
    prompt_logprobs: int | None = None  # vLLM's: the prompt tokens' log-probabilities, top k of each
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_* (one of them)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's beam search: n beams, the n best hypotheses returned (greedy: temperature 0 or unset)
    use_beam_search: bool = False
    length_penalty: float | int = 1.0
    early_stopping: bool | str = False


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[Any] | None = None  # checked by fms_paged.serve.tools, which names the bad entry
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True


# fields that change the output when set to anything but their default: refused, not ignored
UNSUPPORTED = {
    "presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "logit_bias": None,
    "suffix": None, "min_tokens": 0, "best_of": None,
    "functions": None, "function_call": None, "min_p": 0, "bad_words": None, "allowed_token_ids": None,
}


def parse(model: type[BaseModel], body: Any) -> BaseModel:
    """A request body -> `model`, or a 400 naming the first offending field and its value."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"] if not str(x).startswith(("function-", "union[")))
        param = loc.split(".")[0] if loc else None
        got = f" (got {err['input']!r})" if err.get("type") != "missing" else ""
        raise APIError(400, f"{loc or 'body'}: {err['msg']}{got}", param=param) from None
    for name, default in UNSUPPORTED.items():
        value = (req.model_extra or {}).get(name, default)
        if value is not None and value != default and value != {} and value != []:
            raise bad(name, f"{value!r} is not supported by this server (it would change the "
                      f"output); leave it unset" + (f" or {default!r}" if default is not None else ""))
    return req

