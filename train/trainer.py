"""The draft-head trainer on accelerate: one script for `accelerate launch -m draftsmith.train RECIPE.yaml`
and `draftsmith train RECIPE.yaml`.

Checkpoints are `accelerator.save_state` directories (model, optimizer, scheduler, RNG states) written under
a temporary name and renamed, with our progress counters (`progress.json`), the resolved recipe and the
command line beside them; a rerun of the same command resumes from the newest one and skips the batches
already consumed, so a killed run loses only the step in flight. Before resuming, every pickle in the
checkpoint must load as plain data (`checkpoint_files`): a planted one is refused, never run.

Under FSDP and DeepSpeed ZeRO-3 each rank holds only shards of the head's parameters, so nothing reads the
unwrapped head's weights directly: the eval runs through the wrapped module's `forward` (where the wrapper
gathers them) and the final head is written from `accelerator.get_state_dict`, which every rank joins.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from draftsmith.acceptance_record import training_record, write_record
from draftsmith.corpus import load_records
from draftsmith.errors import DraftsmithError
from draftsmith.methods import RecipeTrainingSection, load_head, resolve_method
from draftsmith.models.dtypes import DTYPES
from draftsmith.models.heads import DraftHeadConfig
from draftsmith.models.loader import load_target
from draftsmith.models.tokenizer import load_tokenizer
from draftsmith.train.capture import CapturedDataset
from draftsmith.train.checkpoint_files import (
    Progress,
    read_progress,
    refuse_code_pickles,
    without_custom_pickles,
    write_progress,
)
from draftsmith.train.data import check_tokenizer, collate, tokenize_dataset
from draftsmith.train.feature_storage import compute_dtype
from draftsmith.train.objectives import acceptance_report, target_features
from draftsmith.train.recipe import Recipe, dump_recipe
from draftsmith.train.schedule import TimeBudget, cosine_schedule
from draftsmith.train.speculators_dataset import SpeculatorsDataset, is_speculators_dataset


def feature_layers_of(recipe: Recipe, num_layers: int) -> tuple[int, ...]:
    """The target layers the head reads: the recipe's, else its method's default."""
    m = recipe.model
    return tuple(m.aux_layer_ids) if m.aux_layer_ids else resolve_method(m.head_type).default_feature_layers(num_layers)


class HeadWithObjective(nn.Module):
    """The trained module: the head plus its objective as `forward`, so DDP/FSDP/DeepSpeed wrappers see the call.

    `forward(batch)` returns the objective's (loss, logs); `forward(batch, acceptance_depth=k)` returns the
    eval's simulated-acceptance (counts [k], chain starts) instead. Both go through the wrapper's forward,
    the only place where FSDP and ZeRO-3 have gathered the sharded head parameters."""

    def __init__(self, head, target, objective, cfg, feature_storage: str, acceptance_eval=None):
        super().__init__()
        self.head = head
        self.objective = objective
        self.acceptance_eval = acceptance_eval
        self._target = [target]  # frozen, not a submodule
        self.cfg = cfg
        self.feature_storage = feature_storage  # train.feature_storage's name: online features round through it

    def target_outputs(self, batch) -> dict:
        """What the objective reads of the target for `batch`: captured on disk (offline) or run now."""
        if "features" in batch:  # offline
            return {"features": batch["features"], "last": batch["last"]}
        if not self.head.feature_layers:  # a draft LM trained on text alone (PARD)
            return {}
        return target_features(self._target[0], self.head.feature_layers, batch["input_ids"], self.feature_storage)

    def forward(self, batch, acceptance_depth: int = 0):
        feats = self.target_outputs(batch)
        if acceptance_depth:
            return self.acceptance_eval(self.head, self._target[0], batch, feats, acceptance_depth)
        return self.objective(self.head, self._target[0], batch, feats, self.cfg)


def _as_recipe(value):
    return list(value) if isinstance(value, tuple) else value


def build_head(recipe: Recipe, target, train_ds):
    m = recipe.model
    if m.init_from:
        head = load_head(m.init_from)
        if head.head_type != m.head_type:
            raise DraftsmithError(f"model.init_from holds an {head.head_type!r} head, the recipe trains {m.head_type!r}")
        head = resolve_method(m.head_type).continue_head(head, m, target)
        # the saved head's architecture wins; a recipe asking for another variant would be ignored silently
        # keys the recipe set that shape the head; null asks for the default (a variant's null means "off")
        shaped = [name for name in sorted(set(m.model_fields_set) - {"target", "head_type", "init_from"} - m.START_ONLY)
                  if getattr(m, name) is not None or name in DraftHeadConfig.VARIANTS]
        saved = {name: _as_recipe(getattr(head.config, m.CONFIG_NAMES.get(name, name), None)) for name in shaped}
        differing = [f"{name}: {getattr(m, name)} (the head has {saved[name]})"
                     for name in shaped if getattr(m, name) != saved[name]]
        if differing:
            raise DraftsmithError(f"the recipe sets {'; '.join(differing)}, but model.init_from continues a saved "
                                  "head as it is: drop those keys or start a new head")
        return head.attach_target(target)
    aux = feature_layers_of(recipe, target.config.num_hidden_layers)
    return resolve_method(m.head_type).build_head(m, target, aux, train_ds)


def prepare_datasets(recipe: Recipe, tokenizer, feature_layers):
    d = recipe.data
    if d.hidden_states_dir:  # eval_files, when given, are scored with features the target computes then
        full = (SpeculatorsDataset(d.hidden_states_dir, feature_layers, recipe.model.target,
                                   compute_dtype(d.hidden_states_dtype), d.max_length)
                if is_speculators_dataset(d.hidden_states_dir) else CapturedDataset(d.hidden_states_dir, feature_layers))
        if d.eval_files:
            return full, tokenize_dataset(load_records(d.eval_files, d.max_eval_samples), tokenizer, d.max_length,
                                          d.format, d.mask_prompt)
        n_eval = max(1, int(len(full) * d.eval_fraction)) if d.eval_fraction else 0
        n_eval = min(n_eval, d.max_eval_samples or n_eval)
        train = torch.utils.data.Subset(full, range(n_eval, len(full)))
        evaluation = torch.utils.data.Subset(full, range(n_eval)) if n_eval else None
        return train, evaluation
    train = tokenize_dataset(load_records(d.train_files, d.max_train_samples), tokenizer, d.max_length, d.format,
                             d.mask_prompt)
    if d.eval_files:
        evaluation = tokenize_dataset(load_records(d.eval_files, d.max_eval_samples), tokenizer, d.max_length,
                                      d.format, d.mask_prompt)
    elif d.eval_fraction > 0:
        n_eval = min(max(1, int(len(train) * d.eval_fraction)), d.max_eval_samples or len(train))
        evaluation, train = train.select(range(n_eval)), train.select(range(n_eval, len(train)))
    else:
        evaluation = None
    return train, evaluation


def _save_checkpoint(accelerator, recipe: Recipe, output: Path, progress: Progress, argv: list[str]) -> None:
    checkpoints = output / "checkpoints"
    final = checkpoints / f"step_{progress.step:08d}"
    tmp = checkpoints / f".tmp_step_{progress.step:08d}"
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()  # every rank writes its own files (RNG states; shards under FSDP) first
    if accelerator.is_main_process:
        (tmp / "recipe.yaml").write_text(dump_recipe(recipe))
        (tmp / "command.txt").write_text(" ".join(argv) + "\n")
        write_progress(tmp, progress)
        os.replace(tmp, final)  # a kill before this line leaves only a .tmp directory, ignored on resume
        kept = sorted(checkpoints.glob("step_*"))
        for old in kept[: -recipe.training.keep_checkpoints]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()


def latest_checkpoint(output: Path) -> Path | None:
    found = sorted((output / "checkpoints").glob("step_*"))
    return found[-1] if found else None


def resume_state(accelerator, checkpoint: Path) -> Progress:
    """Loads `checkpoint` into the prepared objects and returns its counters. Every rank checks the pickles
    first, so each refuses (or loads) the same files before accelerate unpickles any."""
    refuse_code_pickles(checkpoint)
    progress = read_progress(checkpoint)
    with without_custom_pickles(checkpoint) as state_dir:
        accelerator.load_state(str(state_dir))
    return progress


def evaluate(accelerator, trainee, loader, max_k: int) -> dict[str, float]:
    """Simulated acceptance over `loader` (sharded across ranks), summed over ranks. Runs through the prepared
    module's forward so that FSDP/ZeRO-3 gather the parameters; every rank must call it (collectives)."""
    trainee.eval()
    counts, starts, served = torch.zeros(max_k, dtype=torch.long), 0, None
    with torch.no_grad():
        for batch in loader:
            # (counts, starts), or with a served walk's (tokens, blocks) after them
            c, n, *walk = trainee(batch, acceptance_depth=max_k)
            counts, starts = counts + c.cpu(), starts + int(n)
            if walk:
                served = (served if served is not None else torch.zeros(2, dtype=torch.long)) + torch.tensor(walk)
    counts = accelerator.reduce(counts.to(accelerator.device), reduction="sum").cpu()
    starts = int(accelerator.reduce(torch.tensor(starts, device=accelerator.device), reduction="sum"))
    if served is not None:
        served = accelerator.reduce(served.to(accelerator.device), reduction="sum").tolist()
    trainee.train()
    return acceptance_report(counts, starts, served)


