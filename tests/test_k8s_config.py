"""Our `tinker/*` op tags as the step pods dagster-k8s would create (no cluster: the Kubernetes
API client is a mock that records the V1Job it is given).

Through dagster-k8s's own code: `get_user_defined_k8s_config(tags)` then
`construct_dagster_k8s_job` (what both its run launcher and step handler call); the executor
itself (`k8s_job_executor`'s creation function with executor config, then
`K8sStepHandler.launch_step` for each op of a job, which deep-merges the executor's
`step_k8s_config` with the op's `dagster-k8s/config` tag and submits the Job); and
`K8sRunLauncher.launch_run` for a run whose run tags carry the config (the repo's jobs, which use
the in-process executor, run as one pod). Nothing here schedules a pod.
"""

from __future__ import annotations

import json
import subprocess
import sys
from unittest import mock

import pytest

from tinker_pipelines.scheduler.k8s import K8S_CONFIG_TAG, k8s_config_for, with_k8s_tags
from tinker_pipelines.scheduler.placement import StepNeeds

GPU = "nvidia.com/gpu"
TOLERATE_GPU = [{"key": GPU, "operator": "Exists", "effect": "NoSchedule"}]
WORKER_LABELS = {"app.kubernetes.io/name": "tinker-worker", "tinker-pipelines/base": "qwen3-8b"}
WORKER_SOCKET = "/var/run/tinker/workers/qwen3-8b.sock"

# An exclusive 2-GPU full-parameter step (on >= 80 GB devices), a 1-GPU SFT step, a LoRA step.
FULL_TAGS = with_k8s_tags({"tinker/devices": "2", "tinker/memory_gb": "80", "tinker/sharing": "exclusive"},
                          host_memory_gb=128, tolerations=TOLERATE_GPU, gpu_memory_label="nvidia.com/gpu.memory")
SFT_TAGS = with_k8s_tags({"tinker/devices": "1", "kind": "pytorch"}, host_memory_gb=32.5)
LORA_TAGS = with_k8s_tags({"tinker/sharing": "lora", "tinker/memory_gb": "12"}, tolerations=TOLERATE_GPU,
                          worker_labels=WORKER_LABELS, worker_socket=WORKER_SOCKET)

MINIMAL_KUBECONFIG = """
apiVersion: v1
kind: Config
current-context: fake
contexts: [{name: fake, context: {cluster: fake}}]
clusters: [{name: fake, cluster: {}}]
"""


def _container(job):
    containers = job.spec.template.spec.containers
    assert len(containers) == 1
    return containers[0]


def _resources(container) -> dict:
    r = container.resources
    if r is None or isinstance(r, dict):
        return dict(r or {})
    return {k: v for k, v in r.to_dict().items() if v is not None and k != "claims"}


def _check_full(job, default_requests: dict | None = None):
    c, spec = _container(job), job.spec.template.spec
    res = _resources(c)
    assert res["limits"][GPU] == "2" and res["requests"][GPU] == "2"
    assert res["limits"]["memory"] == res["requests"]["memory"] == "128000M"
    for key, value in (default_requests or {}).items():
        assert res["requests"][key] == value  # the executor's defaults survive the deep merge
    assert [t.to_dict() if hasattr(t, "to_dict") else t for t in spec.tolerations][0]["key"] == GPU
    term = spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution.node_selector_terms[0]
    expr = term.match_expressions[0]
    # 80 GB = 76293.9 MiB: a node whose GPUs report >= 76294 MiB qualifies
    assert (expr.key, expr.operator, expr.values) == ("nvidia.com/gpu.memory", "Gt", ["76293"])


def _check_sft(job, default_requests: dict | None = None):
    res = _resources(_container(job))
    assert res["limits"][GPU] == res["requests"][GPU] == "1"
    assert res["limits"]["memory"] == res["requests"]["memory"] == "32500M"
    for key, value in (default_requests or {}).items():
        assert res["requests"][key] == value
    assert job.spec.template.spec.affinity is None  # no memory_gb, no gpu_memory_label


def _check_lora(job, default_requests: dict | None = None):
    c, spec = _container(job), job.spec.template.spec
    res = _resources(c)
    assert GPU not in (res.get("limits") or {}) and GPU not in (res.get("requests") or {})
    assert dict(res.get("requests") or {}) == dict(default_requests or {})
    (term,) = spec.affinity.pod_affinity.required_during_scheduling_ignored_during_execution
    assert term.topology_key == "kubernetes.io/hostname"
    assert term.label_selector.match_labels == WORKER_LABELS
    env = {e.name: e.value for e in c.env}
    assert env["TINKER_WORKER"] == WORKER_SOCKET
    (mount,) = [m for m in c.volume_mounts if m.name == "tinker-worker-socket"]
    (volume,) = [v for v in spec.volumes if v.name == "tinker-worker-socket"]
    assert mount.mount_path == volume.host_path.path == "/var/run/tinker/workers"
    assert volume.host_path.type == "Directory"
    assert spec.tolerations[0].key == GPU  # no GPU request, so no automatic toleration


