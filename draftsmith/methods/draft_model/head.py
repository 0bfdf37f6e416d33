"""PARD (arXiv 2504.18583): a small draft LM adapted to predict k tokens in one forward.

At inference the draft reads the tokens it lacks, then k - 1 copies of one mask token (`pard_token` in
its config.json, an id the tokenizer never produces) at the next positions, with ordinary causal attention:
the last real token's output is draft 1, mask j's output draft j + 1. The model is an ordinary HF
checkpoint plus that key, so vLLM loads it as a `draft_model` with `parallel_drafting: true`.

Training (PARD's conditional drop-token, COD) packs, after a sequence's L real tokens, one segment of mask
tokens per depth i = 1..K-1: the mask at depth i and position p stands for "last real token at p - i, then i
masks", so it sees the real tokens up to p - i and the masks of its own chain (depth s at p - i + s, s <= i),
and predicts the token after p. Depth i keeps only a share max(r**i, r_min) of its positions, drawn from
those whose chain is kept (one after a kept position of depth i - 1): most of the cost of K - 1 extra
copies of the sequence is dropped and every kept query still sees exactly what it would at inference.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.models.config import TargetConfig
from draftsmith.models.dtypes import DTYPES
from draftsmith.models.llama import CausalLM

# config.json keys a parallel draft's mask token goes by (vLLM reads them in this order; PARD writes pard_token)
MASK_TOKEN_KEYS = ("mask_token_id", "pard_token", "ptd_token_id")
# config.json key of the tokens a draft adapted here learned to draft in one forward (public PARD checkpoints
# do not record theirs: then nothing is checked)
TRAINED_DEPTH_KEY = "draftsmith_parallel_draft_tokens"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")
IGNORE = -100


def mask_token_id(hf_config: dict) -> int | None:
    """The mask token a parallel-drafting checkpoint's config.json names, or None."""
    for key in MASK_TOKEN_KEYS:
        if isinstance(hf_config.get(key), int) and not isinstance(hf_config.get(key), bool):
            return hf_config[key]
    return None


@dataclass
class ParallelDraftConfig:
    hf_config: dict  # the draft LM's config.json (the source's, with pard_token set)
    pard_token: int
    source: str = ""  # the directory it was adapted from: tokenizer files are copied from there
    # K it was trained to draft from one forward (the recipe's training.parallel_draft_tokens); saved as
    # TRAINED_DEPTH_KEY, so that serving can refuse a k the draft never learned
    parallel_draft_tokens: int | None = None

    def __post_init__(self) -> None:
        vocab = self.hf_config.get("vocab_size")
        if not isinstance(vocab, int) or not 0 <= self.pard_token < vocab:
            raise DraftsmithError(f"mask token id {self.pard_token} is outside the draft's vocabulary of {vocab}")


class ParallelDraftLM(nn.Module):
    """The trainer's view of a PARD draft: a whole small LM, trained, saved as an HF checkpoint. It reads no
    target layers (`feature_layers` empty: the trainer runs no target forward for it)."""

    head_type = "draft_model"
    feature_layers: tuple[int, ...] = ()

    def __init__(self, config: ParallelDraftConfig):
        super().__init__()
        self.config = config
        self.lm = CausalLM(TargetConfig.from_hf_dict(config.hf_config))

    @classmethod
    def adapt(cls, lm: CausalLM, source: str | Path, pard_token: int) -> ParallelDraftLM:
        """Wraps a loaded LM (its weights become trainable) to be adapted to parallel drafting."""
        hf_config = json.loads((Path(source) / "config.json").read_text())
        config = ParallelDraftConfig({**hf_config, "pard_token": pard_token}, pard_token, str(source))
        with torch.device("meta"):
            module = cls(config)
        module.lm = lm.float().train().requires_grad_(True)
        return module

    def forward(self, *args, **kwargs):
        return self.lm(*args, **kwargs)

    def save_pretrained(self, directory: str | Path) -> None:
        """An HF checkpoint (config.json with pard_token, model.safetensors in the source checkpoint's dtype, the
        source's tokenizer files)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        dtype_name = self.config.hf_config.get("dtype") or self.config.hf_config.get("torch_dtype") or "float32"
        dtype = DTYPES.get(dtype_name, torch.float32)
        state = {k: v.detach().cpu().to(dtype).contiguous() for k, v in self.lm.state_dict().items()}
        if self.lm.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # the embedding's; safetensors refuses shared storage
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
        hf_config = {**self.config.hf_config, "pard_token": self.config.pard_token, "spd_type": "pard",
                     "dtype": str(dtype).removeprefix("torch.")}
        if self.config.parallel_draft_tokens is not None:
            hf_config[TRAINED_DEPTH_KEY] = self.config.parallel_draft_tokens
        hf_config.pop("torch_dtype", None)
        (directory / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        source = Path(self.config.source) if self.config.source else None
        for name in TOKENIZER_FILES:
            if source is not None and (source / name).is_file() and source.resolve() != directory.resolve():
                shutil.copyfile(source / name, directory / name)


@dataclass
class CODLayout:
    """A batch laid out for COD training: [B, T] tokens (real ones, then the kept mask tokens by depth)."""

    input_ids: torch.Tensor  # [B, T]
    positions: torch.Tensor  # [B, T]
    depths: torch.Tensor  # [B, T] 0 = real token, i = mask of depth i, -1 = padding
    labels: torch.Tensor  # [B, T] the token after each position, IGNORE where none (or not trained on)
    attention_mask: torch.Tensor  # [B, 1, T, T] bool, True = may attend


def kept_positions(length: int, depths: int, retention: float, min_retention: float,
                   generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """Per depth 0..depths-1, the positions whose token is kept: all real ones at depth 0; at depth i, a share
    max(retention**i, min_retention) of `length`, drawn from one past the positions kept at depth i - 1 that
    still have a token to predict (p <= length - 2), so that every kept mask's chain is kept."""
    kept = [torch.arange(length)]
    for depth in range(1, depths):
        candidates = kept[-1] + 1
        candidates = candidates[candidates <= length - 2]
        count = min(int(length * max(retention**depth, min_retention)), len(candidates))
        if count <= 0:
            break
        pick = torch.randperm(len(candidates), generator=generator)[:count]
        kept.append(candidates[pick].sort().values)
    return kept


