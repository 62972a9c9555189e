"""The `serve` job: deploy the OpenAI-compatible endpoint (`tinker-pipelines serve`) on loopback.

One op starts the server process in its own session (it outlives the run, as a deployment does),
waits until it answers, and records its URL, process id and log file in the run's metadata. Stop
it with `kill <pid>`. The endpoint reads the same registry and artifact store as the run
(`TINKER_HOME`, or `TINKER_DEPLOYMENT=production`'s, from the environment it inherits).
"""

import dagster as dg
from pydantic import Field

from tinker_pipelines.serving.launch import DEFAULT_HOST, start_server_process
from tinker_pipelines.tracking import default_home


class ServeConfig(dg.Config):
    """What the endpoint serves and where (fields as `tinker-pipelines serve` takes them)."""

    models: list[str] = Field(default_factory=list, description="Registered versions to load at start "
                              "(NAME@ALIAS, NAME/VERSION); the first names the base when `model` is empty.")
    model: str = Field("", description="The base: catalog name or model directory ('' = the first version's base).")
    port: int = Field(8000, description="Port on 127.0.0.1 (0: any free port).")
    max_adapters: int = Field(4, description="Adapters kept loaded (least recently used evicted).")
    worker: str = Field("", description="Serve from the resident worker at this socket ('' = in-process).")
    timeout_s: float = Field(300.0, description="How long to wait for the server to answer.")


@dg.op(tags={"kind": "openai"})
def serve_endpoint(context: dg.OpExecutionContext, config: ServeConfig) -> str:
    """Start the endpoint; its URL is the output and, with pid and log, the metadata."""
    args = [*config.models, "--max-adapters", str(config.max_adapters)]
    if config.model:
        args += ["--model", config.model]
    if config.worker:
        args += ["--worker", config.worker]
    logs = default_home().root / "serving"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{context.run.run_id}.log"
    try:
        proc, url = start_server_process(args, DEFAULT_HOST, config.port or None, log, config.timeout_s)
    except RuntimeError as e:
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
        raise dg.Failure(f"the endpoint did not start: {e}{': ' + tail[0] if tail else ''}") from e
    context.log.info(f"serving at {url} (pid {proc.pid}; stop it with kill {proc.pid})")
    context.add_output_metadata({"url": url, "pid": proc.pid, "log": str(log), "models": ", ".join(config.models)})
    return url


@dg.job(description="Deploy the OpenAI-compatible endpoint over the base and registered adapters on 127.0.0.1; "
                    "the URL is in the op's metadata.")
def serve():
    serve_endpoint()