clock = time.monotonic  # the training loop's time budget reads this clock


def out_of_time(accelerator, budget: TimeBudget | None) -> bool:
    """Whether the training loop's wall-clock budget is spent, agreed by every process (the first one past it
    stops them all, at the same step); the reading is what the LR schedule follows from then on."""
    return budget is not None and budget.read(accelerator, clock()) > 1


def save_head(accelerator, trainee, directory: Path, dtype: torch.dtype) -> None:
    """Writes the trained head in the native format from the full, gathered state dict, its floating tensors
    in `dtype`.

    Every rank must call this: `get_state_dict` gathers FSDP shards (and ZeRO-3 partitions, which needs
    `stage3_gather_16bit_weights_on_model_save`) and hands the full tensors to the main process, which writes
    them. The tensors are loaded, by assignment, into a head built on the meta device, so a missing key or a
    wrong shape (a shard) fails here instead of in a later `load_head`.
    """
    state = accelerator.get_state_dict(trainee)
    if not accelerator.is_main_process:
        return
    head = accelerator.unwrap_model(trainee).head
    weights = {k.removeprefix("head."): v.detach().cpu().to(dtype if v.is_floating_point() else v.dtype).contiguous()
               for k, v in state.items() if k.startswith("head.")}
    with torch.device("meta"):
        full = type(head)(head.config)
    full.load_state_dict(weights, strict=True, assign=True)
    full.save_pretrained(directory)


