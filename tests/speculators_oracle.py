"""vllm-project/speculators 0.9 as an independent test oracle for EAGLE-3, P-EAGLE, DFlash and DSpark
heads: its own trainer's defaults, its own save_pretrained, from_pretrained and forward. `make test` installs
it test-only (the Makefile's ORACLE_STAMP rule, with --no-deps: its torchaudio/torchvision pins pull a CUDA
torch); tests that need it skip, saying why, where it does not import.
"""

from __future__ import annotations

import warnings
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

VERSION = "0.9.0"
INSTALL = (f'pip install -e ".[oracle]" && pip install --no-deps "speculators=={VERSION}" '
           f'"hs-connectors=={VERSION}" (what `make test` runs)')


def require():
    """The speculators modules these tests use, or a skip naming the install command."""
    try:
        from speculators.models.eagle3 import Eagle3DraftModel
        from speculators.train.cli import create_transformer_layer_config
        from speculators.train.config import TrainConfig
    except ImportError as exc:
        pytest.skip(f"speculators does not import here ({exc}); install it test-only with: {INSTALL}")
    installed = version("speculators")
    if installed != VERSION:
        pytest.skip(f"speculators {installed} installed; these tests check {VERSION}")
    return Eagle3DraftModel, create_transformer_layer_config, TrainConfig


def train_config_defaults(**overrides) -> dict:
    """speculators' training arguments as its CLI resolves them with no flags given (EAGLE-3)."""
    _, _, TrainConfig = require()
    return {**TrainConfig().flatten(), **overrides}


def trained_head(directory: Path, verifier: Path, draft_vocab: int = 1024, seed: int = 0, peagle: bool = False,
                 **overrides) -> Path:
    """A head built and saved the way speculators' trainer does it, with its default flags unless `overrides`
    says otherwise (e.g. draft_arch="qwen3", fc_norm=True, norm_before_fc=False, num_layers=4), its weights
    drawn at random (norm weights around 1, so that every norm shows in the output), then
    `save_pretrained(directory)`. `peagle`: its P-EAGLE model (the same layers, a `mask_hidden`, slot token 3)."""
    Eagle3DraftModel, create_transformer_layer_config, _ = require()
    if peagle:
        from speculators.models.peagle import PEagleDraftModel as Eagle3DraftModel

        overrides = {"mask_token_id": 3, **overrides}
    args = train_config_defaults(verifier_name_or_path=str(verifier), target_layer_ids=[1, 3, 5],
                                 draft_vocab_size=draft_vocab, draft_attn_impl="sdpa", **overrides)
    layer = create_transformer_layer_config(str(verifier), num_layers=args["num_layers"], draft_arch=args["draft_arch"],
                                            hidden_act=None, sliding_window=args["sliding_window"],
                                            full_attention_indices=args["full_attention_indices"])
    generator = torch.Generator().manual_seed(seed)
    t2d = torch.zeros(layer.vocab_size, dtype=torch.bool)
    t2d[torch.randperm(layer.vocab_size, generator=generator)[:draft_vocab]] = True
    d2t = torch.nonzero(t2d).flatten() - torch.arange(draft_vocab)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = Eagle3DraftModel.from_training_args(layer, t2d=t2d, d2t=d2t, **args)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith(("embed_tokens", "verifier_")):
                continue  # frozen copies of the verifier's
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.05 * noise)
    model.save_pretrained(str(directory))
    return directory


