"""EAGLE and EAGLE-3 proposers: the head drafts k tokens autoregressively from the target's features.

Per request the head keeps its own KV cache slot, in step with the target's: each target forward hands over
the features of newly verified positions (`observe`); at the next `propose` the head first runs over those
pending positions (feature at i with token i+1, both known), which fills its cache and yields draft 1 from
the last one; drafts 2..k then feed the head its own output. Draft-step entries past the verified prefix
are overwritten next round, like the target's rejected entries: nothing is copied.
"""

from __future__ import annotations

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.models.heads import load_head
from draftsmith.models.kv_cache import ForwardBatch
from draftsmith.serve.request import Request
from draftsmith.serve.spec.proposer import Drafts, Proposer
from draftsmith.serve.spec.registry import register_proposer


class _EagleFamilyProposer(Proposer):
    def __init__(self, config, target, max_num_seqs: int, max_model_len: int):
        super().__init__(config, target, max_num_seqs, max_model_len)
        if not config.model:
            raise DraftsmithError(f"method {self.method!r} needs \"model\": the draft head directory")
        weight = target.model.embed_tokens.weight
        self.head = load_head(config.model, dtype=weight.dtype, device=weight.device)
        if self.head.head_type != self.method:
            raise DraftsmithError(f"{config.model} holds an {self.head.head_type!r} head but the speculative config "
                                  f"says method {self.method!r}")
        self.head.attach_target(target)
        self.head.init_rope(max_model_len)
        self.hidden_layer_ids = self.head.hidden_layer_ids
        self.cache = self.head.make_cache(max_num_seqs, max_model_len)
        self.device = weight.device
        self.pending: dict[str, tuple[int, list[torch.Tensor]]] = {}  # request id -> (first position, features)

    def features(self, hidden_states):
        return self.head.features(hidden_states)

    def observe(self, request: Request, start: int, features: torch.Tensor) -> None:
        first, chunks = self.pending.get(request.request_id, (start, []))
        chunks.append(features)
        self.pending[request.request_id] = (first, chunks)

    def release(self, request: Request) -> None:
        self.pending.pop(request.request_id, None)

    def _run(self, rows, tokens, hidden, starts, q_lens, from_target):
        batch = ForwardBatch.build([r.slot for r in rows], starts, q_lens, self.cache, None, self.device)
        with torch.inference_mode():
            return self.head.step(tokens.to(self.device), hidden, batch.positions, from_target, self.cache, batch)

    def propose(self, rows: list[Request], max_drafts: list[int]) -> Drafts:
        drafts: list[list[int]] = [[] for _ in rows]
        active = [i for i, limit in enumerate(max_drafts) if limit > 0 and rows[i].request_id in self.pending]
        if not active:
            return Drafts(drafts)
        # 1) catch up on verified positions; the last one predicts draft 1.
        sub = [rows[i] for i in active]
        starts, feats = [], []
        for r in sub:
            first, chunks = self.pending.pop(r.request_id)
            starts.append(first)
            feats.append(torch.cat(chunks))
        q_lens = [len(f) for f in feats]
        width = max(q_lens)
        hidden = torch.zeros(len(sub), width, feats[0].shape[-1], dtype=feats[0].dtype, device=self.device)
        tokens = torch.zeros(len(sub), width, dtype=torch.long)
        for j, (r, start, f) in enumerate(zip(sub, starts, feats)):
            hidden[j, : len(f)] = f
            history = r.all_token_ids()
            tokens[j, : len(f)] = torch.tensor(history[start + 1 : start + 1 + len(f)])
        out, logits = self._run(sub, tokens, hidden, starts, q_lens, from_target=True)
        last = torch.tensor(q_lens, device=self.device) - 1
        index = torch.arange(len(sub), device=self.device)
        state, next_ids = out[index, last], self.head.to_target_ids(logits[index, last].argmax(-1))
        positions = [s + n for s, n in zip(starts, q_lens)]  # where draft step 2 sits
        # 2) drafts 2..k feed the head its own output.
        step_rows = list(range(len(sub)))
        step = 1
        while True:
            ids = next_ids.tolist()
            for j in step_rows:
                drafts[active[j]].append(ids[j])
            step_rows = [j for j in step_rows if max_drafts[active[j]] > step]
            if not step_rows:
                break
            keep = torch.tensor(step_rows, device=self.device)
            rows_now = [sub[j] for j in step_rows]
            out, logits = self._run(rows_now, next_ids[keep][:, None].cpu(), state[keep][:, None],
                                    [positions[j] for j in step_rows], [1] * len(step_rows), from_target=False)
            full_state, full_ids = state.clone(), next_ids.clone()
            full_state[keep], full_ids[keep] = out[:, 0], self.head.to_target_ids(logits[:, 0].argmax(-1))
            state, next_ids = full_state, full_ids
            for j in step_rows:
                positions[j] += 1
            step += 1
        return Drafts(drafts)


@register_proposer("eagle")
class EagleProposer(_EagleFamilyProposer):
    pass


@register_proposer("eagle3")
class Eagle3Proposer(_EagleFamilyProposer):
    pass