@dataclass(frozen=True)
class PreparedRun:
    """What `accelerator.prepare` hands back for one run, and the optimizer steps its schedule spans."""

    trainee: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    train_loader: Any
    eval_loader: Any | None  # None when there is no eval data or the method has no acceptance eval
    total_steps: int
    budget: TimeBudget | None = None  # training.max_minutes, which the LR schedule also follows


# What a multi-process run prepared stays referenced until its worker leaves with os._exit (train/cli.py):
# freeing DDP's reducer (or FSDP's handles) destroys gloo's process group, which joins gloo's worker thread
# while holding the GIL, and that thread may still need the GIL to release its last barrier's work.
_HELD_UNTIL_EXIT: list = []


def train(recipe: Recipe, argv: list[str] | None = None, eval_only: bool = False) -> Path:
    """Runs (or resumes) the recipe; returns the directory of the final head. `eval_only`: evaluates the run's
    newest checkpoint on the recipe's eval data instead (`evaluate_checkpoint`) and returns its report's path."""
    output = Path(recipe.training.output_dir)
    log_with = "tensorboard" if _has_tensorboard() else None
    # an eval leaves the run's recipe.yaml the one it trained with (its overrides name other eval data)
    accelerator = _start_run(recipe, output, log_with, record=not eval_only)
    argv = argv or sys.argv
    trainee, train_ds, eval_ds, pad = _build_trainee(accelerator, recipe)
    num_parameters = sum(p.numel() for p in trainee.head.parameters())  # before prepare shards them
    run = _prepare(accelerator, recipe.training, trainee, train_ds, eval_ds, pad)
    if accelerator.num_processes > 1:
        _HELD_UNTIL_EXIT.append((accelerator, run))
    progress = _resume(accelerator, output)
    if eval_only:
        return evaluate_checkpoint(accelerator, recipe, output, run, progress)
    if log_with:
        accelerator.init_trackers("draftsmith", config={"head_type": recipe.model.head_type})
    accelerator.print(f"training {recipe.model.head_type} head: {num_parameters:,} "
                      f"parameters, {len(train_ds)} samples, {run.total_steps} optimizer steps")
    progress = _train_epochs(accelerator, recipe, output, argv, run, progress)
    return _finish(accelerator, recipe, output, argv, run, progress)


