"""Training data: assistant-only loss masks through the target's chat template, draft vocabulary choice."""

import pytest

from draftsmith.corpus import to_messages
from draftsmith.errors import DraftsmithError
from draftsmith.methods.eagle3.vocab import draft_vocab_from_frequencies
from draftsmith.models.tokenizer import load_tokenizer
from draftsmith.train.data import check_tokenizer, tokenize_chat
from helpers import DEMO_MODEL


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEMO_MODEL)


def test_loss_mask_covers_assistant_turns_only(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add two numbers."},
                {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
                {"role": "user", "content": "Now subtract."}, {"role": "assistant", "content": "def sub(a, b): ..."}]
    out = tokenize_chat(messages, tokenizer, 512)
    masked = tokenizer.decode([t for t, m in zip(out["input_ids"], out["loss_mask"]) if m])
    unmasked = tokenizer.decode([t for t, m in zip(out["input_ids"], out["loss_mask"]) if not m])
    assert "def add(a, b):\n    return a + b" in masked and "def sub(a, b): ..." in masked
    assert "Add two numbers" in unmasked and "Be brief" in unmasked and "Now subtract" in unmasked
    assert "Add two" not in masked and "<|im_start|>assistant" in unmasked


def test_sharegpt_roles_map_and_unknown_roles_fail():
    record = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    assert to_messages(record) == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    with pytest.raises(DraftsmithError, match="'robot'"):
        to_messages({"conversations": [{"from": "robot", "value": "x"}]})


def test_draft_vocab_takes_most_frequent_masked_tokens():
    records = [{"input_ids": [5, 5, 5, 7, 7, 9, 1], "loss_mask": [1, 1, 1, 1, 1, 1, 0]},
               {"input_ids": [9, 2, 2], "loss_mask": [1, 0, 0]}]
    # 5 (3x), 7 (2x), 9 (2x) ... tokens 1 and 2 only appear unmasked
    assert draft_vocab_from_frequencies(records, 12, 3).tolist() == [5, 7, 9]
    assert draft_vocab_from_frequencies(records, 12, 5).tolist() == [0, 1, 5, 7, 9]  # padded with lowest ids


def test_tokenizer_larger_than_target_vocab_is_rejected(tokenizer):
    with pytest.raises(DraftsmithError, match="8192 tokens but the target's vocab_size is 128"):
        check_tokenizer(tokenizer, 128)


def test_mask_prompt_learns_only_the_regenerated_part(tokenizer):
    from datasets import Dataset

    from draftsmith.train.data import tokenize_dataset

    prompt = "def add(a, b):\n    return"
    records = Dataset.from_list([{"text": prompt + " a + b\n", "prompt": prompt}])
    out = tokenize_dataset(records, tokenizer, 64, "text", mask_prompt=True)[0]
    learned = tokenizer.decode([t for t, m in zip(out["input_ids"], out["loss_mask"]) if m])
    assert learned.strip() == "a + b" and out["loss_mask"][0] == 0
    assert all(tokenize_dataset(records, tokenizer, 64, "text")[0]["loss_mask"])  # off: every token
    with pytest.raises(DraftsmithError, match="needs text records with a 'prompt' field"):
        tokenize_dataset(Dataset.from_list([{"text": prompt}]), tokenizer, 64, "text", mask_prompt=True)
