"""Our scheduler tags (`tinker/devices`, `tinker/memory_gb`, `tinker/sharing`) as the
`dagster-k8s/config` op tag that Dagster's `k8s_job_executor` turns into each step's Kubernetes Job.

On Kubernetes, Kubernetes places pods: our ledger and `place` are not involved. What the tags
become there (docs/deployment.md):

- **exclusive** (default): the step's container requests and limits `devices` whole GPUs
  (`nvidia.com/gpu` unless told otherwise); the device plugin hands them out and never shares
  one. `memory_gb` (the smallest acceptable *device*) has no Kubernetes resource: given
  `gpu_memory_label` (e.g. GPU feature discovery's `nvidia.com/gpu.memory`, in MiB) it becomes a
  required node affinity `label > memory_gb - 1 MiB`; without it, it is not expressed.
- **lora**: the step is a thin client of a resident worker pod that owns the GPU, so it requests
  no GPU. It must land on that worker's node (the worker listens on a Unix socket there):
  `worker_labels` adds a required pod affinity to the worker's pods on the same node
  (`kubernetes.io/hostname`), `worker_socket` mounts the socket's directory from the node
  (hostPath, same path) and sets `TINKER_WORKER`. `memory_gb` (what the step's adapter takes on
  the worker's device) is checked by nobody on Kubernetes. A worker is one device, so a lora
  step asks for exactly one.

`host_memory_gb`, `node_selector` and `tolerations` apply to both kinds (a lora pod on a tainted
GPU node needs the toleration too: requesting no GPU, it gets no automatic one).

Pure: no dagster or dagster_k8s import; the tag value is JSON, which dagster-k8s reads with
`json.loads` and validates in `get_user_defined_k8s_config` (tested against that code in
tests/test_k8s_config.py). Quantities are decimal: GB here are 1e9 bytes, as in `Inventory`.
"""

from __future__ import annotations

import json
import math
import posixpath
from collections.abc import Mapping, Sequence
from typing import Any

from tinker_pipelines.scheduler.placement import TAG_PREFIX, StepNeeds, needs_from_tags

K8S_CONFIG_TAG = "dagster-k8s/config"
"""The op tag dagster-k8s reads (`dagster_k8s.job.USER_DEFINED_K8S_CONFIG_KEY`)."""
DEFAULT_GPU_RESOURCE = "nvidia.com/gpu"
"""The extended resource NVIDIA's device plugin advertises."""
HOSTNAME_TOPOLOGY = "kubernetes.io/hostname"
WORKER_SOCKET_VOLUME = "tinker-worker-socket"


def _quantity_gb(gb: float, what: str) -> str:
    if isinstance(gb, bool) or not isinstance(gb, (int, float)) or not math.isfinite(gb) or gb <= 0:
        raise ValueError(f"{what} must be a positive number of GB, got {gb!r}")
    return f"{_ceil(gb * 1000)}M"  # whole decimal megabytes, rounded up


def _ceil(x: float) -> int:
    """Round up, but not for float noise: 0.1 GB is 100 MB, not 101."""
    return math.ceil(round(x, 6))