def evaluate_checkpoint(accelerator, recipe: Recipe, output: Path, run: PreparedRun, progress: Progress) -> Path:
    """The simulated acceptance of the checkpoint `progress` was resumed from, on the recipe's eval data (as
    overridden: another eval file, `training.eval_max_k`), written as `reeval_step<N>.json` beside the run's
    `eval_*.json` (which stay the head's training record) -> that file."""
    if not progress.step:
        raise DraftsmithError(f"{output / 'checkpoints'} holds no checkpoint to evaluate: train the recipe first")
    if run.eval_loader is None:
        raise DraftsmithError("the recipe has no eval data: set data.eval_files (or data.eval_fraction)")
    report = evaluate(accelerator, run.trainee, run.eval_loader, recipe.training.eval_max_k)
    _report(accelerator, output, f"step{progress.step:08d}", report, progress.step, prefix="reeval")
    accelerator.end_training()
    return output / f"reeval_step{progress.step:08d}.json"


def _start_run(recipe: Recipe, output: Path, log_with: str | None, record: bool = True):
    """The run's one `Accelerator`, seeded, with the resolved recipe written into the run directory (`record`)."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed

    t = recipe.training
    accelerator = Accelerator(gradient_accumulation_steps=t.gradient_accumulation_steps,
                              mixed_precision=t.mixed_precision, log_with=log_with, project_dir=str(output),
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    set_seed(t.seed)
    if accelerator.is_main_process and record:
        output.mkdir(parents=True, exist_ok=True)
        (output / "recipe.yaml").write_text(dump_recipe(recipe))
    return accelerator


def _build_trainee(accelerator, recipe: Recipe):
    """Loads the target and the data and builds the head; returns (trainee, train set, eval set or None,
    pad token id)."""
    on_cpu = accelerator.device.type == "cpu"  # multi-process CPU runs get "cpu:0", which safetensors rejects
    target = load_target(recipe.model.target, dtype="float32" if on_cpu else "bfloat16",
                         device="cpu" if on_cpu else accelerator.device)
    tokenizer = load_tokenizer(Path(recipe.model.target))
    check_tokenizer(tokenizer, target.config.vocab_size)
    with accelerator.main_process_first():  # datasets caches the tokenization once
        train_ds, eval_ds = prepare_datasets(recipe, tokenizer, feature_layers_of(recipe, target.config.num_hidden_layers))
    if len(train_ds) == 0:
        raise DraftsmithError("no training samples left after tokenization and filtering")
    head = build_head(recipe, target, train_ds if not recipe.data.hidden_states_dir else _token_view(train_ds))
    method = resolve_method(recipe.model.head_type)
    method.record_training(head, recipe.training)
    trainee = HeadWithObjective(head, target, method.objective(), recipe.training,
                                recipe.data.hidden_states_dtype, method.acceptance_eval())
    return trainee, train_ds, eval_ds, tokenizer.pad_token_id or 0


def _prepare(accelerator, t: RecipeTrainingSection, trainee: HeadWithObjective, train_ds, eval_ds, pad: int) -> PreparedRun:
    """Builds the loaders, the optimizer and the cosine schedule (`train.schedule`: it ends with the run's
    steps or its max_minutes, whichever comes first) and hands them to `accelerator.prepare`."""
    train_loader = torch.utils.data.DataLoader(train_ds, batch_size=t.batch_size, shuffle=True,
                                               collate_fn=lambda r: collate(r, pad), num_workers=t.num_workers)
    eval_loader = torch.utils.data.DataLoader(eval_ds, batch_size=t.batch_size, collate_fn=lambda r: collate(r, pad)) \
        if eval_ds is not None and len(eval_ds) and trainee.acceptance_eval is not None else None
    optimizer = torch.optim.AdamW(trainee.head.parameters(), lr=t.learning_rate, betas=(0.9, 0.95),
                                  weight_decay=t.weight_decay)
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None and plugin.deepspeed_config.get("gradient_clipping", "auto") == "auto":
        # DeepSpeed clips inside its own step (accelerate's clip_grad_norm_ does nothing there) and would
        # resolve "auto" to 1.0: hand it the recipe's value instead of silently ignoring it
        plugin.deepspeed_config["gradient_clipping"] = t.max_grad_norm
    trainee, optimizer, train_loader = accelerator.prepare(trainee, optimizer, train_loader)
    steps_per_epoch = math.ceil(len(train_loader) / t.gradient_accumulation_steps)  # per process
    total_steps = min(t.epochs * steps_per_epoch, t.max_steps or t.epochs * steps_per_epoch)
    # accelerate steps a prepared scheduler once per process per optimizer step
    scale = accelerator.num_processes
    budget = TimeBudget(60 * t.max_minutes) if t.max_minutes else None
    scheduler = accelerator.prepare(cosine_schedule(optimizer, int(t.warmup_ratio * total_steps) * scale,
                                                    total_steps * scale, budget))
    if eval_loader is not None:
        eval_loader = accelerator.prepare(eval_loader)
    return PreparedRun(trainee, optimizer, scheduler, train_loader, eval_loader, total_steps, budget)


def _resume(accelerator, output: Path) -> Progress:
    """The newest checkpoint's counters, loaded with its state into the prepared objects; fresh ones if none."""
    checkpoint = latest_checkpoint(output)
    if checkpoint is None:
        return Progress()
    progress = resume_state(accelerator, checkpoint)
    accelerator.print(f"resumed from {checkpoint} (step {progress.step}, epoch {progress.epoch})")
    return progress


