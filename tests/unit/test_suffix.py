"""Suffix decoding: the trees' counts, probabilities and eviction, Arctic Inference's own cache as the oracle
for what is proposed, and lossless serving on the demo model."""

import random

import pytest

from draftsmith.methods.suffix.tree import SuffixTree
from draftsmith.serve import LLM, SamplingParams
from draftsmith.serve.speculation.config import parse_speculative_config
from helpers import CODE_PROMPTS, DEMO_MODEL, Row, spec_config


def test_a_continuation_is_scored_by_counts():
    """In 'a b c a b d a b c', after 'a b' came 'c' twice and 'd' once: the draft is c at 2/3 (counts of the
    suffixes through 'a b c' over those through 'a b'), then what followed 'a b c' (a, 1/2 of it)."""
    a, b, c, d = 1, 2, 3, 4
    tree = SuffixTree(max_depth=8)
    tree.extend(0, [a, b, c, a, b, d, a, b, c])
    matched = tree.match([a, b, c, a, b])  # context ending 'a b'
    assert len(matched) == 4  # 'b', 'a b', 'c a b', 'b c a b' are in the tree ('a b c a b' is the whole context)
    draft = tree.speculate(matched[:2], max_tokens=4, factor=8.0, offset=0.0, min_prob=0.0)
    assert draft.tokens[:2] == [c, a]
    assert draft.probs[:2] == pytest.approx([2 / 3, 2 / 3 * 1 / 2])
    cut = tree.speculate(matched[:2], max_tokens=4, factor=8.0, offset=0.0, min_prob=0.5)
    assert cut.tokens == [c]  # the next one's probability (1/3) is under min_token_prob


def test_the_draft_is_at_most_spec_factor_times_the_match():
    tree = SuffixTree(max_depth=16)
    tree.extend(0, list(range(10)) * 2)
    matched = tree.match(list(range(10)) + [0, 1])
    assert len(tree.speculate(matched[:2], 10, factor=1.0, offset=0.0, min_prob=0.1).tokens) == 2
    assert len(tree.speculate(matched, 10, factor=1.0, offset=0.0, min_prob=0.1).tokens) == 8  # what is left


def test_removing_every_sequence_empties_the_tree():
    tree = SuffixTree(max_depth=5)
    rng = random.Random(0)
    for seq in range(4):
        tree.extend(seq, [rng.randrange(4) for _ in range(30)])
    assert tree.num_nodes > 1
    for seq in (2, 0, 3, 1):
        tree.remove(seq)
    assert tree.num_nodes == 1 and tree.root.count == 0 and not tree.root.children


def _streams(seed: int, n: int, vocab: int = 6):
    """Token streams that repeat themselves: chunks copied from earlier in the stream, with random edits."""
    rng = random.Random(seed)
    out = [rng.randrange(vocab) for _ in range(8)]
    while len(out) < n:
        if rng.random() < 0.7:
            start = rng.randrange(len(out))
            out += out[start : start + rng.randrange(2, 9)]
        else:
            out.append(rng.randrange(vocab))
    return out[:n]