def k8s_config_for(needs: StepNeeds, gpu_resource: str = DEFAULT_GPU_RESOURCE, *,
                   host_memory_gb: float | None = None,
                   node_selector: Mapping[str, str] | None = None,
                   tolerations: Sequence[Mapping[str, Any]] | None = None,
                   gpu_memory_label: str | None = None,
                   worker_labels: Mapping[str, str] | None = None,
                   worker_socket: str | None = None) -> dict[str, Any]:
    """The `dagster-k8s/config` value (before JSON encoding) for a step with `needs`.

    - `host_memory_gb`: the container's memory request and limit (RAM, not GPU memory); None
      leaves it to the executor's `resources` / `step_k8s_config`, which dagster-k8s deep-merges.
    - `node_selector`, `tolerations`: put into the pod spec as given (snake_case or camelCase keys).
    - `gpu_memory_label`: a node label holding each GPU's memory in MiB; exclusive steps with
      `memory_gb` > 0 then require `label > ceil(memory_gb * 1e9 / 2**20) - 1`.
    - `worker_labels` (lora): labels of the resident worker's pods; a required pod affinity puts
      the step on the same node. A lora step needs it or a `node_selector` pinning the node.
    - `worker_socket` (lora): absolute path of the worker's socket on the node; its directory is
      mounted from the node at the same path and `TINKER_WORKER` names the socket.

    `gpu_memory_label` applies to exclusive steps only and `worker_*` to lora steps only, so
    that one set of options can serve every op. Raises ValueError for arguments that cannot
    work (see the module docstring).
    """
    if not isinstance(needs, StepNeeds):
        raise ValueError(f"needs must be a StepNeeds, got {needs!r}")
    if not isinstance(gpu_resource, str) or "/" not in gpu_resource:
        raise ValueError(f"gpu_resource must be an extended resource name like 'nvidia.com/gpu', got {gpu_resource!r}")
    container: dict[str, Any] = {}
    pod: dict[str, Any] = {}
    requests: dict[str, str] = {}
    if host_memory_gb is not None:
        requests["memory"] = _quantity_gb(host_memory_gb, "host_memory_gb")
    if node_selector:
        pod["node_selector"] = {str(k): str(v) for k, v in node_selector.items()}
    if tolerations:
        pod["tolerations"] = [dict(t) for t in tolerations]

    if needs.sharing == "exclusive":
        requests[gpu_resource] = str(needs.devices)
        if gpu_memory_label and needs.memory_gb > 0:
            mib = _ceil(needs.memory_gb * 1e9 / 2**20)
            pod["affinity"] = {"node_affinity": {"required_during_scheduling_ignored_during_execution": {
                "node_selector_terms": [{"match_expressions": [
                    {"key": gpu_memory_label, "operator": "Gt", "values": [str(mib - 1)]}]}]}}}
    else:  # lora: a client of the worker pod on its node, no GPU of its own
        if needs.devices != 1:
            raise ValueError(f"a 'lora' step on Kubernetes runs on one resident worker (one device), "
                             f"got {TAG_PREFIX}devices {needs.devices}")
        if not worker_labels and not node_selector:
            raise ValueError("a 'lora' step on Kubernetes requests no GPU and must run on its worker's node: "
                             "pass worker_labels (pod affinity to the worker) or a node_selector pinning the node")
        if worker_labels:
            pod["affinity"] = {"pod_affinity": {"required_during_scheduling_ignored_during_execution": [
                {"label_selector": {"match_labels": {str(k): str(v) for k, v in worker_labels.items()}},
                 "topology_key": HOSTNAME_TOPOLOGY}]}}
        if worker_socket is not None:
            if not isinstance(worker_socket, str) or not posixpath.isabs(worker_socket) or worker_socket.endswith("/"):
                raise ValueError(f"worker_socket must be the absolute path of the worker's socket, got {worker_socket!r}")
            directory = posixpath.dirname(worker_socket)
            container["env"] = [{"name": "TINKER_WORKER", "value": worker_socket}]
            container["volume_mounts"] = [{"name": WORKER_SOCKET_VOLUME, "mount_path": directory}]
            pod["volumes"] = [{"name": WORKER_SOCKET_VOLUME, "host_path": {"path": directory, "type": "Directory"}}]

    if requests:
        # Extended resources must have requests == limits; memory too, so the step is not
        # evicted for using what it was promised.
        container["resources"] = {"requests": dict(requests), "limits": dict(requests)}
    config: dict[str, Any] = {}
    if container:
        config["container_config"] = container
    if pod:
        config["pod_spec_config"] = pod
    return config


def with_k8s_tags(tags: Mapping[str, str], gpu_resource: str = DEFAULT_GPU_RESOURCE,
                  **options: Any) -> dict[str, str]:
    """`tags` plus `dagster-k8s/config` derived from its `tinker/*` tags (op tags only, as for
    `needs_from_tags`, whose ValueError names a malformed tag). Tags without any `tinker/*` key
    come back unchanged (the step needs no device). `options` go to `k8s_config_for`.

    A `dagster-k8s/config` already in `tags` is an error rather than a guess at merging: put
    extra settings in the executor's `step_k8s_config` or `per_step_k8s_config`, which
    dagster-k8s deep-merges with this tag.
    """
    out = dict(tags)
    needs = needs_from_tags(tags)
    if needs is None:
        return out
    if K8S_CONFIG_TAG in tags:
        raise ValueError(f"tags already set {K8S_CONFIG_TAG!r}; put extra Kubernetes settings in the k8s "
                         "executor's step_k8s_config / per_step_k8s_config instead")
    out[K8S_CONFIG_TAG] = json.dumps(k8s_config_for(needs, gpu_resource, **options), sort_keys=True)
    return out


__all__ = ["DEFAULT_GPU_RESOURCE", "K8S_CONFIG_TAG", "k8s_config_for", "with_k8s_tags"]
