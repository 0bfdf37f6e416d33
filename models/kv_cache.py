"""Per-slot KV cache and the per-forward attention metadata that addresses it.

Each running sequence owns one slot: a contiguous strip of max_len positions per layer (and one spare). A
sequence's length lives on the host (the scheduler knows it), so dropping rejected speculative tokens is just
a smaller length: the stale keys past it are never read (the mask stops at each query's position) and get
overwritten by the next write at those positions. Nothing is copied. One extra *scratch* slot absorbs the
writes of padding tokens, so padded batches never touch a live sequence. The cache tensors are allocated once
and never resized; the per-forward metadata below still takes the batch's own widths (rows, query and key
lengths), which a graph-captured decode would pad to fixed buckets.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from draftsmith.models import step_ops_cpu
from draftsmith.models.kernel_backend import slot_kernel_wanted

# A packed forward gathers and scatters each layer's activations (a few small ops per layer): worth it once
# padding is a fifth of the batch (prompts of unequal length, rows verifying unequal numbers of drafts).
PACK_BELOW = 0.8
# Prompts of unequal length padded to the longest make attention, quadratic in length, pay for the padding
# squared: rows this long (prefill chunks, a wide verify) attend one by one in a packed forward ...
ROW_ATTENTION_FROM = 16
# ... and rows this long (prompt chunks) pack at any padding: attended one by one, their padding would only
# be per-token work for nothing
PACK_ALWAYS_FROM = 64
# A draft head reads only its rows' own context windows (`key_starts`), gathered per row, once the keys
# between the batch's first context start and last position are this many times the widest window, rather
# than copying and masking keys that no query of theirs sees.
GATHER_KEYS_FROM = 1.5
# Queries per row up to which the Triton slot attention kernel runs (decode, verify, draft steps): its tile
# stacks a KV group's query heads times the row's queries
SLOT_KERNEL_QUERIES = 16
# queries (rows x width) up to which a batch's positions and slots are listed on the host (`_positions_and_writes`)
LISTED_UP_TO = 256


@dataclass
class SlotRows:
    """What the Triton slot attention kernel reads instead of a mask (`models.slot_attention_triton`)."""

    kv_lens: torch.Tensor  # [B] keys written for each row: its start + its real queries
    key_starts: torch.Tensor | None  # [B] the row's first key, or None for 0
    window: int | None
    # the longest row's keys, when the host knows it (sizes the kernel's key splits without reading kv_lens
    # back); a captured step passes the cache's length, so one graph serves every context length
    max_keys: int | None = None
    # tree verification (`serve.speculation.tree_verify`): [B, Q, Q] which of the row's block keys each query
    # sees, the block's first cache position [B], and the queries' sequence positions [B, Q] (the window's
    # reference: a node sits at its depth, not at its place in the block)
    tree_mask: torch.Tensor | None = None
    block_starts: torch.Tensor | None = None
    positions: torch.Tensor | None = None


def _positions_and_writes(slots: list[int], starts: list[int], q_lens: list[int], width: int,
                          cache: KVCache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """[B, width] each query's position (past the cache's end: its last) and the slot its key and value go to
    (a padding query's: the scratch slot), and which queries are real ([B, width] bool; None when listed). A
    batch of up to LISTED_UP_TO queries (decode and verify steps, draft steps) is listed on the host, one
    tensor each: the same from tensor ops took a dozen small dispatches, a tenth of a one-row decode's host
    work."""
    last, scratch = cache.max_len - 1, cache.scratch_slot
    if len(slots) * width <= LISTED_UP_TO:
        positions = torch.tensor([[min(s + i, last) for i in range(width)] for s in starts], dtype=torch.long)
        writes = torch.tensor([[slot] * n + [scratch] * (width - n) for slot, n in zip(slots, q_lens)],
                              dtype=torch.long)
        return positions, writes, None
    offsets = torch.arange(width, dtype=torch.long)[None, :]
    positions = (torch.tensor(starts, dtype=torch.long)[:, None] + offsets).clamp(max=last)
    real = offsets < torch.tensor(q_lens, dtype=torch.long)[:, None]
    return positions, torch.where(real, torch.tensor(slots, dtype=torch.long)[:, None], scratch), real


class KVCache:
    """k[layer], v[layer]: [num_slots + 1, num_kv_heads, max_len + 1, head_dim]; slot `num_slots` is scratch.
    Position max_len is never written or read: with it, the first max_len keys of a strip (a request at
    max_len) are a slice like any shorter one, where the whole strip would be contiguous, a case torch.compile
    traces apart (a graph compiled again mid-serving, 10-20 s on two cores)."""

    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (num_slots + 1, num_kv_heads, max_len + 1, head_dim)
        # zeros, not empty: a padding query may read never-written keys, and those must be finite.
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots = num_slots
        self.max_len = max_len

    def copy_positions(self, source: int, targets: list[int], start: int, end: int) -> None:
        """Copies every layer's keys and values at positions [start, end) of slot `source` into `targets`:
        samples of one prompt share its prefill."""
        index = torch.tensor(targets, device=self.k[0].device)
        for cache in (*self.k, *self.v):
            cache[index, :, start:end] = cache[source, :, start:end]

    @property
    def scratch_slot(self) -> int:
        return self.num_slots

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


@dataclass
class ForwardBatch:
    """Where B rows of Q new tokens each sit in the cache; row b has `q_lens[b]` real tokens, rest padding.

    Built on the host from the scheduler's Python lists, then moved to the device in one go, so the forward
    itself never needs a device-to-host sync.
    """

    positions: torch.Tensor  # [B, Q] absolute position of each query token (padding clamped into range)
    read_slots: torch.Tensor  # [B] slot each row attends over
    write_slots: torch.Tensor  # [B, Q] slot each token's K/V goes to (scratch for padding)
    mask: torch.Tensor | None  # [B, 1, Q, kv_len - kv_start] bool, True = may attend (None: `slot_rows`)
    kv_len: int  # keys [kv_start, kv_len) are read
    slot_start: int | None  # rows read slots slot_start.. in order: slice the cache instead of gathering
    kv_start: int = 0  # no row attends to keys before this: they are not read at all
    # [T] the real tokens' flat indices into [B * Q], when the forward runs packed (`build(pack=True)`)
    tokens: torch.Tensor | None = None
    # (slot, start, q_len, causal) per row, when a packed batch of long rows (prompts) attends row by row;
    # causal: the row's mask is plain causal from position 0, so attention needs no mask at all
    row_spans: tuple[tuple[int, int, int, bool], ...] | None = None
    # [B, K] the positions row b reads keys at, when rows read their own windows (`key_starts`) gathered
    # from the cache; the mask's last dim then follows these, not kv_start..kv_len
    key_positions: torch.Tensor | None = None
    # what every layer derives from `mask` alike (the attention bias), made by the first that needs it;
    # a batch made with dataclasses.replace starts its own
    memo: dict = field(init=False, default_factory=dict, repr=False, compare=False)
    # set where attention runs as the Triton slot kernel (`models.attention.batch_attention`)
    slot_rows: SlotRows | None = None
    # every row starts at position 0 and sees every earlier key of its own (no window, no key_starts): the
    # mask is plain causal over [0, kv_len), which attention can apply without reading it
    causal: bool = False

    @classmethod
    def build(cls, slots: list[int], starts: list[int], q_lens: list[int], cache: KVCache,
              sliding_window: int | None = None, device: torch.device | str = "cpu",
              key_starts: list[int] | None = None, pack: bool = False) -> ForwardBatch:
        """`key_starts[b]`: row b attends over keys from this position on (a draft head whose context begins
        mid-sequence); default 0. `pack`: when padding is a good part of the batch, a model that supports it
        runs its per-token work (projections, MLP, norms, LM head) on the real tokens only (`tokens`)."""
        num_rows, width = len(slots), max(q_lens)
        kv_len = max(s + q for s, q in zip(starts, q_lens))
        # Keys no query can see are skipped, not masked: a draft head whose context is the last hundred
        # positions of a long sequence, or a sliding window, reads that much of the cache and no more.
        kv_start = min(key_starts) if key_starts is not None else 0
        if sliding_window is not None:
            kv_start = max(kv_start, min(starts) - sliding_window + 1)
        read_slots = torch.tensor(slots, dtype=torch.long)
        positions, write_slots, real = _positions_and_writes(slots, starts, q_lens, width, cache)
        key_positions = None
        if key_starts is not None and sliding_window is None:
            span = max(s + q - k for s, q, k in zip(starts, q_lens, key_starts))
            if kv_len - kv_start >= GATHER_KEYS_FROM * span:
                first_key = torch.tensor(key_starts, dtype=torch.long)[:, None]
                key_positions = first_key + torch.arange(span, dtype=torch.long)[None, :]
        if key_positions is not None:  # row b's keys start at its key_starts[b] by construction
            mask = key_positions[:, None, :] <= positions[:, :, None]
            # past the cache's end there is no key: masked above (no query sits there), read from the last
            key_positions = key_positions.clamp(max=cache.max_len - 1)
        else:
            keys = torch.arange(kv_start, kv_len, dtype=torch.long)
            mask = keys[None, None, :] <= positions[:, :, None]
            if sliding_window is not None:
                mask &= keys[None, None, :] > positions[:, :, None] - sliding_window
            if key_starts is not None:
                mask &= keys[None, None, :] >= torch.tensor(key_starts, dtype=torch.long)[:, None, None]
        contiguous = slots == list(range(slots[0], slots[0] + num_rows))
        tokens = row_spans = None
        real_share = sum(q_lens) / (num_rows * width)
        by_rows = width >= ROW_ATTENTION_FROM and key_starts is None
        if pack and real_share < 1 and (real_share <= PACK_BELOW or by_rows and width >= PACK_ALWAYS_FROM):
            flat = real.view(-1).nonzero()[:, 0] if real is not None else \
                torch.tensor([b * width + i for b, n in enumerate(q_lens) for i in range(n)])
            tokens = flat.to(device)
            if by_rows:
                row_spans = tuple((slot, s, n, s == 0 and sliding_window is None)
                                  for slot, s, n in zip(slots, starts, q_lens))
        slot_rows = None
        if key_positions is None and width <= SLOT_KERNEL_QUERIES and slot_kernel_wanted(device):
            slot_rows = SlotRows(torch.tensor([s + q for s, q in zip(starts, q_lens)]).to(device),
                                 None if key_starts is None else torch.tensor(key_starts).to(device), sliding_window,
                                 kv_len)
        return cls(
            slot_rows=slot_rows,
            causal=not any(starts) and sliding_window is None and key_starts is None,
            positions=positions.to(device),
            read_slots=read_slots.to(device),
            write_slots=write_slots.to(device),
            mask=mask[:, None].to(device),
            kv_len=kv_len,
            slot_start=slots[0] if contiguous else None,
            kv_start=kv_start,
            tokens=tokens,
            row_spans=row_spans,
            key_positions=key_positions.to(device) if key_positions is not None else None,
        )

    @classmethod
    def static(cls, positions: torch.Tensor, read_slots: torch.Tensor, write_slots: torch.Tensor,
               kv_lens: torch.Tensor, num_keys: int, sliding_window: int | None, slot_kernel: bool,
               key_starts: torch.Tensor | None = None) -> ForwardBatch:
        """A batch built on the device from tensors of fixed shapes alone (`serve.engine.step_graphs`): no host
        values but `num_keys`, the keys every row reads (a bucket, or the cache's length), so a captured or
        compiled step runs it again for new rows by refilling its inputs. positions, write_slots [B, Q];
        read_slots, kv_lens [B]: row b sees keys below kv_lens[b], causally, and from key_starts[b] on."""
        if slot_kernel:  # the kernel masks from positions and kv_lens itself: no [B, Q, cache length] mask
            return cls(positions=positions, read_slots=read_slots, write_slots=write_slots, mask=None,
                       kv_len=num_keys, slot_start=None,
                       slot_rows=SlotRows(kv_lens, key_starts, sliding_window, num_keys))
        keys = torch.arange(num_keys, device=positions.device)
        query = positions[:, :, None]
        mask = (keys <= query) & (keys < kv_lens[:, None, None])
        if sliding_window is not None:
            mask &= keys > query - sliding_window
        if key_starts is not None:
            mask &= keys >= key_starts[:, None, None]
        return cls(positions=positions, read_slots=read_slots, write_slots=write_slots, mask=mask[:, None],
                   kv_len=num_keys, slot_start=None)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """[T, ...] values of the real tokens -> [B, Q, ...], padding zero."""
        rows, width = self.positions.shape
        out = packed.new_zeros((rows * width,) + packed.shape[1:])
        out[self.tokens] = packed
        return out.view((rows, width) + packed.shape[1:])

    def query_starts(self) -> torch.Tensor:
        """[B + 1]: where each row's real tokens start among a packed batch's (`tokens`: row-major, each row's
        first q_len queries), then their total."""
        starts = self.memo.get("query_starts")
        if starts is None:
            rows, width = self.positions.shape
            counts = torch.bincount(self.tokens // width, minlength=rows)
            starts = self.memo["query_starts"] = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        return starts

    def write_packed(self, layer_cache: torch.Tensor, new: torch.Tensor) -> None:
        """new [T, num_kv_heads, head_dim], a packed batch's real tokens, goes to their slots and positions:
        no padded copy to build, and padding writes nothing."""
        index = self.memo.get("packed_writes")
        if index is None:
            index = self.memo["packed_writes"] = (self.write_slots.reshape(-1)[self.tokens],
                                                  self.positions.reshape(-1)[self.tokens])
        slots, positions = index
        if _kernel_writes(layer_cache, new):
            return step_ops_cpu.write_kv(layer_cache, slots[None], positions[None], new.unsqueeze(0).transpose(1, 2))
        layer_cache[slots, :, positions] = new

    def read(self, layer_cache: torch.Tensor) -> torch.Tensor:
        """This batch's keys (or values) [B, num_kv_heads, kv_len - kv_start, head_dim], or with
        `key_positions` [B, num_kv_heads, K, head_dim], row b's keys at its own positions."""
        if self.key_positions is not None:
            return layer_cache[self.read_slots[:, None], :, self.key_positions].transpose(1, 2)
        window = layer_cache[:, :, self.kv_start : self.kv_len]
        if self.slot_start is not None:
            return window[self.slot_start : self.slot_start + self.read_slots.shape[0]]
        return window.index_select(0, self.read_slots)

    def write(self, layer_cache: torch.Tensor, new: torch.Tensor) -> None:
        """new [B, num_kv_heads, Q, head_dim] goes to (write_slots, :, positions)."""
        if _kernel_writes(layer_cache, new):
            return step_ops_cpu.write_kv(layer_cache, self.write_slots, self.positions, new)
        layer_cache[self.write_slots, :, self.positions] = new.transpose(1, 2)


def _kernel_writes(layer_cache: torch.Tensor, new: torch.Tensor) -> bool:
    """Whether the C++ write op takes these keys or values (`step_ops_cpu.write_kv`): same dtype, head_dim
    contiguous in both."""
    return (step_ops_cpu.runs_for(new) and layer_cache.dtype == new.dtype and new.stride(-1) == 1
            and layer_cache.stride(-1) == 1)


class UnpackedOnRead(Mapping[int, torch.Tensor]):
    """A packed forward's hidden states by layer, kept as its real tokens [T, H] and unpacked to [B, Q, H]
    (padding zero) when a layer is first read: a prompt chunk's states that nobody reads (a proposer keeping
    them while the policy holds plain decoding) are never copied. Unpacking each of a DFlash head's six
    layers, then joining them, had cost its held engine 1.5% of prefill time (demo, 8 in flight)."""

    def __init__(self, packed: dict[int, torch.Tensor], batch: ForwardBatch):
        self.packed, self.batch = packed, batch
        self._unpacked: dict[int, torch.Tensor] = {}

    def __getitem__(self, layer: int) -> torch.Tensor:
        unpacked = self._unpacked.get(layer)
        if unpacked is None:
            unpacked = self._unpacked[layer] = self.batch.unpack(self.packed[layer])
        return unpacked

    def __iter__(self) -> Iterator[int]:
        return iter(self.packed)

    def __len__(self) -> int:
        return len(self.packed)

    @property
    def nbytes(self) -> int:
        """What keeping these states holds in memory (the packed tensors; unpacked ones come on top)."""
        return sum(h.numel() * h.element_size() for h in self.packed.values())