@pytest.mark.parametrize("max_cached", [0, 2, 10000])
def test_proposals_equal_arctic_inference(max_cached):
    """Arctic's SuffixDecodingCache (C++) and the proposer, fed the same requests (prompts, outputs arriving a
    few tokens a step, requests finishing and new ones evicting old outputs), propose the same tokens."""
    arctic = pytest.importorskip("arctic_inference.suffix_decoding",
                                 reason="arctic-inference is not installed (make test installs it)")
    depth, k = 12, 6
    cache = arctic.SuffixDecodingCache(max_tree_depth=depth, max_cached_requests=max_cached)
    config = parse_speculative_config({"method": "suffix", "num_speculative_tokens": k,
                                       "suffix_decoding_max_tree_depth": depth,
                                       "suffix_decoding_max_cached_requests": max_cached})
    proposer = config_proposer(config)
    rng = random.Random(1)
    compared = nonempty = 0
    live: dict[str, tuple[Row, list[int]]] = {}
    for wave in range(5):
        for i in range(2):
            rid = f"w{wave}r{i}"
            stream = _streams(10 * wave + i, 140)
            row = Row(rid, len(live), stream[:40])
            live[rid] = (row, stream[40:])
            cache.start_request(rid, row.prompt_token_ids)
        for _ in range(12):
            for rid, (row, rest) in list(live.items()):
                step = rng.randrange(1, 4)
                new, live[rid] = rest[:step], (row, rest[step:])
                row.output_token_ids += new
                cache.add_active_response(rid, new)
                limit = rng.randrange(1, k + 1)
                ours = proposer.propose([row], [limit])
                context = row.all_token_ids()[-depth:]
                theirs = cache.speculate(rid, context, max_spec_tokens=limit, max_spec_factor=1.0,
                                         min_token_prob=0.1).token_ids
                assert ours.tokens[0, : int(ours.counts[0])].tolist() == list(theirs), (rid, len(row.output_token_ids))
                compared += 1
                nonempty += bool(theirs)
        for rid in list(live)[:2]:  # the oldest two finish
            row, _ = live.pop(rid)
            proposer.release(row)
            cache.stop_request(rid)
        for slot, (row, _) in enumerate(live.values()):
            row.slot = slot
    assert compared > 100 and nonempty > compared // 3  # the streams repeat enough that most steps draft


def config_proposer(config):
    from draftsmith.methods.suffix.proposer import SuffixProposer

    return SuffixProposer(config, None, max_num_seqs=4, max_model_len=512)


def test_without_num_speculative_tokens_the_depth_caps_drafts():
    config = parse_speculative_config({"method": "suffix", "suffix_decoding_max_tree_depth": 16})
    assert config.num_speculative_tokens == 16
    with pytest.raises(Exception, match="suffix_decoding_min_token_prob"):
        parse_speculative_config({"method": "suffix", "suffix_decoding_min_token_prob": 2})


