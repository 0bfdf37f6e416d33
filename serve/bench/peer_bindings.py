"""The thread bindings `draftsmith bench --peer vllm --peer-binding` runs vLLM's CPU build at, and how a row
takes the fastest of them.

- `threads`: thread for thread, vLLM's --peer-threads N OpenMP threads bound to cores 0..N-1, its engine core
  in the worker's process (the bench's default);
- `one`: one OpenMP thread bound to core 0, the engine core in the worker's process;
- `own`: vLLM as its CPU build starts by default (it binds its own threads, and its engine core and model
  worker are processes of their own).

With several, each is a worker of its own per method, every round runs through all of them right after
draftsmith's, and each row's peer figures are those of the binding with the most tokens/s at that level:
"each engine at its best binding" (issue 39), with draftsmith on its --peer-threads threads throughout.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.errors import DraftsmithError
from draftsmith.vllm_process import OWN_BINDING

BINDINGS = ("threads", "one", "own")


@dataclass(frozen=True)
class Binding:
    name: str
    threads: int  # vLLM's OpenMP threads (for `own`, draftsmith's count: the worker leaves vLLM to choose)
    bind: str  # `PeerWorker`'s bind: cores, or OWN_BINDING

    def cores(self) -> str:
        return f"core {self.bind}" if self.threads == 1 else f"cores {self.bind}"

    def describe(self) -> str:
        if self.bind == OWN_BINDING:
            return "own (vLLM's default: it binds its threads, its engine core a process of its own)"
        return f"{self.name} ({self.threads} thread(s) bound to {self.cores()})"

    def title(self) -> str:
        """The table's words for this binding where it is the only one (draftsmith on `threads` threads)."""
        if self.bind == OWN_BINDING:
            return (f"draftsmith on {self.threads} torch thread(s), vLLM at its own CPU binding (its default: it "
                    "binds its threads and runs its engine core in a process of its own)")
        return f"{self.threads} compute thread(s) each (vLLM's bound to {self.cores()})"


def parse_bindings(spec: str, threads: int, cores: str) -> list[Binding]:
    """--peer-binding's comma-separated names -> the bindings, in order, without repeats (`one` is `threads`
    where draftsmith runs one thread); `cores`: the cores `threads` threads bind (`bind_threads`); a one-line
    error for a name that is none of BINDINGS."""
    names = [name.strip() for name in spec.split(",") if name.strip()]
    unknown = [name for name in names if name not in BINDINGS]
    if unknown or not names:
        raise DraftsmithError(f"--peer-binding {spec!r}: a comma-separated list of {', '.join(BINDINGS)}")
    made = {"threads": Binding("threads", threads, cores),
            "one": Binding("one", 1, "0"), "own": Binding("own", threads, OWN_BINDING)}
    bindings: list[Binding] = []
    for name in names:
        binding = made[name]
        if all((b.threads, b.bind) != (binding.threads, binding.bind) for b in bindings):
            bindings.append(binding)
    return bindings


def fastest(merged: dict[str, list[dict]]) -> list[dict]:
    """Rows merged with each binding's results (`peer.merge`, same rows in the same order) -> each row with
    the peer figures of its fastest binding, `peer_binding` naming it (None where none was timed) and
    `peer_tokens_per_s_by_binding`; its greedy mismatches are the most any binding had, so that "ids equal"
    holds for every binding."""
    names = list(merged)
    rows = []
    for versions in zip(*(merged[name] for name in names)):
        speeds = {name: row.get("peer_tokens_per_s") for name, row in zip(names, versions)}
        timed = [name for name in names if speeds[name]]
        if "peer" not in versions[0]:
            rows.append(versions[0])
            continue
        best = max(timed, key=lambda name: speeds[name]) if timed else None
        row = dict(versions[names.index(best) if best else 0])
        row.update(peer_binding=best, peer_tokens_per_s_by_binding={name: speeds[name] for name in timed})
        counted = [v["peer_greedy_mismatches"] for v in versions if v.get("peer_greedy_mismatches") is not None]
        if counted:
            row["peer_greedy_mismatches"] = max(counted)
        rows.append(row)
    return rows