def load(directory: Path, dflash: bool = False, peagle: bool = False, dspark: bool = False):
    """speculators' from_pretrained (its EAGLE-3 model, or with `dflash` its DFlash one, `peagle` its P-EAGLE
    one, `dspark` its DSpark one) -> (model, keys it expected and the file lacks, keys the file holds and it
    does not define). Its own ignore lists (the verifier's weights it fills in itself) do not count."""
    Eagle3DraftModel, _, _ = require()
    from safetensors import safe_open

    model_class = Eagle3DraftModel
    if dflash:
        from speculators.models.dflash.core import DFlashDraftModel as model_class
    if peagle:
        from speculators.models.peagle import PEagleDraftModel as model_class
    if dspark:
        from speculators.models.dspark.core import DSparkDraftModel as model_class
    config = model_class.config_class.from_pretrained(str(directory))
    # its default, flex attention, needs torch.compile on CPU: SDPA computes the same masks
    config.transformer_layer_config._attn_implementation = "sdpa"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = model_class.from_pretrained(str(directory), config=config)
    with safe_open(str(Path(directory) / "model.safetensors"), "pt") as weights:
        saved = set(weights.keys())
    defined = set(model.state_dict())
    optional = set(model._keys_to_ignore_on_load_missing) | set(model._keys_to_ignore_on_save)
    return model.float().eval(), sorted(defined - saved - optional), sorted(saved - defined)


@torch.no_grad()
def logits_by_step(model, input_ids: torch.Tensor, features: torch.Tensor, steps: int,
                   forward=None) -> list[torch.Tensor]:
    """Its forward's LM-head output [1, T, draft_vocab] at each training-time-test step: step 0 reads the
    tokens and target features, step s the tokens shifted by s and its own step s-1 output. `forward`: another
    forward over the model's modules (default: its own)."""
    captured = []
    hook = model.lm_head.register_forward_hook(lambda _module, _inputs, output: captured.append(output.float()))
    try:
        (forward or model)(hidden_states=features, input_ids=input_ids, document_ids=torch.zeros_like(input_ids),
                           ttt_steps=steps)
    finally:
        hook.remove()
    return captured


@torch.no_grad()
def dflash_blocks(model, features: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor,
                  last_hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """speculators' DFlash training forward over one sequence with the blocks at `anchors` [A] (its own anchor
    sampler is bypassed) -> (draft logits [A, block_size, V], its targets [A, block_size, V]: the verifier's
    logits from `last_hidden` [1, L, H] that each block slot learns, the slots it trains [A, block_size])."""
    from speculators.models.dflash import core

    picked = (anchors.clone(), torch.ones(len(anchors), dtype=torch.bool))
    sampler, core.select_anchors = core.select_anchors, lambda *_args: picked
    try:
        _, logits, targets, trained, _ = model._backbone_forward(
            features, input_ids, torch.ones_like(input_ids), last_hidden, torch.zeros_like(input_ids),
            max_anchors=len(anchors))
    finally:
        core.select_anchors = sampler
    size = model.block_size
    return logits.view(len(anchors), size, -1).float(), targets.view(len(anchors), size, -1).float(), \
        trained.view(len(anchors), size).bool()


@torch.no_grad()
def dspark_blocks(model, features: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor,
                  last_hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """speculators' DSpark training forward over one sequence with the blocks at `anchors` [A] (its anchor
    sampler bypassed, as in `dflash_blocks`) -> (the draft logits its loss reads, the Markov bias of each
    position's teacher-forced previous token included [A, block_size, V]; its confidence logits [A, block_size]
    or None)."""
    from speculators.models.dflash import core as dflash_core
    from speculators.models.dspark import core

    picked = (anchors.clone(), torch.ones(len(anchors), dtype=torch.bool))
    seen = {}

    def capture(logits, _targets, confidence, *_args, **_kwargs):
        seen.update(logits=logits, confidence=confidence)
        return logits.new_zeros(()), {}

    sampler, dflash_core.select_anchors = dflash_core.select_anchors, lambda *_args: picked
    metrics, core.compute_metrics = core.compute_metrics, capture
    try:
        model(hidden_states=features, input_ids=input_ids, loss_mask=torch.ones_like(input_ids),
              verifier_last_hidden_states=last_hidden, document_ids=torch.zeros_like(input_ids),
              max_anchors=len(anchors))
    finally:
        dflash_core.select_anchors, core.compute_metrics = sampler, metrics
    size = model.block_size
    confidence = seen["confidence"]
    return seen["logits"].view(len(anchors), size, -1).float(), \
        None if confidence is None else confidence.view(len(anchors), size).float()