def _train_epochs(accelerator, recipe: Recipe, output: Path, argv: list[str], run: PreparedRun,
                  progress: Progress) -> Progress:
    """The epoch loop from `progress` on, which it advances and returns. It stops after `training.epochs`,
    at `total_steps` or at the first optimizer step past `max_minutes`, and evaluates at each epoch's end."""
    t = recipe.training
    bar = tqdm(total=run.total_steps, initial=progress.step, desc="train", disable=not accelerator.is_main_process)
    if run.budget is not None:
        run.budget.begin(clock())
    while progress.epoch < t.epochs and progress.step < run.total_steps and not out_of_time(accelerator, run.budget):
        run.train_loader.set_epoch(progress.epoch)
        loader = accelerator.skip_first_batches(run.train_loader, progress.batches_in_epoch) \
            if progress.batches_in_epoch else run.train_loader
        for batch in loader:
            loss, logs = _micro_batch(accelerator, run, batch, t.max_grad_norm)
            progress.batches_in_epoch += 1
            if accelerator.sync_gradients:
                progress.step += 1
                bar.update(1)
                bar.set_postfix(loss=f"{loss.item():.3f}")
                if progress.step % t.log_every_steps == 0:
                    _log(accelerator, output, {"step": progress.step, "loss": loss.item(),
                                               "lr": run.scheduler.get_last_lr()[0], **logs})
                if progress.step % t.save_every_steps == 0:
                    _save_checkpoint(accelerator, recipe, output, progress, argv)
                if progress.step >= run.total_steps or out_of_time(accelerator, run.budget):
                    break
        if progress.batches_in_epoch < len(run.train_loader):
            break  # max_steps or max_minutes reached inside the epoch
        progress.epoch, progress.batches_in_epoch = progress.epoch + 1, 0
        if run.eval_loader is not None:
            _report(accelerator, output, f"epoch{progress.epoch}",
                    evaluate(accelerator, run.trainee, run.eval_loader, t.eval_max_k), progress.step)
    bar.close()
    return progress


