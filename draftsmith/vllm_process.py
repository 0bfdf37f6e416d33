"""A script of vLLM's venv run as a worker process (`PeerWorker`): the bench's peer (`serve/bench`), datagen's
generator (`serve/apps`) and capture's hidden states (`train`) all start one.

vLLM lives in a venv of its own (`make peer-vllm`: it pins a transformers apart from ours), so its python runs
a worker script that imports no draftsmith: it answers in lines on stdout that begin with PREFIX
(`serve/bench/vllm_peer_worker.say` writes them), one per command line on its stdin. On CPU, vLLM's OpenMP
threads are bound to cores 0..N-1 (`bind_threads`) and its engine core runs in the worker's own process,
unless the bench asks for vLLM's own defaults (OWN_BINDING).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
from pathlib import Path

from draftsmith.errors import DraftsmithError

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PYTHON = ROOT / "build" / "peer-vllm" / "bin" / "python"
WORKER_TIMEOUT_S = 1800  # the most a worker may take to load, or to answer one command
PREFIX = "DRAFTSMITH-PEER "  # the workers' protocol lines (vllm_peer_worker.PREFIX; that file imports no draftsmith)


def cores_of(bind: str) -> list[int]:
    """vLLM's core list "a-b" (or "a") as core ids."""
    first, _, last = bind.partition("-")
    return list(range(int(first), int(last or first) + 1))


def split_cores(bind: str, ranks: int) -> list[str]:
    """vLLM's core list "0-6" split among `ranks` processes, as evenly as it goes: ["0-3", "4-6"]."""
    cores = cores_of(bind)
    if len(cores) < ranks:
        raise DraftsmithError(f"{ranks} data-parallel ranks need a core each; {len(cores)} threads given")
    bounds = [len(cores) * r // ranks for r in range(ranks + 1)]
    groups = [cores[bounds[r]:bounds[r + 1]] for r in range(ranks)]
    return [str(g[0]) if len(g) == 1 else f"{g[0]}-{g[-1]}" for g in groups]


def bind_threads(threads: int | None, option: str = "threads") -> tuple[int, str]:
    """Runs this process's torch on `threads` threads (default: torch's count now) and returns (threads,
    vLLM's VLLM_CPU_OMP_THREADS_BIND: cores 0..threads-1); `option`: what errors call the count. Only vLLM is
    pinned: setting this process's affinity, even to every core it already had, cost draftsmith's house model a
    quarter to half of its tokens/s at one in flight (78 -> 57 and 35 tok/s, one measurement each, 2 threads on
    a 2-core machine)."""
    import torch

    threads = threads or torch.get_num_threads()
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    if not set(range(threads)) <= allowed:
        raise DraftsmithError(f"{option} {threads}: cores 0-{threads - 1} are not all available to this "
                              f"process (allowed: {','.join(map(str, sorted(allowed)))})")
    torch.set_num_threads(threads)
    return threads, "0" if threads == 1 else f"0-{threads - 1}"


OWN_BINDING = "own"  # PeerWorker's `bind` for vLLM's CPU defaults: it binds its threads and runs its processes


class PeerWorker:
    """One worker process (a script of the vLLM venv: the bench's peer, datagen's or capture's worker) with
    vLLM's CPU settings: `reply` reads its next protocol line; what else it prints goes to its log, which
    every error names."""

    def __init__(self, python: Path, job: dict, bind: str | None, threads: int, workdir: Path, worker: Path,
                 env: dict[str, str] | None = None, pausable: bool = False):
        """`bind`: vLLM's CPU settings, its OpenMP threads bound to these cores (VLLM_CPU_OMP_THREADS_BIND) and
        the engine core in this process; OWN_BINDING: vLLM's CPU build as it starts by default, its binding
        and its processes its own (`threads` unused); None: vLLM picks its device and processes itself (GPUs);
        `env`: more of the worker's environment (CUDA_VISIBLE_DEVICES for a data-parallel rank); `pausable`:
        the worker leads a process group of its own, which `pause` and `resume` stop and continue. The group
        stays in this process's session: should this process die while the group is stopped, the kernel
        hangs up the orphaned group (SIGHUP, then SIGCONT), where a session of its own would leave it stopped
        for good, weights and KV cache held."""
        workdir.mkdir(parents=True, exist_ok=True)
        job_path, self.log_path = workdir / "job.json", workdir / "worker.log"
        job_path.write_text(json.dumps(job))
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        if bind == OWN_BINDING:
            env.update({"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"})
            for key in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS", "NUMBA_NUM_THREADS",
                        "VLLM_ENABLE_V1_MULTIPROCESSING"):
                env.pop(key, None)
        elif bind is not None:
            # NUMBA_NUM_THREADS: vLLM's n-gram proposer sets numba's thread count around each lookup and restores
            # numba's default (the machine's cores) after; numba's OpenMP layer is torch's runtime, so a worker
            # bound to 1 thread computed on 2 from its first propose on
            env.update({"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": bind,
                        "OMP_NUM_THREADS": str(threads), "NUMBA_NUM_THREADS": str(threads),
                        "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
        self.log = open(self.log_path, "w")
        self.pausable = pausable
        self.process = subprocess.Popen([str(python), str(worker), str(job_path)], env=env, text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        preexec_fn=os.setpgrp if pausable else None)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def reply(self) -> dict:
        while True:
            try:
                line = self.lines.get(timeout=WORKER_TIMEOUT_S)
            except queue.Empty:
                self.close()
                raise DraftsmithError(f"the vLLM worker gave no answer in {WORKER_TIMEOUT_S} s; its log: "
                                      f"{self.log_path}") from None
            if line is None:
                self.lines.put(None)  # every later call ends here too
                status = self.process.wait()
                self.log.close()
                tail = self.log_path.read_text().strip().splitlines()[-1:] or ["no output"]
                raise DraftsmithError(f"the vLLM worker exited with status {status} and no result ({tail[0][:200]}); "
                                      f"its log: {self.log_path}")
            if line.startswith(PREFIX):
                self.log.flush()  # the log is whole up to this answer
                return json.loads(line[len(PREFIX):])
            self.log.write(line)

    def round(self, concurrency: int) -> dict:
        return self.send({"concurrency": concurrency})

    def send(self, command: dict) -> dict:
        """One command line to the worker -> its answer."""
        self.post(command)
        return self.reply()

    def post(self, command: dict) -> None:
        """One command line to the worker, its answer left for `reply` (workers posted to in turn run at once)."""
        try:
            self.process.stdin.write(json.dumps(command) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            pass  # it is gone: `reply` says how, naming its log

    def pause(self) -> None:
        """Stops the worker and the processes it started until `resume`. An idle vLLM worker is not idle: at
        one thread bound to a core its gloo threads poll it (half a core each, two such workers a whole one),
        and at its own binding its processes poll for about a second after each round; stopped, they take no
        CPU from the engine being timed."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def _signal(self, number: int) -> None:
        if self.pausable and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, number)
            except ProcessLookupError:
                pass  # gone between the poll and the signal: `reply` says how

    def close(self) -> None:
        self.resume()  # a stopped worker reads no end of input
        if self.process.poll() is None:
            try:
                self.process.stdin.close()  # the worker's loop ends at end of input
            except BrokenPipeError:
                pass
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)  # with the processes it started, where it leads their group
                self.process.kill()
                self.process.wait()
        self.log.close()
