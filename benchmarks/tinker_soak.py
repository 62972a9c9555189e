"""The Tinker service left running under many clients and faults: a soak (issue 48).

    python -m benchmarks.tinker_soak                                  # tiny model, 8 clients, 30 minutes
    python -m benchmarks.tinker_soak --model smollm2 --minutes 30     # SmolLM2-135M as a model directory
    python -m benchmarks.tinker_soak --minutes 2 --client-kill-first 40 --worker-kill-at 60   # the CI schedule

One service (`launch.start_service`, CPU fp32, this process) with a short session TTL (30 s: a
killed client's session is reaped within the soak) and a short least checkpoint TTL (5 s). N SDK
clients (`benchmarks/tinker_soak_client.py`, each a process of its own, so a kill is real) loop
over random operations from a seeded RNG until the deadline: create a training client,
forward_backward, optim_step, forward, save_state (some with a short TTL), save_weights_for_sampler
then create_sampling_client, sample (one call, or several in flight that the service merges,
sometimes one with a token outside the vocabulary), a snapshot sampler, load from a save, delete a
checkpoint, finish the session and start a new one; and one bad request in ~20 operations (a bad
TTL or name, bad Adam parameters, out-of-vocabulary tokens, an oversized top-k, max_tokens beyond
the context, an unknown or deleted or expired path, a field of the wrong type), which must fail
with a 4xx naming its field. A probe client times a 1-datum `forward` every second.

Faults, on a schedule: a client SIGKILLed while one of its calls is in flight every 2 minutes
(its successor resumes from the killed one's last save; its session must be reaped), and the
worker SIGKILLed once, at half time (the clients whose training clients it held resume from
their last acknowledged save_state: the loaded weights must give the probe logprobs they gave at
the save, and the next save's step count must be the client's own).

Prints a progress line a minute. Last line: one JSON object (keys in docs/benchmarks.md):
`soak_calls`, `soak_unexpected_failures`, `soak_lost_steps`, `soak_hung_futures`,
`soak_rss_growth`, `soak_adapters_leaked`, `soak_recovery_s`, `soak_p99_small_call_s` and more.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import cookbook_runs as cr

REPO = Path(__file__).resolve().parents[1]
CLIENT = REPO / "benchmarks" / "tinker_soak_client.py"
KEY = "tml-tinker-soak"
SESSION_TTL_S = 30.0
"""A session without a heartbeat this long is reaped (the SDK beats every 10 s)."""
MIN_TTL_S = 5
"""The shortest checkpoint TTL the service takes (hosted Tinker's is an hour)."""
HUNG_S = 60.0
WORKER_OPS = {"create", "forward_backward", "optim_step", "forward", "save_state", "save_weights_for_sampler",
              "create_sampling_client", "sample", "sample_merged", "save_weights_and_get_sampling_client", "load",
              "probe_forward"}
"""Calls that need the worker (the rest are answered by the service alone)."""
MODELS = {"tiny": {"rank": 4, "max_len": 24}, "smollm2": {"rank": 8, "max_len": 32}}


class SoakError(RuntimeError):
    """The soak could not run (not a finding of the soak); one line."""


@dataclass
class Schedule:
    """When faults happen, in seconds from the soak's start."""

    client_kills: list[float]
    worker_kill: float | None
    rss_at: float
    """When the baseline resident memory is measured."""


def schedule(seconds: float, kill_every: float, first_kill: float | None, worker_kill_at: float | None) -> Schedule:
    first = kill_every if first_kill is None else first_kill
    kills, t = [], first
    while 0 < t < seconds - 10:
        kills.append(t)
        t = t + kill_every if kill_every > 0 else seconds  # an interval of 0: the first kill only
    worker = seconds / 2 if worker_kill_at is None else worker_kill_at
    return Schedule(kills, worker if 0 <= worker < seconds else None, min(300.0, seconds / 4))


class Tail:
    """The complete JSON lines added to a client's log since the last read."""

    def __init__(self, path: Path):
        self.path, self.offset, self.last = path, 0, None

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        out = [json.loads(line) for line in data[:end].splitlines() if line.strip()]
        if out:
            self.last = out[-1]
        return out


@dataclass
class Client:
    slot: str
    incarnation: int
    proc: subprocess.Popen
    log: Path
    tail: Tail
    session_id: str | None = None


@dataclass
class Tally:
    """Running counts of the calls the clients reported."""

    calls: int = 0
    by_outcome: dict[str, int] = field(default_factory=dict)
    bad: int = 0
    worker_kill: int = 0
    hung: int = 0
    probe_s: list[float] = field(default_factory=list)

    def add(self, r: dict) -> None:
        self.calls += 1
        self.by_outcome[r["outcome"]] = self.by_outcome.get(r["outcome"], 0) + 1
        self.bad += str(r.get("why") or "").startswith("bad:")
        self.worker_kill += r.get("why") == "worker_kill"
        self.hung += bool(r.get("hung"))
        if r["op"] == "probe_forward" and r["outcome"] == "ok":
            self.probe_s.append(r["end"] - r["start"])


def rss_mb(pid: int) -> float:
    """A process's resident memory now (VmRSS), MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise SoakError(f"/proc/{pid}/status has no VmRSS")


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def last_save(log: Path) -> dict | None:
    """The last acknowledged save_state without a TTL in a client's log: what its successor resumes from."""
    point = None
    for r in read_jsonl(log):
        if r.get("ev") == "call" and r["op"] == "save_state" and r["outcome"] == "ok" and r.get("ttl") is None \
                and r.get("path"):
            point = {"path": r["path"], "steps": r.get("steps"), "probe": r.get("probe")}
    return point


def read_jsonl(path: Path) -> list[dict]:
    """The complete lines of a log (a process killed mid-write leaves its last line cut)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in data[:data.rfind(b"\n") + 1].splitlines() if line.strip()]


class Soak:
    """The clients, the fault schedule and the measurements of one soak against `handle`."""

    def __init__(self, handle: Any, args: argparse.Namespace, work: Path, base: str, plan: Schedule):
        self.h, self.a, self.work, self.base, self.plan = handle, args, work, base, plan
        self.home = Path(handle.service.home)
        self.vocab = int(handle.service.runtime.info["vocab_size"])
        self.rng = random.Random(args.seed)
        self.clients: dict[str, Client] = {}
        self.crashes: list[dict] = []
        self.kills: list[dict] = []
        self.worker_kill: dict | None = None
        self.rss: dict[str, tuple[float, float]] = {}
        """'baseline' and 'end': (worker MB, service MB)."""
        self.tally = Tally()
        self.t0 = time.time()
        self.until = self.t0 + args.minutes * 60
        (work / "clients").mkdir(parents=True, exist_ok=True)

    # -- clients ------------------------------------------------------------------------------
    def start_client(self, slot: str, incarnation: int = 0, resume: dict | None = None) -> None:
        m = MODELS[self.a.model]
        log = self.work / "clients" / f"{slot}.{incarnation}.jsonl"
        argv = [sys.executable, str(CLIENT), "--url", self.h.url, "--key", KEY, "--base", self.base,
                "--home", str(self.home), "--log", str(log), "--until", str(self.until), "--vocab", str(self.vocab),
                "--slot", slot, "--incarnation", str(incarnation), "--seed", str(self.a.seed),
                "--rank", str(m["rank"]), "--max-len", str(m["max_len"]), "--think-s", str(self.a.think_s)]
        if self.plan.worker_kill is not None:
            argv += ["--worker-kill-at", str(self.t0 + self.plan.worker_kill)]
        if slot == "probe":
            argv += ["--probe-every", "1"]
        if resume is not None:
            argv += ["--resume", json.dumps(resume)]
        with open(self.work / "clients" / f"{slot}.{incarnation}.out", "wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=cr.client_env(self.h.url, KEY), cwd=self.work, start_new_session=True)
        self.clients[slot] = Client(slot, incarnation, proc, log, Tail(log))

    def read_logs(self) -> None:
        for c in self.clients.values():
            for r in c.tail.read():
                if r.get("ev") == "call":
                    self.tally.add(r)
                elif r.get("ev") == "session":
                    c.session_id = r["session_id"]

    def restart_crashed(self) -> None:
        """A client process that ended before the deadline, unkilled, is a failure of the soak: its
        log's last lines say why; a successor takes its place."""
        for c in list(self.clients.values()):
            if c.proc.poll() is not None and time.time() < self.until - 5:
                out = (self.work / "clients" / f"{c.slot}.{c.incarnation}.out").read_text(errors="replace")
                self.crashes.append({"client": f"{c.slot}.{c.incarnation}", "returncode": c.proc.returncode,
                                     "output": out.strip().splitlines()[-3:]})
                print(f"  client {c.slot}.{c.incarnation} exited with code {c.proc.returncode}: "
                      f"{(out.strip().splitlines() or ['(no output)'])[-1]}", flush=True)
                self.start_client(c.slot, c.incarnation + 1, last_save(c.log))

    # -- faults -------------------------------------------------------------------------------
    def kill_client(self) -> None:
        """SIGKILL a client while one of its calls that needs the worker is in flight (waiting up
        to 15 s for one); its successor resumes from its last save."""
        def in_call(c: Client) -> bool:
            last = c.tail.last or {}
            return last.get("ev") == "begin" and last.get("op") in WORKER_OPS and time.time() - last["t"] > 0.05
        alive = [c for c in self.clients.values() if c.slot != "probe" and c.proc.poll() is None]
        if not alive:
            return
        deadline, chosen = time.time() + 15, None
        while chosen is None and time.time() < deadline:
            self.read_logs()
            busy = [c for c in alive if in_call(c)]
            chosen = self.rng.choice(busy) if busy else None
            time.sleep(0 if chosen else 0.02)
        c = chosen or self.rng.choice(alive)
        c.proc.kill()
        c.proc.wait()
        at = time.time()
        self.read_logs()
        last = c.tail.last or {}
        kill = {"t": at, "client": f"{c.slot}.{c.incarnation}", "op": last.get("op"),
                "mid_call": last.get("ev") == "begin", "session_id": c.session_id, "reaped_at": None}
        self.kills.append(kill)
        print(f"  [{(at - self.t0) / 60:4.1f} min] SIGKILL client {kill['client']} "
              f"{'during ' + str(kill['op']) if kill['mid_call'] else 'between calls'} (session {c.session_id})",
              flush=True)
        self.start_client(c.slot, c.incarnation + 1, last_save(c.log))

    def check_reaps(self) -> None:
        svc = self.h.service
        for k in self.kills:
            sid = k["session_id"]
            if k["reaped_at"] is None and sid is not None:
                s = svc.sessions.get(sid)
                if (s is None or s.finished is not None) and not any(m.session_id == sid
                                                                     for m in list(svc.models.values())):
                    k["reaped_at"] = time.time()

    def kill_worker(self) -> None:
        pid = self.h.supervisor.proc.pid
        os.kill(pid, signal.SIGKILL)
        self.worker_kill = {"t": time.time(), "pid": pid}
        print(f"  [{(self.worker_kill['t'] - self.t0) / 60:4.1f} min] SIGKILL worker (pid {pid})", flush=True)

    # -- measurements -------------------------------------------------------------------------
    def sample_rss(self, tag: str) -> bool:
        """The worker's and this process's (the service's) resident memory; False while the
        worker is being replaced."""
        try:
            self.rss[tag] = (rss_mb(self.h.supervisor.proc.pid), rss_mb(os.getpid()))
        except (OSError, SoakError):
            return False
        return True

    def progress(self, now: float) -> None:
        t, svc = self.tally, self.h.service
        probe = percentile(t.probe_s[-120:], 0.5)
        mem = ""
        if self.sample_rss("now"):
            mem = f" | worker {self.rss['now'][0]:.0f} MB, service {self.rss['now'][1]:.0f} MB"
        loaded = ", ".join(f"{k} {v}" for k, v in svc.loaded_adapters().items())
        print(f"[{now / 60:4.1f} min] calls {t.calls}: ok {t.by_outcome.get('ok', 0)}, expected "
              f"{t.by_outcome.get('expected', 0)} (bad {t.bad}, worker kill {t.worker_kill}), unexpected "
              f"{t.by_outcome.get('unexpected', 0)}, hung {t.hung}{mem} | adapters {loaded} | probe p50 "
              f"{'-' if probe is None else f'{probe:.3f} s'} | kills {len(self.kills)} clients, "
              f"{'1 worker' if self.worker_kill else 'no worker'}", flush=True)

    # -- the run --------------------------------------------------------------------------------
    def run(self) -> None:
        self.start_client("probe")
        for i in range(self.a.clients):
            self.start_client(str(i))
        kills, minute, baseline = list(self.plan.client_kills), 60.0, False
        while time.time() < self.until:
            now = time.time() - self.t0
            self.read_logs()
            self.restart_crashed()
            self.check_reaps()
            if kills and now >= kills[0]:
                kills.pop(0)
                self.kill_client()
            if self.plan.worker_kill is not None and self.worker_kill is None and now >= self.plan.worker_kill:
                self.kill_worker()
            if not baseline and now >= self.plan.rss_at:
                baseline = self.sample_rss("baseline")
            if now >= minute:
                self.progress(now)
                minute += 60
            time.sleep(0.2)
        for _ in range(50):  # at the deadline, with every client still at work
            if self.sample_rss("end"):
                break
            time.sleep(0.2)
        self.progress(time.time() - self.t0)

    def wind_down(self) -> dict:
        """Wait for the clients to finish (they end their sessions), then for the reaper to end
        the killed ones' sessions; what is still loaded then, and what never resolved."""
        deadline = time.time() + HUNG_S + 60
        for c in self.clients.values():
            try:
                c.proc.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                print(f"  client {c.slot}.{c.incarnation} did not finish {HUNG_S + 60:.0f} s after the deadline; "
                      "killed", flush=True)
                c.proc.kill()
                c.proc.wait()
        self.read_logs()
        svc = self.h.service
        reap_by = time.time() + svc.session_ttl_s + min(30.0, svc.session_ttl_s / 4) + 15
        while time.time() < reap_by and (self.live_sessions() or svc.models):
            self.check_reaps()
            time.sleep(0.5)
        self.check_reaps()
        return {"live_sessions": len(self.live_sessions()), "service": svc.loaded_adapters(),
                "worker": self.worker_adapters(), "pending_futures": self.pending_futures()}

    def live_sessions(self) -> list[str]:
        return [sid for sid, s in list(self.h.service.sessions.items()) if s.finished is None]

    def worker_adapters(self) -> list[str] | None:
        """The adapters the worker itself hosts, less the OpenAI endpoint's own base (`serve-*`)."""
        from tinker_pipelines.worker.client import WorkerClient

        try:
            conn = WorkerClient(self.h.service.runtime.address, timeout_s=60)
        except Exception as e:  # noqa: BLE001 - reported, not fatal: the service's own count still stands
            print(f"  the worker's stats could not be read: {type(e).__name__}: {e}", flush=True)
            return None
        try:
            return [a for a in conn.stats()["adapters"] if not a.startswith("serve-")]
        finally:
            conn.close()

    def pending_futures(self) -> int:
        """The service's futures made more than HUNG_S ago and still unresolved."""
        entries = list(getattr(self.h.service.futures, "_entries", {}).values())
        now = time.monotonic()
        return sum(1 for e in entries if not e.future.done() and now - e.created > HUNG_S)

    # -- the figures --------------------------------------------------------------------------
    def results(self, end: dict) -> dict:
        records = [r for p in sorted((self.work / "clients").glob("*.jsonl")) for r in read_jsonl(p)]
        calls = [r for r in records if r.get("ev") == "call"]
        unexpected = [r for r in calls if r["outcome"] == "unexpected"]
        saves = [r for r in calls if r["op"] == "save_state" and r["outcome"] == "ok"
                 and r.get("record_steps") is not None and r.get("steps") is not None]
        probes = [r for r in records if r.get("ev") == "probe_check"]
        small = [r["end"] - r["start"] for r in calls if r["op"] == "probe_forward" and r["outcome"] == "ok"]
        reaped = [k for k in self.kills if k["reaped_at"] is not None]
        base, last = self.rss.get("baseline"), self.rss.get("end")
        self.report(unexpected)
        return {
            "soak_model": self.a.model, "soak_minutes": self.a.minutes, "soak_clients": self.a.clients,
            "soak_calls": len(calls),
            "soak_unexpected_failures": len(unexpected) + len(self.crashes),
            "soak_lost_steps": sum(r["lost_steps"] for r in saves) + sum(1 for r in probes if r["lost"]),
            "soak_hung_futures": sum(1 for r in calls if r.get("hung")) + end["pending_futures"],
            "soak_rss_growth": round(sum(last) / sum(base), 3) if base and last else None,
            "soak_adapters_leaked": max(sum(end["service"].values()), len(end["worker"] or [])),
            "soak_recovery_s": self.recovery_s(calls),
            "soak_p99_small_call_s": _round(percentile(small, 0.99)),
            "soak_p50_small_call_s": _round(percentile(small, 0.5)),
            "soak_expected_failures": sum(1 for r in calls if r["outcome"] == "expected"),
            "soak_bad_requests": sum(1 for r in calls if str(r.get("why") or "").startswith("bad:")),
            "soak_worker_kill_failures": sum(1 for r in calls if r.get("why") == "worker_kill"),
            "soak_client_kills": len(self.kills), "soak_client_kills_mid_call": sum(k["mid_call"] for k in self.kills),
            "soak_sessions_reaped": len(reaped),
            "soak_reap_s_max": _round(max((k["reaped_at"] - k["t"] for k in reaped), default=None)),
            "soak_worker_restart_s": self.restart_s(),
            "soak_saves_checked": len(saves), "soak_resumes_checked": len(probes),
            "soak_resumes_after_worker_kill": sum(1 for r in records if r.get("ev") == "loaded"
                                                  and r.get("why") == "worker_kill"),
            "soak_resumes_after_client_kill": sum(1 for r in records if r.get("ev") == "loaded"
                                                  and r.get("why") == "predecessor"),
            "soak_rss_mb": {"baseline": base and [round(x) for x in base], "end": last and [round(x) for x in last]},
            "soak_adapters_end": {"service": end["service"], "worker": end["worker"],
                                  "live_sessions": end["live_sessions"]},
            "soak_client_crashes": len(self.crashes),
        }

    def recovery_s(self, calls: list[dict]) -> float | None:
        """From the worker's SIGKILL to the end of the first successful call that needed the
        worker and was made after it."""
        if self.worker_kill is None:
            return None
        t = self.worker_kill["t"]
        after = [r["end"] for r in calls if r["outcome"] == "ok" and r["op"] in WORKER_OPS and r["start"] >= t]
        return _round(min(after) - t) if after else None

    def restart_s(self) -> float | None:
        losses = [self.h.supervisor.loss(g) for g in range(self.h.supervisor.generation)]
        done = [x for x in losses if x is not None and x.restarted_at is not None]
        return _round(max(x.restarted_at - x.at for x in done)) if done else None

    def report(self, unexpected: list[dict]) -> None:
        """The unexpected failures, a line each (all of them in WORK/unexpected.jsonl)."""
        with open(self.work / "unexpected.jsonl", "w") as f:
            for r in unexpected:
                f.write(json.dumps(r) + "\n")
        for r in unexpected[:20]:
            print(f"  unexpected: client {r['c']} {r['op']} at {(r['start'] - self.t0) / 60:.2f} min: {r['why']}: "
                  f"{r.get('error', '')}", flush=True)
        if len(unexpected) > 20:
            print(f"  ... {len(unexpected) - 20} more in {self.work / 'unexpected.jsonl'}", flush=True)
        for c in self.crashes:
            print(f"  client {c['client']} exited with code {c['returncode']}: {c['output']}", flush=True)

    def stop_clients(self) -> None:
        for c in self.clients.values():
            if c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait()


def _round(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


# -- tinker-cookbook's DPO and distillation trainers, after the soak ---------------------------------
COOKBOOK_SKIP = ("log_path", "student_start")


def cookbook_part(handle: Any, base: str, work: Path) -> dict:
    """tinker-cookbook's DPO and SDFT trainers, unmodified (`benchmarks/cookbook_dpo_distill.py`'s
    `run_dpo` and `run_distill`, from `.venv-cookbook`), against the service the soak leaves
    behind once its clients are gone; {} where that module or environment is missing."""
    try:
        from benchmarks import cookbook_dpo_distill as trainers
    except ImportError as e:
        print(f"cookbook trainers: not run ({type(e).__name__}: {e})", flush=True)
        return {}
    if not cr.COOKBOOK_PYTHON.exists():
        print(f"cookbook trainers: not run (no {cr.COOKBOOK_PYTHON}: scripts/setup_cookbook)", flush=True)
        return {}
    out: dict = {}
    for key, name in (("cookbook_dpo", "run_dpo"), ("cookbook_distill", "run_distill")):
        run = getattr(trainers, name, None)
        if run is None:
            print(f"cookbook trainers: {trainers.__name__} has no {name}; not run", flush=True)
            continue
        r = run(handle.url, base, work / key, api_key=KEY)
        out[f"{key}_completed"] = bool(r.get("completed"))
        out[f"{key}_metrics"] = {k: v for k, v in r.items() if k not in COOKBOOK_SKIP and not isinstance(v, (list, dict))}
        print(f"{key}: completed={out[f'{key}_completed']} in {r.get('seconds')} s: {out[f'{key}_metrics']}",
              flush=True)
    return out


# -- the command --------------------------------------------------------------------------------------
def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="tiny")
    p.add_argument("--model-dir", help="the model as written by `tinker-pipelines model-dir` (default: written "
                                       "under --work)")
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", help="folder for the service's home and the clients' logs (default: a temporary one)")
    p.add_argument("--client-kill-every", type=float, default=120.0, help="seconds between client kills (0: none)")
    p.add_argument("--client-kill-first", type=float, help="seconds to the first client kill (default: the interval)")
    p.add_argument("--worker-kill-at", type=float, help="seconds to the worker kill (default: half time; < 0: none)")
    p.add_argument("--session-ttl-s", type=float, default=SESSION_TTL_S)
    p.add_argument("--think-s", type=float, default=0.3, help="a client's mean pause between operations")
    p.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                   help="an argument for the worker (`tinker-pipelines worker --help`), e.g. --worker-arg=--hold-ms=0")
    p.add_argument("--no-cookbook", action="store_true", help="skip the cookbook trainers after the soak")
    a = p.parse_args(argv)
    if a.minutes <= 0 or a.clients < 1:
        p.error("--minutes must be > 0 and --clients >= 1")
    return a


