"""The Tinker service's sample batcher (`serving.tinker.sampling.SampleBatcher`): a recipe's
batch, sent as one request per prompt over some milliseconds, reaches the worker as one decode.
`send` here is the batcher's own seam (the service passes `conn.sample`); it records the calls
and answers each prompt with a sample that names it."""

from __future__ import annotations

import asyncio
import threading

from tinker_pipelines.rollout.samples import Sample
from tinker_pipelines.serving.tinker.sampling import SampleBatcher
from tinker_pipelines.worker import messages as M


class Recorder:
    def __init__(self):
        self.sent: list[M.SampleCall] = []
        self.lock = threading.Lock()

    def __call__(self, conn, call: M.SampleCall) -> M.SampleReply:
        with self.lock:
            self.sent.append(call)
        samples = [Sample(tuple(p), (0.0,) * len(p), "length") for p in call.prompts for _ in range(call.num_samples)]
        return M.SampleReply(samples=samples)


def _call(i: int, **kw) -> M.SampleCall:
    return M.SampleCall(adapter="a", prompts=[[i, i + 1]], max_new_tokens=4, **kw)


async def _arrive(batcher: SampleBatcher, calls: list[M.SampleCall], gap_s: float) -> list:
    conn = object()
    tasks = []
    for c in calls:
        tasks.append(asyncio.ensure_future(batcher.sample(conn, c)))
        await asyncio.sleep(gap_s)
    return await asyncio.gather(*tasks)


def test_a_batch_arriving_over_milliseconds_is_one_decode():
    send = Recorder()
    batcher = SampleBatcher(send)
    calls = [_call(i) for i in range(64)]
    answers = asyncio.run(_arrive(batcher, calls, gap_s=0.002))
    assert len(send.sent) == 1 and len(send.sent[0].prompts) == 64
    assert [a.samples[0].tokens for a in answers] == [tuple(c.prompts[0]) for c in calls]  # each its own rows


def test_seeded_calls_go_alone_and_a_full_batch_goes_at_once():
    send = Recorder()
    batcher = SampleBatcher(send, max_rows=16)
    calls = [_call(i, num_samples=4) for i in range(8)] + [_call(100, seed=7)]
    answers = asyncio.run(_arrive(batcher, calls, gap_s=0.0))
    seeded = [c for c in send.sent if c.seed is not None]
    assert len(seeded) == 1 and seeded[0].prompts == [[100, 101]]
    assert all(len(c.prompts) * c.num_samples <= 16 for c in send.sent)
    assert sum(len(c.prompts) for c in send.sent) == 9
    assert [len(a.samples) for a in answers] == [4] * 8 + [1]


def test_a_lone_call_waits_no_longer_than_the_settle_time():
    send = Recorder()
    batcher = SampleBatcher(send, settle_s=0.02, max_wait_s=5.0)

    async def one():
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await batcher.sample(object(), _call(1))
        return loop.time() - t0

    assert asyncio.run(one()) < 1.0 and len(send.sent) == 1


def test_a_merged_call_that_fails_runs_again_call_by_call_so_only_the_bad_one_fails():
    """A fault the service's own checks did not catch (the worker refuses a row) fails that
    row's call alone; the calls merged with it get what they get without it. A dead worker
    fails every call at once, without a retry per call."""
    from tinker_pipelines.worker import WorkerDiedError, WorkerError

    send = Recorder()

    def refusing(conn, call):
        if any(t >= 1000 for p in call.prompts for t in p):
            with send.lock:
                send.sent.append(call)
            raise WorkerError("sample: token id 1000 is outside the vocabulary")
        return send(conn, call)
    batcher = SampleBatcher(refusing)
    calls = [_call(1), _call(999), _call(5)]

    async def run():
        return await asyncio.gather(*(asyncio.ensure_future(batcher.sample("c", c)) for c in calls),
                                    return_exceptions=True)
    good1, bad, good2 = asyncio.run(run())
    assert isinstance(bad, WorkerError) and "outside the vocabulary" in str(bad)
    assert good1.samples[0].tokens == (1, 2) and good2.samples[0].tokens == (5, 6)
    assert [len(c.prompts) for c in send.sent] == [3, 1, 1, 1]  # the merged call, then each alone

    died = []

    def dead(conn, call):
        died.append(call)
        raise WorkerDiedError("the worker died")
    batcher = SampleBatcher(dead)

    async def run_dead():
        return await asyncio.gather(*(asyncio.ensure_future(batcher.sample("c", c)) for c in calls[:2]),
                                    return_exceptions=True)
    assert all(isinstance(x, WorkerDiedError) for x in asyncio.run(run_dead()))
    assert len(died) == 1
