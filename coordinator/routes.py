"""Every HTTP route the coordinator serves, as one table (after Ollama's server/routes.go
GenerateRoutes). Handlers are methods of small objects that hold the Coordinator; the app,
its error handlers and access checks are coordinator/http_api.py, the request bodies each
route documents coordinator/request_schemas.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from coordinator.blob_routes import BlobRoutes
from coordinator.embedding_routes import EmbeddingRoutes
from coordinator.model_routes import ModelRoutes
from coordinator.ollama_routes import OllamaRoutes
from coordinator.openai_routes import OpenAIRoutes
from coordinator.responses_routes import ResponsesRoutes
from coordinator.ops_routes import OpsRoutes
from coordinator.service import Coordinator
from coordinator.token_routes import TokenRoutes
from coordinator.ui_routes import UiRoutes


@dataclass(frozen=True)
class Route:
    method: str  # GET, HEAD, POST, DELETE
    path: str
    handler: Callable  # an async FastAPI endpoint


def generate_routes(c: Coordinator) -> list[Route]:
    ops, ollama = OpsRoutes(c), OllamaRoutes(c)
    models, embeddings = ModelRoutes(c), EmbeddingRoutes(c)
    blobs = BlobRoutes(models)
    openai = OpenAIRoutes(c, ollama)  # chat completions goes through Ollama's chat
    responses = ResponsesRoutes(c, ollama)  # so does the Responses API
    tokens = TokenRoutes(c)
    ui = UiRoutes(c)
    return [
        Route("GET",    "/",                      ollama.root),
        Route("HEAD",   "/",                      ollama.root),
        Route("GET",    "/metrics",               ops.metrics),
        Route("GET",    "/internal/workers",      ops.workers),
        Route("GET",    "/health",                ops.health),
        Route("GET",    "/version",               ops.version),
        Route("GET",    "/ui",                    ui.page),  # the built-in page
        Route("GET",    "/ui/data",               ui.data),  # what it polls

        # Ollama (HEAD on version and tags, as Ollama)
        Route("GET",    "/api/version",           ollama.api_version),
        Route("HEAD",   "/api/version",           ollama.api_version),
        Route("GET",    "/api/tags",              ollama.tags),
        Route("HEAD",   "/api/tags",              ollama.tags),
        Route("GET",    "/api/ps",                ollama.ps),
        Route("POST",   "/api/show",              ollama.show),
        Route("POST",   "/api/chat",              ollama.chat),
        Route("POST",   "/api/generate",          ollama.generate),

        # OpenAI
        Route("GET",    "/v1/models",             openai.models),
        Route("GET",    "/v1/models/{name:path}", openai.one_model),
        Route("POST",   "/v1/chat/completions",   openai.chat_completions),
        Route("POST",   "/v1/completions",        openai.completions),
        Route("POST",   "/v1/responses",          responses.create),
        Route("POST",   "/tokenize",              tokens.tokenize),    # vLLM's
        Route("POST",   "/detokenize",            tokens.detokenize),  # vLLM's
        Route("GET",    "/tokenizer_info",        tokens.tokenizer_info),  # vLLM's

        # Model management over the model store
        Route("POST",   "/api/pull",              models.pull),
        Route("POST",   "/api/copy",              models.copy),
        Route("POST",   "/api/create",            models.create),
        Route("DELETE", "/api/delete",            models.delete),
        Route("HEAD",   "/api/blobs/{digest}",    blobs.head),
        Route("POST",   "/api/blobs/{digest}",    blobs.push),

        # Embeddings
        Route("POST",   "/api/embed",             embeddings.embed),
        Route("POST",   "/api/embeddings",        embeddings.embeddings_legacy),
        Route("POST",   "/v1/embeddings",         embeddings.openai_embeddings),
    ]