CASES = [("full", FULL_TAGS, _check_full), ("sft", SFT_TAGS, _check_sft), ("lora", LORA_TAGS, _check_lora)]


@pytest.mark.parametrize("name,tags,check", CASES, ids=[c[0] for c in CASES])
def test_tags_to_job_through_dagster_k8s(name, tags, check):
    pytest.importorskip("dagster_k8s")
    from dagster_k8s.job import DagsterK8sJobConfig, construct_dagster_k8s_job, get_user_defined_k8s_config

    user_defined = get_user_defined_k8s_config(tags)  # json.loads + schema validation, as the executor does
    job = construct_dagster_k8s_job(DagsterK8sJobConfig(job_image="tinker-pipelines:test"),
                                    args=["dagster", "api", "execute_step"], job_name=f"dagster-step-{name}",
                                    user_defined_k8s_config=user_defined)
    assert _container(job).image == "tinker-pipelines:test"
    check(job)


def _k8s_job():
    """A job on the k8s executor whose ops carry our tags (module level: `reconstructable`)."""
    import dagster as dg
    from dagster_k8s import k8s_job_executor

    @dg.op(tags=FULL_TAGS)
    def full_step():
        return 1

    @dg.op(tags=SFT_TAGS)
    def sft_step(x):
        return x

    @dg.op(tags=LORA_TAGS)
    def lora_step(x):
        return x

    @dg.op
    def cpu_step(x):
        return x

    @dg.job(executor_def=k8s_job_executor)
    def tinker_on_k8s():
        cpu_step(lora_step(sft_step(full_step())))

    return tinker_on_k8s


def test_k8s_executor_and_run_launcher_submit_jobs(tmp_path, monkeypatch):
    pytest.importorskip("dagster_k8s")
    from dagster import reconstructable
    from dagster._config import process_config, resolve_to_config_type
    from dagster._core.execution.api import create_execution_plan
    from dagster._core.execution.context.system import PlanData, PlanOrchestrationContext
    from dagster._core.execution.context_creation_job import create_context_free_log_manager
    from dagster._core.execution.retries import RetryMode
    from dagster._core.executor.init import InitExecutorContext
    from dagster._core.executor.step_delegating.step_handler.base import StepHandlerContext
    from dagster._core.launcher import LaunchRunContext
    from dagster._core.test_utils import create_run_for_test, instance_for_test
    from dagster._grpc.types import ExecuteStepArgs
    from dagster_k8s import k8s_job_executor
    from dagster_k8s.client import DagsterKubernetesClient
    from dagster_k8s.executor import _K8S_EXECUTOR_CONFIG_SCHEMA

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(MINIMAL_KUBECONFIG)
    batch_api = mock.MagicMock()
    real_client = DagsterKubernetesClient.production_client
    monkeypatch.setattr(DagsterKubernetesClient, "production_client", staticmethod(
        lambda **_: real_client(batch_api_override=batch_api, core_api_override=mock.MagicMock())))

    launcher = {"module": "dagster_k8s", "class": "K8sRunLauncher", "config": {
        "instance_config_map": "dagster-instance", "service_account_name": "dagster", "job_image": "tinker-pipelines:test",
        "load_incluster_config": False, "kubeconfig_file": str(kubeconfig)}}
    defaults = {"cpu": "2", "memory": "8G"}  # every step's default; a step's own memory wins
    executor_config = {"job_namespace": "tinker",
                       "step_k8s_config": {"container_config": {"resources": {"requests": defaults}}}}
    recon = reconstructable(_k8s_job)
    job_def = recon.get_definition()
    (tmp_path / "home").mkdir()
    with instance_for_test(temp_dir=str(tmp_path / "home"), overrides={"run_launcher": launcher}) as instance:
        processed = process_config(resolve_to_config_type(_K8S_EXECUTOR_CONFIG_SCHEMA), executor_config)
        assert processed.success, processed.errors
        executor = k8s_job_executor.executor_creation_fn(InitExecutorContext(
            job=recon, executor_def=k8s_job_executor, executor_config=processed.value, instance=instance))
        run = create_run_for_test(instance, job_name=job_def.name, job_code_origin=recon.get_python_origin())
        plan = create_execution_plan(recon)
        plan_context = PlanOrchestrationContext(
            plan_data=PlanData(job=recon, dagster_run=run, instance=instance, execution_plan=plan,
                               raise_on_error=True, retry_mode=RetryMode.DISABLED),
            log_manager=create_context_free_log_manager(instance, run), executor=executor, output_capture=None)
        jobs = {}
        for step in ("full_step", "sft_step", "lora_step", "cpu_step"):
            batch_api.reset_mock()
            list(executor._step_handler.launch_step(StepHandlerContext(  # noqa: SLF001 (as dagster-k8s's tests)
                instance=instance, plan_context=plan_context, steps=plan.steps,
                execute_step_args=ExecuteStepArgs(recon.get_python_origin(), run.run_id, [step]))))
            (call,) = batch_api.create_namespaced_job.call_args_list
            assert call.kwargs["namespace"] == "tinker"
            jobs[step] = call.kwargs["body"]

        # The repo's jobs as they are (in-process executor): one run pod, its GPU from a run tag,
        # which the run launcher reads (the step handler ignores run-level dagster-k8s/config).
        batch_api.reset_mock()
        run_tags = {K8S_CONFIG_TAG: json.dumps(k8s_config_for(StepNeeds(1), host_memory_gb=32.5))}
        whole_run = create_run_for_test(instance, job_name=job_def.name, job_code_origin=recon.get_python_origin(),
                                        tags=run_tags)
        instance.run_launcher.launch_run(LaunchRunContext(dagster_run=whole_run, workspace=None))
        (call,) = batch_api.create_namespaced_job.call_args_list
        run_job = call.kwargs["body"]

    _check_full(jobs["full_step"], {"cpu": "2"})
    _check_sft(jobs["sft_step"], {"cpu": "2"})
    _check_lora(jobs["lora_step"], defaults)
    assert _resources(_container(jobs["cpu_step"])) == {"requests": defaults}  # no tinker tags: no GPU
    for step, job in jobs.items():
        assert job.spec.template.metadata.labels["dagster/op"] == step
    _check_sft(run_job)
    assert run_job.metadata.labels["app.kubernetes.io/component"] == "run_worker"


