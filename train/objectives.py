"""What the trainer hands every method's objective and eval, and what it makes of their results: the frozen
target's features for a batch (the same online and offline), and the acceptance report. The objectives
themselves live with their methods (`draftsmith/methods/<name>/objective.py`)."""

from __future__ import annotations

import torch

from draftsmith.train.feature_storage import round_trip


def target_features(target, feature_layers: tuple[int, ...], input_ids: torch.Tensor,
                    storage: str) -> dict[str, torch.Tensor]:
    """The frozen target's features (its feature layers, concatenated) and final normed hidden, as a capture
    stores them as `storage` (train.feature_storage) and reads them back."""
    last_id = target.config.num_hidden_layers
    with torch.no_grad():
        out = target(input_ids, feature_layers=set(feature_layers) | {last_id}, compute_logits=False)
    # Rounding through the storage format here makes online batches equal to offline (captured) ones.
    features = torch.cat([out.hidden_states[i] for i in feature_layers], dim=-1)
    return {"features": round_trip(features, len(feature_layers), storage),
            "last": round_trip(out.hidden_states[last_id], 1, storage)}


def acceptance_report(counts: torch.Tensor, starts: int, served: tuple[int, int] | None = None) -> dict[str, float]:
    """Per-depth acceptance rates and mean acceptance length (1 + sum of rates) for k = 1..len(counts); with
    `served` (tokens, blocks of a walk drafted as a server drafts it), their ratio at the largest k."""
    rates = (counts.double() / max(starts, 1)).tolist()
    report = {f"sim_accept_pos{s + 1}": r for s, r in enumerate(rates)}
    for k in range(1, len(rates) + 1):
        report[f"sim_mean_acceptance_length_k{k}"] = 1 + sum(rates[:k])
    if served is not None and served[1]:
        report["sim_served_acceptance_length"] = served[0] / served[1]
    return report
