"""GET /v1/models: the one model this server serves, in OpenAI's model list."""

from __future__ import annotations

import time

from fastapi import APIRouter

from draftsmith.serve.openai.http_errors import documented_errors
from draftsmith.serve.openai.state import ServerState


def models_router(state: ServerState) -> APIRouter:
    """/v1/models lists the served model, with its checkpoint directory (`root`) and context length."""
    router = APIRouter()

    @router.get("/v1/models", responses=documented_errors(401))
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "draftsmith", "root": str(state.frontend.model_dir),
                                            "max_model_len": state.max_model_len}]}

    return router
