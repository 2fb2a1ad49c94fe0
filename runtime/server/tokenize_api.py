"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's request and response shapes.

/tokenize takes either ``{"prompt": str, "add_special_tokens": true}`` or a chat
``{"messages": [...], "add_generation_prompt": true, "continue_final_message": false,
"chat_template_kwargs": {...}, "add_special_tokens": false}`` (rendered with the model's template,
exactly as /v1/chat/completions renders it), plus ``"return_token_strs": true`` for the tokens'
strings; it answers ``{"count", "max_model_len", "tokens", "token_strs"}``. /detokenize takes
``{"tokens": [ids]}`` and answers ``{"prompt": text}``. Both accept an optional ``model``. Bad
input is a 400 naming the field, as for the generation endpoints.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from runtime.server.errors import APIError
from runtime.server.request_checks import check_template_kwargs, check_token_list
from runtime.server.schemas import ChatMessage


class TokenizeRequest(BaseModel):
    """POST /tokenize: exactly one of ``prompt`` and ``messages``."""
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _check_kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return check_template_kwargs(v)


class DetokenizeRequest(BaseModel):
    """POST /detokenize."""
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int]

    @field_validator("tokens")
    @classmethod
    def _check_tokens(cls, v: list[int]) -> list[int]:
        return check_token_list(v) if v else v


def install_tokenize_routes(app: FastAPI, handlers: Any, read_json, require_engine) -> None:
    """Add /tokenize and /detokenize to ``app`` (``handlers``: the app's OpenAIHandlers;
    ``read_json``: the app's body reader; ``require_engine``: 503 unless the engine runs)."""
    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        """Token ids of a prompt or a rendered chat (vLLM's shape)."""
        body = TokenizeRequest.model_validate(await read_json(request))
        require_engine()
        handlers.check_model(body.model)
        tok = handlers.engine.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise APIError("Send exactly one of 'prompt' and 'messages'.", param="prompt",
                           code="invalid_value")
        if body.prompt is not None:
            ids = await handlers.tokenize("tokenize", "prompt", tok.encode, body.prompt,
                                          add_special_tokens=body.add_special_tokens is not False)
        else:
            if body.continue_final_message and body.add_generation_prompt is not False:
                raise APIError("continue_final_message needs add_generation_prompt set to false",
                               param="continue_final_message", code="invalid_value")
            messages = [m.as_template_dict() for m in body.messages]
            text = await handlers.tokenize(
                "tokenize", "messages", tok.apply_chat_template, messages,
                add_generation_prompt=body.add_generation_prompt is not False,
                continue_final_message=bool(body.continue_final_message),
                **(body.chat_template_kwargs or {}))
            ids = tok.encode(text, add_special_tokens=bool(body.add_special_tokens))
        out = {"count": len(ids), "max_model_len": handlers.config.scheduler.max_model_len,
               "tokens": ids, "token_strs": None}
        if body.return_token_strs:
            out["token_strs"] = [tok.id_to_token(i) for i in ids]
        return JSONResponse(out)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        """Text of token ids (vLLM's shape: ``{"prompt": text}``)."""
        body = DetokenizeRequest.model_validate(await read_json(request))
        require_engine()
        handlers.check_model(body.model)
        handlers.check_token_ids(body.tokens, "tokens")
        return JSONResponse({"prompt": handlers.engine.tokenizer.decode(body.tokens)})
