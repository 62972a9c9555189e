"""Soft targets: `cross_entropy` datums whose `target_tokens` and `weights` are (N, K), as
tinker-cookbook's distillation sends them (SDFT's top-K targets, `train_off_policy`, and the
(N, K) custom loss of SDFT's `reverse=True`, whose weights the SDK sends as a sparse CSR tensor),
through the pinned `tinker` SDK, unmodified, against the service on loopback (tiny, fp32, CPU)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import tinker
from tinker import types

from tinker_pipelines.algorithms.tinker_losses import MAX_SOFT_TARGETS
from tinker_pipelines.serving.tinker import wire
from tinker_pipelines.serving.tinker.launch import start_service

KEY = "tml-test-key"
TOKENS = [5, 9, 13, 21, 34, 55, 3, 8, 2, 7]
N, K = len(TOKENS), 4


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    handle = start_service("tiny", home=tmp_path_factory.mktemp("tinker"), api_key=KEY, device="cpu",
                           dtype="float32", gap_timeout_s=3.0, worker_args=["--threads", str(torch.get_num_threads())])
    yield handle
    handle.stop()


@pytest.fixture
def client(service):
    sc = tinker.ServiceClient(base_url=service.url, api_key=KEY)
    yield sc
    sc.close("success").result()


def _soft(seed: int = 0, k: int = K, zero_prompt: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, k) targets and weights; the first `zero_prompt` positions weigh nothing, as a prompt."""
    g = torch.Generator().manual_seed(seed)
    targets_NK = torch.randint(0, 200, (N, k), generator=g)
    weights_NK = torch.rand(N, k, generator=g)
    weights_NK[:zero_prompt] = 0
    return targets_NK, weights_NK


def _datum(targets, weights) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(TOKENS),
                       loss_fn_inputs={"target_tokens": types.TensorData.from_torch(targets),
                                       "weights": types.TensorData.from_torch(weights)})


def _logprobs(out, i: int) -> np.ndarray:
    td = out.loss_fn_outputs[i]["logprobs"]
    return np.asarray(td.data, np.float32).reshape(td.shape)


@pytest.mark.e2e  # a worker process and an HTTP service
def test_n_by_k_targets_come_back_n_by_k_equal_to_each_column_alone_in_order(client):
    tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
    targets_NK, weights_NK = _soft()
    hard = _datum(targets_NK[:, 0], weights_NK[:, 0])
    out = tc.forward([hard, _datum(targets_NK, weights_NK), hard], "cross_entropy").result()
    assert [out.loss_fn_outputs[i]["logprobs"].shape for i in range(3)] == [[N], [N, K], [N]]
    soft_NK = _logprobs(out, 1)
    for k in range(K):
        alone = tc.forward([_datum(targets_NK[:, k], weights_NK[:, k])], "cross_entropy").result()
        np.testing.assert_allclose(soft_NK[:, k], _logprobs(alone, 0), atol=1e-5)
    np.testing.assert_allclose(_logprobs(out, 0), soft_NK[:, 0], atol=1e-5)
    # cross_entropy over soft targets is -sum(weights_NK * logprobs_NK)
    alone = tc.forward([_datum(targets_NK, weights_NK)], "cross_entropy").result()
    assert alone.metrics["loss:sum"] == pytest.approx(float(-(weights_NK.numpy() * soft_NK).sum()), rel=1e-4)


@pytest.mark.e2e  # a worker process and an HTTP service
def test_a_soft_target_step_trains_as_its_columns_do(client):
    targets_NK, weights_NK = _soft(seed=2)
    soft = client.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
    cols = client.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
    a = soft.forward_backward([_datum(targets_NK, weights_NK)], "cross_entropy").result()
    b = cols.forward_backward([_datum(targets_NK[:, k], weights_NK[:, k]) for k in range(K)], "cross_entropy").result()
    assert a.metrics["loss:sum"] == pytest.approx(b.metrics["loss:sum"], rel=1e-5)
    for tc in (soft, cols):
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = [_logprobs(tc.forward([_datum(targets_NK, weights_NK)], "cross_entropy").result(), 0) for tc in (soft, cols)]
    np.testing.assert_allclose(after[0], after[1], atol=1e-5)
    assert not np.allclose(after[0], _logprobs(a, 0), atol=1e-3)  # the step moved them


