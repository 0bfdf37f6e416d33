"""How long a target forward takes, by batch shape: the measured input of speculation's cost model.

Verifying k drafts costs one forward of k + 1 query tokens per row instead of 1, and what that costs depends
on the model, the device, the dtype and the batch: on a small CPU target a 5-token verify costs far less
than 5 decodes one at a time, but with 16 rows in flight it may cost more than it saves. Rather than guess,
draftsmith times real forwards over a grid of rows x query tokens against a warm KV cache, once per
(model, device, dtype, torch version), and keeps the table on disk.

`ForwardCostTable.estimate(rows, query_len)` interpolates between the points as priced (`priced_seconds`:
no verify shape dearer than a larger one), linear in each axis and extended linearly past the grid.
`draftsmith profile MODEL` prints the table as measured.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch

from draftsmith.cpu_load import BUSY_LIMIT, OthersBusy, wait_for_quiet
from draftsmith.errors import DraftsmithError
from draftsmith.models.kernel_backend import slot_kernel_wanted
from draftsmith.models.kv_cache import ForwardBatch
from draftsmith.models.linear import onednn_linear_available, panels_run

ROWS = (1, 2, 4, 8, 16, 32)
# 1..8: decodes and verifies; 32: so that longer forwards (a draft model's catch-up after plain steps, up to
# 64 positions) interpolate rather than extrapolate from a noisy slope.
QUERY_LENS = (1, 2, 3, 4, 5, 6, 8, 32)
CONTEXT = 256  # tokens already in the cache per row: keys the forward attends over
# A draft model's own table, which prices its catch-ups (a new row's prompt, fed at its first draft): prompt
# lengths at no cached context. Past 32 query tokens the target's grid extrapolates badly (the house model's
# 619-token forward: 551 ms by the table, 329 live), so this grid reaches prompt lengths.
# Rows beyond 4 extrapolate (a forward this long grows linearly in rows); 3 repeats: about 3 s for the demo model.
CATCH_UP_GRID = {"rows": (1, 2, 4), "query_lens": (1, 8, 32, 128, 512), "context": 0, "repeats": 3}
# A block drafter's steady draft step by rows (`Proposer.draft_timer`), at the target table's context: under a
# second for the demo heads, taken each time an engine starts
DRAFT_GRID = {"rows": (1, 2, 4, 8, 16), "context": CONTEXT, "repeats": 3}

logger = logging.getLogger("draftsmith")


@dataclass
class ForwardCostTable:
    """Median seconds of one target forward, `seconds[i][j]` for `rows[i]` rows of `query_lens[j]` tokens."""

    key: dict
    rows: list[int]
    query_lens: list[int]
    context: int
    seconds: list[list[float]]

    def estimate(self, rows: int, query_len: int) -> float:
        """Seconds for a forward of `rows` x `query_len`, interpolated (and extrapolated) linearly per axis."""
        cached = self._estimates.get((rows, query_len))
        if cached is None:  # the policy asks for the same few shapes every step
            per_row = [_interpolate(self.query_lens, line, query_len) for line in self._priced]
            cached = self._estimates[rows, query_len] = max(_interpolate(self.rows, per_row, rows), 0.0)
        return cached

    def __post_init__(self):
        self._estimates: dict[tuple[int, int], float] = {}
        self._priced = priced_seconds(self.seconds, self.query_lens)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> ForwardCostTable:
        return cls(**data)


def priced_seconds(seconds: list[list[float]], query_lens: list[int]) -> list[list[float]]:
    """`seconds[i][j]` (rows ascending, then query lengths) as the cost model prices them: no shape dearer than
    one of more rows, nor a verify (2 or more query tokens) dearer than a longer one of the same rows. Noise on
    a shared machine only adds time, so a point above a larger shape was timed in a busy moment; priced as
    measured, one point (demo, 1 row x 5 tokens: 4.47 ms between 2.77 and 2.80; 2.85 and 2.86 when timed
    again) kept its width out of every plan, which the live scales never correct (a width never taken is never
    timed): the n-gram planner drafted 3 where a fixed 4 ran 8% faster. A decode (1 token) keeps its own time
    against verifies: its kernels differ, and live decode steps price it apart (`CostModel.forward_scales`)."""
    priced = [list(line) for line in seconds]
    for line in priced:
        for j in range(len(line) - 2, -1, -1):
            if query_lens[j] >= 2:
                line[j] = min(line[j], line[j + 1])
    # the minimum of sequences rising with the query length rises with it too
    for i in range(len(priced) - 2, -1, -1):
        priced[i] = [min(mine, more_rows) for mine, more_rows in zip(priced[i], priced[i + 1])]
    return priced


def _interpolate(xs: list[int], ys: list[float], x: float) -> float:
    if len(xs) == 1:
        return ys[0]
    i = 1
    while i < len(xs) - 1 and xs[i] < x:
        i += 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def profile_key(model_dir: str | Path, model) -> dict:
    weight = model.model.embed_tokens.weight
    return {"model": str(Path(model_dir).resolve()), "config": model.config.__class__.__name__,
            "hidden_size": model.config.hidden_size, "num_layers": model.config.num_hidden_layers,
            "device": str(weight.device), "dtype": str(weight.dtype).removeprefix("torch."),
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            # which linear layers ran: a table timed with one says little about another
            "cpu_linear": _cpu_linear(weight)}


def _cpu_linear(weight: torch.Tensor) -> str:
    """The form a CPU target's linear layers take (the C++ build loaded first where the engine would load it,
    since the panel GEMM needs it): "panel", "onednn" or "aten"."""
    if weight.device.type != "cpu":
        return "aten"
    slot_kernel_wanted(weight.device)
    if panels_run(weight.dtype):
        return "panel"
    return "onednn" if onednn_linear_available(weight.dtype) else "aten"


def cache_dir() -> Path:
    return Path(os.environ.get("DRAFTSMITH_CACHE_DIR") or Path.home() / ".cache" / "draftsmith") / "profiles"


def cache_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / f"forward-{digest}.json"


def time_forward(model, cache, rows: int, query_len: int, context: int, repeats: int) -> float:
    """Median wall seconds of `repeats` forwards of rows x query_len tokens at position `context`."""
    device = model.model.embed_tokens.weight.device
    batch = ForwardBatch.build(list(range(rows)), [context] * rows, [query_len] * rows, cache,
                               model.config.sliding_window, device)
    ids = torch.zeros(rows, query_len, dtype=torch.long, device=device)
    with torch.inference_mode():
        return median_seconds(lambda: model(ids, cache=cache, batch=batch), repeats, device)


def median_seconds(run, repeats: int, device: torch.device) -> float:
    """Median wall seconds of `repeats` calls of `run()`, after one that warms caches and allocators."""
    times = []
    for attempt in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if attempt:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def profile_catch_ups(run, rows: list[int], positions: list[int], repeats: int, device: torch.device) -> ForwardCostTable:
    """The table of `run(rows, positions)` (a proposer's catch-up: `Proposer.catch_up_timer`) over the grid,
    timed now: a projection's grid takes well under a second, so it is not kept on disk."""
    seconds = [[median_seconds(partial(run, r, q), repeats, device) for q in positions] for r in rows]
    return ForwardCostTable({"catch_up": "projection"}, list(rows), list(positions), 0, seconds)


def profile_drafts(timer, rows: list[int], repeats: int) -> ForwardCostTable:
    """The table of a proposer's steady draft step (`Proposer.draft_timer`) by rows, timed now; its one query
    length (1) stands for a step of any width."""
    try:
        seconds = [[median_seconds(partial(timer.run, r), repeats, timer.device)] for r in rows]
    finally:
        timer.done()
    return ForwardCostTable({"drafting": "timed"}, list(rows), [1], DRAFT_GRID["context"], seconds)


def profile_forwards(model, key: dict, rows=ROWS, query_lens=QUERY_LENS, context: int = CONTEXT,
                     repeats: int = 5, progress=None) -> ForwardCostTable:
    cache = model.make_cache(max(rows), context + max(query_lens))
    seconds = []
    for r in rows:
        seconds.append([time_forward(model, cache, r, q, context, repeats) for q in query_lens])
        if progress is not None:
            progress(r)
    return ForwardCostTable(key, list(rows), list(query_lens), context, seconds)


# A saved table is checked against live forwards of a decode and a verify shape when loaded: a table off by more
# than STALE_RATIO either way (timed on a busy machine: the house model's 1-row decode saved at 324 ms, where it
# takes 10; or on another day's slower VM) is measured again. Priced by such a table, plain decoding looked
# 3.7x dearer than it was, and a draft model speculated at 8 in flight at 0.8x plain decoding's speed.
STALE_RATIO = 2.0
CHECK_SHAPES = ((1, 1), (4, 4))
# A profile is taken once other processes use under BUSY_LIMIT cores (waiting up to QUIET_WAIT_S); one taken
# while they used more serves this process but is not saved.
QUIET_WAIT_S = 30.0
_AGREED: set[tuple[Path, int]] = set()  # saved tables (path, mtime) this process found agreeing with live forwards


def load_or_profile(model, model_dir: str | Path, refresh: bool = False, progress=None,
                    **grid) -> tuple[ForwardCostTable, bool]:
    """(table, whether it came from disk). A cached table is reused only for the same key and grid, and only
    while live forwards agree with it (STALE_RATIO)."""
    wanted = {"rows": list(grid.get("rows", ROWS)), "query_lens": list(grid.get("query_lens", QUERY_LENS)),
              "context": grid.get("context", CONTEXT)}
    # another grid of the same model is another file: a draft model is often some engine's target too; the
    # default grid, asked for by name or not (`draftsmith profile`, an engine), is one file
    default = {"rows": list(ROWS), "query_lens": list(QUERY_LENS), "context": CONTEXT}
    key = profile_key(model_dir, model) | ({"grid": wanted} if wanted != default else {})
    path = cache_path(key)
    if path.is_file() and not refresh:
        try:
            table = ForwardCostTable.from_json(json.loads(path.read_text()))
        except (json.JSONDecodeError, TypeError) as exc:
            raise DraftsmithError(f"{path} is not a readable profile ({exc}); rerun with --refresh") from None
        if table.key == key and all(getattr(table, k) == v for k, v in wanted.items()):
            checked = (path, path.stat().st_mtime_ns)
            if checked in _AGREED:  # every engine on one target loads it: checked once a process
                return table, True
            off = stale_by(model, table)
            if off is None:
                _AGREED.add(checked)
                return table, True
            logger.info("forward-cost profile %s is off by %.1fx from live forwards: measuring again", path, off)
    wait_for_quiet(max_wait_s=QUIET_WAIT_S, log=logger.info)
    others = OthersBusy()
    table = profile_forwards(model, key, progress=progress, **grid)
    busy = others.cores()
    if busy > BUSY_LIMIT:
        logger.warning("forward-cost profile taken while other processes used %.2f cores: used now, not saved", busy)
        return table, False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(table.to_json(), indent=1) + "\n")
    os.replace(tmp, path)
    _AGREED.add((path, path.stat().st_mtime_ns))
    return table, False