def start(args: argparse.Namespace, work: Path) -> tuple[Any, str]:
    """The service over the chosen base on a free loopback port; (handle, the base's name for clients)."""
    from benchmarks.tinker_api import free_port, model_dir
    from tinker_pipelines.serving.tinker.launch import start_service

    if args.model_dir:
        base = str(Path(args.model_dir).resolve())
    elif args.model == "tiny":  # a directory too, so the cookbook's trainers can load its tokenizer
        from tinker_pipelines.models.hf_dir import write_model_dir

        base = str(write_model_dir("tiny", work / "tiny")[0])
    else:
        base = str(model_dir(work, None))
    handle = start_service(base, port=free_port(), home=work / "home", api_key=KEY, device="cpu", dtype="float32",
                           session_ttl_s=args.session_ttl_s, min_ttl_s=MIN_TTL_S, worker_args=args.worker_arg)
    return handle, base


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    work = Path(args.work or tempfile.mkdtemp(prefix="tinker-soak-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    plan = schedule(args.minutes * 60, args.client_kill_every, args.client_kill_first, args.worker_kill_at)
    result: dict = {}
    handle, soak = None, None
    try:
        handle, base = start(args, work)
        print(f"soak: {args.model} ({base}), {args.clients} clients and a probe, {args.minutes:g} min at {handle.url}; "
              f"client kills at {[round(t) for t in plan.client_kills]} s, worker kill at "
              f"{plan.worker_kill if plan.worker_kill is None else round(plan.worker_kill)} s; logs in {work}",
              flush=True)
        soak = Soak(handle, args, work, base, plan)
        soak.run()
        result = soak.results(soak.wind_down())
        if not args.no_cookbook:
            result.update(cookbook_part(handle, base, work))
    except Exception as e:  # the service's and the libraries' own errors: one line all the same
        print(json.dumps(result))
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"error: {type(e).__name__}: {first}", file=sys.stderr)
        return 1
    finally:
        if soak is not None:
            soak.stop_clients()
        if handle is not None:
            handle.stop()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
