"""An OpenAI-compatible endpoint over the base model and registered adapter versions.

- `app`: the FastAPI app (`/v1/chat/completions`, `/v1/completions`, `/v1/models`, `/health`).
- `protocol`: OpenAI's request fields, checked, and its response objects.
- `backend`: where tokens come from: the resident worker's `Engine` in this process (mixed-adapter
  batches per clock cycle) or a running worker over its socket; the LRU cache of loaded adapters.
- `registry`: which version a `model` field names (`MODEL@ALIAS`, `MODEL/VERSION`), its verified files.
- `launch`: `build_server`, `ServerThread`, `start_server_process` (`tinker-pipelines serve`).
- `client`: `EndpointSampler` (the rollout code against the endpoint) and `evaluate_endpoint`.

Library code: nothing here imports dagster.
"""

from tinker_pipelines.serving.errors import ServingError

__all__ = ["ServingError"]
