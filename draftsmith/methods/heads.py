"""Reading native head directories through the method registry: which config class and which module a
`draftsmith_head_type` means is asked of the method that owns that head type."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.methods.registry import head_method, method_names
from draftsmith.methods.speculative_config import TreeSpeculativeConfig
from draftsmith.models.head_configs import HEAD_TYPE_KEY, HeadConfig
from draftsmith.models.heads import RecurrentHead, load_head_weights
from draftsmith.models.linear import pack_weights_in, panels_run


def read_head_config(data: dict[str, Any], where: str | Path = "") -> HeadConfig:
    """The typed config of a native `config.json` dict, dispatched on its `draftsmith_head_type`."""
    method = head_method(data.get(HEAD_TYPE_KEY), where)
    return method.head_config.from_json(data)


def load_head(directory: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Builds the head module a native head directory describes and loads its weights."""
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise DraftsmithError(f"draft head directory {directory} has no config.json")
    try:
        data = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise DraftsmithError(f"{config_path} is not valid JSON: {exc}") from None
    method = head_method(data.get(HEAD_TYPE_KEY), config_path)
    head_class = method.head_module
    if head_class is None:
        runnable = method_names(lambda m: m.head_module is not None)
        raise DraftsmithError(f"{config_path}: {method.head_type} heads convert to and from draftsmith's format, but "
                              f"the engine cannot serve them yet ({', '.join(runnable)} heads it can)")
    head = head_class(read_head_config(data, config_path))
    return load_head_weights(head, directory).to(device=device, dtype=dtype).eval()


def load_attached_head(config, target, dtype: torch.dtype):
    """The head a `--speculative-config` names (`model`), loaded in `dtype` on the target's device, checked
    against the config's method and the k it asks for, and attached to `target`."""
    head = load_head(config.model, dtype=dtype, device=target.model.embed_tokens.weight.device)
    if head.head_type != config.method:
        raise DraftsmithError(f"{config.model} holds an {head.head_type!r} head but the speculative config "
                              f"says method {config.method!r}")
    most = head.config.max_drafts()
    tree = config.token_tree() if isinstance(config, TreeSpeculativeConfig) else None
    if most is not None and tree is not None and tree.max_depth > most:
        raise DraftsmithError(f"speculative_token_tree is {tree.max_depth} deep, but the {head.head_type} head "
                              f"{config.model} drafts at most {most} tokens in a row")
    depth = getattr(config, "tree_depth", None)  # a dynamic tree's (EAGLE-2's keys)
    if most is not None and depth is not None and depth > most:
        raise DraftsmithError(f"tree_depth={depth}, but the {head.head_type} head {config.model} drafts at most "
                              f"{most} tokens in a row; set tree_depth <= {most}")
    if most is not None and tree is None and depth is None and config.num_speculative_tokens > most:
        raise DraftsmithError(f"num_speculative_tokens={config.num_speculative_tokens}, but the {head.head_type} head "
                              f"{config.model} drafts at most {most} tokens a step; set num_speculative_tokens <= {most}")
    return head.attach_target(target)