@pytest.mark.e2e  # a worker process and an HTTP service
def test_a_custom_loss_over_soft_targets_sends_sparse_weights_and_trains(client):
    """SDFT `reverse=True`: `forward_backward_custom` over (N, K) targets; the SDK sends the
    gradient weights -dC/dlogprobs, mostly 0 at the prompt, as a sparse CSR tensor."""
    tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=4).result()
    targets_NK, weights_NK = _soft(seed=5, zero_prompt=8)
    datum = _datum(targets_NK, weights_NK)
    assert types.TensorData.from_torch_sparse(-weights_NK).sparse_crow_indices is not None  # what the SDK sends

    def loss_fn(data, logprobs_list):
        lp_NK = logprobs_list[0]
        assert tuple(lp_NK.shape) == (N, K)
        return -(data[0].loss_fn_inputs["weights"].to_torch() * lp_NK).sum(), {"custom:sum": 1.0}

    out = tc.forward_backward_custom([datum], loss_fn).result()
    assert out.metrics["custom:sum"] == 1.0
    expected = -(weights_NK.numpy() * _logprobs(out, 0)).sum()
    assert out.metrics["loss:sum"] == pytest.approx(float(expected), rel=1e-4)
    assert out.metrics["surrogate_loss:sum"] == pytest.approx(float(expected), rel=1e-4)


@pytest.mark.e2e
@pytest.mark.parametrize("inputs, field", [
    ({"target_tokens": torch.zeros(N, MAX_SOFT_TARGETS + 1, dtype=torch.long),
      "weights": torch.zeros(N, MAX_SOFT_TARGETS + 1)}, "target_tokens"),
    ({"target_tokens": torch.zeros(N, K, dtype=torch.long), "weights": torch.zeros(N, K - 1)}, "weights"),
    ({"target_tokens": torch.zeros(N + 1, K, dtype=torch.long), "weights": torch.zeros(N + 1, K)}, "target_tokens"),
])
def test_bad_soft_targets_are_a_400_naming_the_field(client, inputs, field):
    tc = client.create_lora_training_client(base_model="tiny", rank=4).result()
    datum = types.Datum(model_input=types.ModelInput.from_ints(TOKENS),
                        loss_fn_inputs={k: types.TensorData.from_torch(v) for k, v in inputs.items()})
    with pytest.raises(tinker.BadRequestError, match=f"loss_fn_inputs.{field}"):
        tc.forward([datum], "cross_entropy").result()


@pytest.mark.e2e  # a worker process and an HTTP service
def test_soft_targets_belong_to_cross_entropy_only(client):
    tc = client.create_lora_training_client(base_model="tiny", rank=4).result()
    targets_NK, _ = _soft()
    datum = types.Datum(model_input=types.ModelInput.from_ints(TOKENS), loss_fn_inputs={
        "target_tokens": types.TensorData.from_torch(targets_NK),
        "logprobs": types.TensorData.from_torch(torch.zeros(N)),
        "advantages": types.TensorData.from_torch(torch.ones(N))})
    with pytest.raises(tinker.BadRequestError, match="target_tokens must be a 1-D int tensor"):
        tc.forward_backward([datum], "importance_sampling").result()


def _csr_tensor(dense: torch.Tensor) -> "wire.pb.Tensor":
    td = types.TensorData.from_torch_sparse(dense)
    msg = wire.pb.Tensor(dtype=wire.pb.DTYPE_FLOAT32, shape=td.shape)
    msg.sparse_csr.values = np.asarray(td.data, np.float32).tobytes()
    msg.sparse_csr.crow_indices = np.asarray(td.sparse_crow_indices, np.int64).tobytes()
    msg.sparse_csr.col_indices = np.asarray(td.sparse_col_indices, np.int64).tobytes()
    return msg


def test_a_sparse_tensor_is_read_dense_within_its_bound():
    dense = torch.zeros(6, 3)
    dense[4, 1], dense[5, 0] = -0.5, 2.0
    msg = _csr_tensor(dense)
    assert torch.equal(wire._tensor(msg, "x", max_sparse_cells=18), dense)
    with pytest.raises(wire.WireError, match="at most 17 cells"):
        wire._tensor(msg, "x", max_sparse_cells=17)  # a declared shape is bounded before allocating
    msg.sparse_csr.col_indices = np.asarray([1, 3], np.int64).tobytes()  # column 3 of 3
    with pytest.raises(wire.WireError, match="not a CSR tensor of shape"):
        wire._tensor(msg, "x", max_sparse_cells=18)