def test_config_values():
    assert k8s_config_for(StepNeeds(1)) == {"container_config": {"resources": {
        "requests": {GPU: "1"}, "limits": {GPU: "1"}}}}
    assert k8s_config_for(StepNeeds(4), "amd.com/gpu")["container_config"]["resources"]["limits"] == {"amd.com/gpu": "4"}
    selected = k8s_config_for(StepNeeds(1), node_selector={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"})
    assert selected["pod_spec_config"] == {"node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}}
    # memory_gb is device memory: without a label to match it is not turned into anything
    assert "pod_spec_config" not in k8s_config_for(StepNeeds(1, 40.0))
    # one options dict for every op: worker_* only touch lora steps, gpu_memory_label only exclusive ones
    shared = {"worker_labels": WORKER_LABELS, "worker_socket": WORKER_SOCKET, "gpu_memory_label": "gpu.memory"}
    assert k8s_config_for(StepNeeds(1), **shared) == k8s_config_for(StepNeeds(1))
    lora = k8s_config_for(StepNeeds(1, 12.0, "lora"), **shared)
    assert "resources" not in lora["container_config"] and "node_affinity" not in lora["pod_spec_config"]["affinity"]
    pinned = k8s_config_for(StepNeeds(1, 12.0, "lora"), node_selector={"kubernetes.io/hostname": "gpu-3"})
    assert pinned == {"pod_spec_config": {"node_selector": {"kubernetes.io/hostname": "gpu-3"}}}
    assert k8s_config_for(StepNeeds(1), host_memory_gb=0.1)["container_config"]["resources"]["limits"]["memory"] == "100M"
    assert with_k8s_tags({"kind": "mlflow"}) == {"kind": "mlflow"}  # not a device step: unchanged
    assert json.loads(SFT_TAGS[K8S_CONFIG_TAG]) == k8s_config_for(StepNeeds(1), host_memory_gb=32.5)


@pytest.mark.parametrize("tags,options,match", [
    ({"tinker/devices": "x"}, {}, r"tag tinker/devices must be a positive integer, got 'x'"),
    ({"tinker/memory_gb": "lots"}, {}, r"tag tinker/memory_gb must be a non-negative number, got 'lots'"),
    ({"tinker/gpus": "2"}, {}, r"unknown scheduler tag 'tinker/gpus'"),
    ({"tinker/sharing": "lora", "tinker/memory_gb": "8"}, {}, r"must run on its worker's node"),
    ({"tinker/sharing": "lora", "tinker/memory_gb": "8", "tinker/devices": "2"}, {"worker_labels": WORKER_LABELS},
     r"one resident worker \(one device\), got tinker/devices 2"),
    ({"tinker/sharing": "lora", "tinker/memory_gb": "8"}, {"worker_labels": WORKER_LABELS, "worker_socket": "w.sock"},
     r"worker_socket must be the absolute path"),
    ({"tinker/devices": "1"}, {"host_memory_gb": 0}, r"host_memory_gb must be a positive number of GB, got 0"),
    ({"tinker/devices": "1"}, {"gpu_resource": "gpu"}, r"gpu_resource must be an extended resource name"),
    ({"tinker/devices": "1", K8S_CONFIG_TAG: "{}"}, {}, r"already set 'dagster-k8s/config'"),
])
def test_bad_tags_and_options(tags, options, match):
    with pytest.raises(ValueError, match=match):
        with_k8s_tags(tags, **options)


def test_library_does_not_import_dagster():
    code = ("import sys, tinker_pipelines.scheduler.k8s; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('dagster', 'dagster_k8s', 'kubernetes')); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