def draft_dtype(requested: str, target_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a head drafts in: the config's `draft_dtype`, or for "auto" the target's, except under a
    float32 target on a device with fast bfloat16 matmuls (CUDA that has them, or a CPU oneDNN runs them on),
    where it is bfloat16. Drafts are only proposals, checked by the target, so this never changes what is
    generated; a bfloat16 head reads half the bytes per draft step (on the demo EAGLE-3 head on this 2-core
    CPU, 4 requests in flight: 1.07x to 1.18x over no speculation, the same acceptance). A CPU whose fp32
    layers run the panel GEMM (`models.linear.panels_run`) drafts in float32: there the demo's EAGLE-3 head
    drafted 5 tokens in 0.75x the time its bf16 copy took on oneDNN, the DFlash head 0.85x and the PARD draft
    model 0.8x (one request in flight), and its weights are read in bfloat16 there (`pack_draft_weights`)."""
    if requested != "auto":
        return getattr(torch, requested)
    if target_dtype != torch.float32:
        return target_dtype
    if device.type == "cpu" and panels_run(torch.float32):
        return torch.float32
    fast_bf16 = (torch.cuda.is_available() and torch.cuda.is_bf16_supported()) if device.type == "cuda" else \
        device.type == "cpu" and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return torch.bfloat16 if fast_bf16 else target_dtype


def pack_draft_weights(requested: str, drafters: list[torch.nn.Module], target: torch.nn.Module) -> int:
    """Under "auto" `draft_dtype`, a float32 drafter whose layers run the panel GEMM reads its own weights in
    bfloat16 (`models.linear.pack_weights_in`); what it shares with the target stays as it is, but a head
    that reads out through the target's LM head (EAGLE-1, MTP) reads it through a packed copy of its own.
    At one request in flight a draft step reads its weights from memory, not cache: the target and a head
    together outgrow the CPU's cache, so half the bytes is most of a step's time saved (the demo EAGLE-3
    head's 256 x 4096 LM head: 109 us in fp32, 37 us in bfloat16, one row, out of cache). -> layers packed."""
    if requested != "auto" or not panels_run(torch.float32):
        return 0
    packed = pack_weights_in(drafters, torch.bfloat16, shared=target)
    # a head reading out through the target's LM head reads it through a packed copy of its own
    return packed + sum(d.pack_readout(torch.bfloat16) for d in drafters if isinstance(d, RecurrentHead)
                        and d.reads_out_through_target)


def default_mask_token(model_dir: str | Path, key: str) -> int:
    """The pad token of a model directory's tokenizer, when it is a special token distinct from EOS/BOS: no text
    encodes to it and no training label is it, the role of PARD's and DFlash's reserved mask token. `key`: the
    recipe key that sets one instead, named in the error."""
    model_dir = Path(model_dir)
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
        tokens = json.loads((model_dir / "tokenizer.json").read_text()).get("added_tokens", [])
    except (OSError, json.JSONDecodeError):
        config, tokens = {}, []
    ids = {t.get("content"): t.get("id") for t in tokens if t.get("special")}

    def token_id(name: str):
        value = config.get(name)
        return ids.get(value.get("content") if isinstance(value, dict) else value)  # AddedToken dicts too

    pad = token_id("pad_token")
    if pad is not None and pad not in {token_id("eos_token"), token_id("bos_token")}:
        return pad
    raise DraftsmithError(f"{model_dir}: its tokenizer has no pad token apart from EOS/BOS to serve as the mask "
                          f"token; set {key} to an id no text encodes to (a reserved special token)")


@torch.no_grad()
def start_from_target_layers(layers, target, what: str, instead: str) -> None:
    """Each of `layers` starts as a copy of one of the target's last len(layers) decoder layers, in order (q/k
    norms, which a Llama layer lacks, at 1): a drafter's stacked layers begin where the target's end. Where a
    layer's shapes do not fit, a one-line error naming the head (`what`) and the recipe change that starts it
    random (`instead`)."""
    if len(layers) > len(target.model.layers):
        raise DraftsmithError(f"{len(layers)} {what} layers to start from the target's, which has "
                              f"{len(target.model.layers)}: {instead} to start them random")
    for mine, theirs in zip(layers, target.model.layers[-len(layers):]):
        state = {k: v.float() for k, v in theirs.state_dict().items()}
        own = mine.state_dict()
        missing = [k for k in own if k not in state and not k.endswith(("q_norm.weight", "k_norm.weight"))]
        misfit = [f"{k} {tuple(v.shape)} (the head's {tuple(own[k].shape)})" for k, v in state.items()
                  if k not in own or own[k].shape != v.shape]
        if missing or misfit:
            raise DraftsmithError(f"the target's decoder layer does not fit the {what} head's (missing {missing}, "
                                  f"not fitting {misfit}): {instead} to start it random")
        mine.load_state_dict(state, strict=False)
