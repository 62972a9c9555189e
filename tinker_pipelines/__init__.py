"""tinker-pipelines: agentic RL for LLMs. Environments, algorithms and learner as a plain
library; the Dagster runtime in `assets/`, `resources/` and `assets.definitions`."""

__version__ = "0.1.0"
