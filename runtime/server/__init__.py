"""OpenAI-compatible HTTP server (FastAPI) around the pipeline-parallel AsyncEngine.

``create_app(engine, config, api_key=None)`` builds the app for a started engine;
``python -m runtime.serve`` is the command line that starts both.
"""

from runtime.server.app import create_app
from runtime.server.errors import APIError

__all__ = ["APIError", "create_app"]