def _micro_batch(accelerator, run: PreparedRun, batch, max_grad_norm: float):
    """Forward and backward of one batch, and the clipped optimizer step when it closes an accumulation
    window (accelerate skips the step otherwise); returns the objective's (loss, logs)."""
    with accelerator.accumulate(run.trainee):
        loss, logs = run.trainee(batch)
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            accelerator.clip_grad_norm_(run.trainee.parameters(), max_grad_norm)
        run.optimizer.step()
        run.scheduler.step()
        run.optimizer.zero_grad()
    return loss, logs


def _log(accelerator, output: Path, record: dict) -> None:
    accelerator.log(record, step=record["step"])
    if accelerator.is_main_process:  # a plain-text twin of the TensorBoard scalars
        with (output / "train_log.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")


def _finish(accelerator, recipe: Recipe, output: Path, argv: list[str], run: PreparedRun, progress: Progress) -> Path:
    """After the loop: the eval of a run stopped mid-epoch, a checkpoint of the last step unless the loop saved
    one, and the final head in `training.save_dtype`; returns the head's directory."""
    if progress.batches_in_epoch and run.eval_loader is not None:  # stopped mid-epoch by max_steps or max_minutes
        _report(accelerator, output, "final", evaluate(accelerator, run.trainee, run.eval_loader,
                                                       recipe.training.eval_max_k), progress.step)
    if not (output / "checkpoints" / f"step_{progress.step:08d}").exists():
        _save_checkpoint(accelerator, recipe, output, progress, argv)
    final = output / "head"
    save_head(accelerator, run.trainee, final, DTYPES[recipe.training.save_dtype])  # on every rank: it gathers
    if accelerator.is_main_process:
        (final / "recipe.yaml").write_text(dump_recipe(recipe))
        _write_training_record(output, final)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    accelerator.print(f"saved head to {final}")
    return final


def _write_training_record(output: Path, head_dir: Path) -> None:
    """The newest eval's simulated acceptance per position, as the head's record (`draftsmith check`)."""
    reports = sorted(output.glob("eval_*.json"), key=lambda path: path.stat().st_mtime)
    record = training_record(json.loads(reports[-1].read_text()), f"training eval ({reports[-1].name}): "
                             "simulated, teacher-forced on the eval split") if reports else None
    if record is not None:
        write_record(head_dir, record)


def _report(accelerator, output: Path, name: str, report: dict[str, float], step: int, prefix: str = "eval") -> None:
    accelerator.log(report, step=step)
    if accelerator.is_main_process:
        (output / f"{prefix}_{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    ks = [k for k in report if k.startswith("sim_mean_acceptance_length_k")]
    accelerator.print(f"eval {name}: simulated mean acceptance length " +
                      ", ".join(f"k={k.rsplit('k', 1)[1]}: {report[k]:.2f}" for k in ks) +
                      (f"; {report['sim_served_acceptance_length']:.2f} walked as a server drafts"
                       if "sim_served_acceptance_length" in report else ""))


def _token_view(ds):
    """A captured dataset's tokens (for the draft-vocabulary count), read without its features."""
    source, indices = (ds.dataset, ds.indices) if isinstance(ds, torch.utils.data.Subset) else (ds, range(len(ds)))

    class View:
        def __iter__(self):
            return (source.tokens(i) for i in indices)
    return View()


def _has_tensorboard() -> bool:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True