def cod_layout(input_ids: torch.Tensor, lengths: list[int], loss_mask: torch.Tensor, pard_token: int,
               depths: int, retention: float = 0.7, min_retention: float = 0.2,
               generator: torch.Generator | None = None, pad_id: int = 0) -> CODLayout:
    """The COD layout of a right-padded batch (`lengths` real tokens per row; `loss_mask[b, p]` = 0: no loss on
    predicting token p). `retention=1` keeps every position at every depth (the acceptance eval's layout,
    with the rows it samples restricted by the caller)."""
    rows = []
    for b, length in enumerate(lengths):
        kept = kept_positions(length, depths, retention, min_retention, generator)
        positions = torch.cat(kept)
        depth = torch.cat([torch.full((len(k),), i) for i, k in enumerate(kept)])
        tokens = torch.where(depth == 0, input_ids[b, positions], torch.tensor(pard_token))
        target_pos = positions + 1
        has_next = target_pos < length
        nxt = target_pos.clamp(max=length - 1)
        labels = torch.where(has_next & loss_mask[b, nxt].bool(), input_ids[b, nxt], torch.tensor(IGNORE))
        rows.append((tokens, positions, depth, labels))
    width = max(len(r[0]) for r in rows)
    batch = len(rows)
    ids = torch.full((batch, width), pad_id, dtype=torch.long)
    pos = torch.zeros(batch, width, dtype=torch.long)
    dep = torch.full((batch, width), -1, dtype=torch.long)
    lab = torch.full((batch, width), IGNORE, dtype=torch.long)
    for b, (tokens, positions, depth, labels) in enumerate(rows):
        n = len(tokens)
        ids[b, :n], pos[b, :n], dep[b, :n], lab[b, :n] = tokens, positions, depth, labels
    return CODLayout(ids, pos, dep, lab, cod_attention(pos, dep))


def cod_attention(positions: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T]: a token of depth i at position p (its chain's last real token at a = p - i) sees the real
    tokens at positions <= a and the masks of its own chain up to itself (depth 1..i, same a). Padding
    (depth -1) is seen by nothing and sees only itself (a row of no keys would make attention NaN)."""
    anchor = positions - depths.clamp(min=0)
    q_depth, k_depth = depths[:, :, None], depths[:, None, :]
    q_anchor, k_anchor = anchor[:, :, None], anchor[:, None, :]
    real_key = (k_depth == 0) & (positions[:, None, :] <= q_anchor)
    chain_key = (k_depth >= 1) & (k_depth <= q_depth) & (k_anchor == q_anchor)
    allowed = (real_key | chain_key) & (q_depth >= 0)
    pad = depths < 0
    allowed |= pad[:, :, None] & torch.eye(depths.shape[1], dtype=torch.bool)[None]
    return allowed[:, None]