def test_repeated_requests_decode_with_greedy_equality_and_draft_from_earlier_outputs(greedy_reference):
    """The prompts twice, one at a time: the second pass drafts from the first pass's outputs (global tree),
    and both equal plain decoding."""
    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=3, max_model_len=256,
              speculative_config=spec_config("suffix", k=8))
    params = SamplingParams(temperature=0, max_tokens=32)
    first = llm.generate(CODE_PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == greedy_reference
    before = llm.get_metrics()
    second = [llm.generate([p], params, use_tqdm=False)[0] for p in CODE_PROMPTS]
    assert [o.outputs[0].token_ids for o in second] == greedy_reference
    after = llm.get_metrics()
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    assert accepted >= 0.5 * sum(len(t) for t in greedy_reference)  # most tokens come from a draft
    assert after["suffix_cached_requests"] == 8 and after["suffix_cache_bytes"] > 0


def test_a_finished_output_drafts_for_a_later_request_until_forgotten():
    config = parse_speculative_config({"method": "suffix", "num_speculative_tokens": 4})
    proposer = config_proposer(config)
    first = Row("a", 0, [7, 8], [1, 2, 3, 4, 5, 6])
    proposer.propose([first], [4])
    proposer.release(first)
    later = Row("b", 0, [9, 9], [1, 2, 3])  # its own prompt never had 1 2 3: only the global tree knows 4 5 6
    assert proposer.propose([later], [4]).tokens[0, :3].tolist() == [4, 5, 6]
    proposer.release(later)
    proposer.forget()
    again = Row("c", 0, [9, 9], [1, 2, 3])
    assert proposer.propose([again], [4]).counts.tolist() == [0]
    assert proposer.metrics()["suffix_cached_requests"] == 1  # "c" itself


TIE_STREAMS = [[5, 1, 5, 2, 5, 3, 5, 3, 5, 2, 5],  # 2 reaches count 2 after 3 did, but was not first at 1
               [7, 1, 7, 2, 7, 2, 7, 1, 7, 3, 7, 3, 7, 1, 7],
               [4, 4, 1, 4, 2, 4, 1, 4, 2, 4, 3, 4, 3, 4]]


@pytest.mark.parametrize("stream", TIE_STREAMS)
def test_ties_follow_arctics_sibling_order(stream):
    """Children of equal count, ordered as Arctic's sibling lists order them (a rising count goes first only
    if it was first before), in the request's own tokens and in the global tree of earlier outputs."""
    arctic = pytest.importorskip("arctic_inference.suffix_decoding",
                                 reason="arctic-inference is not installed (make test installs it)")
    for limit in (1, 2, 3):
        cache = arctic.SuffixDecodingCache(max_tree_depth=8, max_cached_requests=10)
        proposer = config_proposer(parse_speculative_config(
            {"method": "suffix", "num_speculative_tokens": 3, "suffix_decoding_max_tree_depth": 8,
             "suffix_decoding_min_token_prob": 0.0}))
        earlier = Row("earlier", 0, [99], list(stream))  # its output goes to the global tree
        cache.start_request("earlier", [99])
        cache.add_active_response("earlier", stream)
        proposer.propose([earlier], [1])
        proposer.release(earlier)
        cache.stop_request("earlier")
        for rid, row in (("own", Row("own", 0, list(stream))), ("other", Row("other", 0, [98, stream[-1]]))):
            cache.start_request(rid, row.prompt_token_ids)
            theirs = cache.speculate(rid, row.all_token_ids()[-8:], max_spec_tokens=limit, min_token_prob=0.0).token_ids
            ours = proposer.propose([row], [limit])
            assert ours.tokens[0, : int(ours.counts[0])].tolist() == list(theirs), (rid, limit)
            proposer.release(row)
            cache.stop_request(rid)


def test_a_request_id_used_again_replaces_its_cached_output():
    proposer = config_proposer(parse_speculative_config({"method": "suffix", "num_speculative_tokens": 4}))
    for output in ([1, 2, 3, 4, 5], [6, 7, 8]):
        row = Row("same", 0, [9], output)
        proposer.propose([row], [2])
        proposer.release(row)
    assert proposer.metrics()["suffix_cached_requests"] == 1
    assert proposer.global_tree.num_tokens == 3  # the first output is gone from the tree


def test_the_global_tree_stays_under_its_memory_bound():
    """suffix_decoding_max_cache_mb bounds the trie: past it the oldest outputs are evicted (the running
    request's own stays), and the bound is what the metrics report against."""
    bound = 0.25  # MiB
    proposer = config_proposer(parse_speculative_config({"method": "suffix", "num_speculative_tokens": 4,
                                                         "suffix_decoding_max_cache_mb": bound}))
    rng = random.Random(3)
    for i in range(12):
        row = Row(f"r{i}", 0, [1], [rng.randrange(5000) for _ in range(100)])  # varied: ~24 nodes a token
        proposer.propose([row], [2])
        proposer.release(row)
        assert proposer.metrics()["suffix_cache_bytes"] <= bound * 2**20 + 64 * 200 * 24  # one output's worth over
    assert 1 <= proposer.metrics()["suffix_cached_requests"] < 12


def test_the_server_exports_the_trees_memory():
    """`draftsmith serve` mirrors what the proposer reports of its caches as Prometheus gauges."""
    from draftsmith.serve.openai.metrics import ServerMetrics

    proposer = config_proposer(parse_speculative_config({"method": "suffix", "num_speculative_tokens": 4}))
    row = Row("a", 0, [1, 2], [3, 4, 5, 6])
    proposer.propose([row], [2])
    proposer.release(row)
    metrics = ServerMetrics("demo")
    metrics.observe(0, 0, proposer.metrics())
    text = metrics.render().decode()
    assert f'draftsmith:suffix_cache_bytes{{model_name="demo"}} {float(proposer.metrics()["suffix_cache_bytes"])}' in text
    assert 'draftsmith:suffix_cached_requests{model_name="demo"} 1.0' in text