def stale_by(model, table: ForwardCostTable, shapes=CHECK_SHAPES, repeats: int = 3) -> float | None:
    """How far (a factor >= 1) live forwards of `shapes` are from the table, where beyond STALE_RATIO at any
    of them; None where the table agrees."""
    shapes = [(r, q) for r, q in shapes if r <= max(table.rows)]
    cache = model.make_cache(max(r for r, _ in shapes), table.context + max(q for _, q in shapes))
    worst = 1.0
    for rows, query_len in shapes:
        live = time_forward(model, cache, rows, query_len, table.context, repeats)
        ratio = live / max(table.estimate(rows, query_len), 1e-9)
        worst = max(worst, ratio, 1 / max(ratio, 1e-9))
    return worst if worst > STALE_RATIO else None


def format_table(table: ForwardCostTable) -> str:
    """Milliseconds per forward, and each shape's cost relative to one decode token of the same rows."""
    head = "rows \\ query" + "".join(f"{q:>9}" for q in table.query_lens)
    lines = [f"target forward, median ms ({table.key['dtype']}, {table.key['device']}, {table.context} cached tokens "
             "per row; in brackets: x one-token decode of the same rows)", head]
    for r, line in zip(table.rows, table.seconds):
        lines.append(f"{r:>12}" + "".join(f"{s * 1e3:>9.2f}" for s in line))
        lines.append(" " * 12 + "".join(f"{'(' + format(s / line[0], '.2f') + ')':>9}" for s in line))
    return "\n".join(lines)



def run(args) -> int:
    """`draftsmith profile MODEL`: measure (or reuse) the table and print it."""
    from tqdm.auto import tqdm

    from draftsmith.models.loader import load_target

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = load_target(args.model, dtype=args.dtype, device=device, max_len=args.context + max(QUERY_LENS))
    rows = tuple(r for r in ROWS if r <= args.max_rows)
    with tqdm(total=len(rows), desc="profile", unit="batch size") as bar:
        table, cached = load_or_profile(model, args.model, refresh=args.refresh, progress=lambda _: bar.update(1),
                                        rows=rows, context=args.context)
    print(format_table(table))
    print(f"{'reused' if cached else 'saved'}: {cache_path(table.key)}")
    return 0
