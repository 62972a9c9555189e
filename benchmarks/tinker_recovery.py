"""How long the Tinker service takes to serve again after its worker is SIGKILLed.

    python -m benchmarks.tinker_recovery                          # the tiny catalogue base
    python -m benchmarks.tinker_recovery --model DIR --kills 3    # e.g. a `model-dir` of SmolLM2

Starts a service (`launch.start_service`, CPU, fp32), makes a training client, steps and saves
it, makes a base sampler, then kills the worker `--kills` times. For each kill: seconds to the
first successful `sample` of the sampler made before the kill (sent at once, it waits for the
new worker), to `healthz` answering ok, and to a training client made from the save answering a
`forward` with the saved weights' logprobs. Last line: JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
import urllib.request

import numpy as np

KEY = "tml-recovery"


def _healthy(url: str) -> bool:
    request = urllib.request.Request(f"{url}/api/v1/healthz", headers={"X-API-Key": KEY})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status == 200
    except OSError:
        return False


def measure(model: str, kills: int) -> dict:
    import tinker
    from tinker import types

    from tinker_pipelines.serving.tinker.launch import start_service

    os.environ.setdefault("TINKER_TELEMETRY", "0")
    datum = types.Datum(model_input=types.ModelInput.from_ints([5, 9, 13, 21, 34]), loss_fn_inputs={
        "target_tokens": types.TensorData.from_numpy(np.asarray([9, 13, 21, 34, 55], np.int64)),
        "weights": types.TensorData.from_numpy(np.ones(5, np.float32))})
    prompt, params = types.ModelInput.from_ints([5, 9]), types.SamplingParams(max_tokens=4, seed=3)
    handle = start_service(model, api_key=KEY, device="cpu", dtype="float32")
    rows = []
    try:
        with tinker.ServiceClient(base_url=handle.url, api_key=KEY) as sc:
            tc = sc.create_lora_training_client(model, rank=8, seed=0).result()
            tc.forward_backward([datum], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
            path = tc.save_state("recovery").result().path
            want = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
            base = sc.create_sampling_client(base_model=model).result()
            base.sample(prompt, 1, params).result()
            for _ in range(kills):
                os.kill(handle.worker_pid, signal.SIGKILL)
                killed = time.monotonic()
                base.sample(prompt, 1, params).result()
                sample_s = time.monotonic() - killed
                while not _healthy(handle.url):
                    time.sleep(0.1)
                health_s = time.monotonic() - killed
                resumed = sc.create_training_client_from_state_with_optimizer(path).result()
                got = resumed.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
                rows.append({"first_sample_s": round(sample_s, 1), "healthz_ok_s": round(health_s, 1),
                             "resumed_client_s": round(time.monotonic() - killed, 1), "same_logprobs": got == want})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        handle.stop()
    return {"model": model, "kills": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="catalogue name or model directory")
    parser.add_argument("--kills", type=int, default=2)
    args = parser.parse_args()
    print(json.dumps(measure(args.model, args.kills)))


if __name__ == "__main__":
    main()
