"""--api-server-count: the API servers' proxy of the engine renders chats with --chat-template.

The API servers tokenize and apply the chat template, but their proxy (``RemoteEngine``) loaded
the model's own tokenizer without the engine's ``--chat-template``: with ``--chat-template hermes``
a request with ``tools`` got 400 "this server's chat template does not render tools".
"""

import asyncio

import pytest

from runtime.config import EngineConfig
from runtime.model.chat_templates import HERMES, load_serving_tokenizer
from runtime.server import remote_engine


async def _idle(self):
    await asyncio.sleep(3600)


@pytest.mark.asyncio
async def test_remote_engine_tokenizer_carries_the_chat_template(monkeypatch):
    monkeypatch.setattr(remote_engine.RemoteEngine, "_recv_loop", _idle)
    monkeypatch.setattr(remote_engine.RemoteEngine, "_watch_loop", _idle)
    config = EngineConfig(chat_template="hermes")
    proxy = remote_engine.RemoteEngine(config, 0, None, None, None,
                                       {"model_name": "m", "pid": 1, "num_kv_blocks": 64})
    try:
        assert proxy.tokenizer.chat_template == HERMES
        assert "tools" in proxy.tokenizer.chat_template_variables
    finally:
        proxy._recv.cancel()
        proxy._watch.cancel()


def test_load_serving_tokenizer_keeps_the_model_template_without_the_flag():
    from runtime.engine.plan import plan_pipeline
    path = plan_pipeline(EngineConfig()).model_path
    plain = load_serving_tokenizer(path, None)
    assert plain.chat_template != HERMES and "tools" not in plain.chat_template_variables
    assert load_serving_tokenizer(path, "hermes").chat_template == HERMES
