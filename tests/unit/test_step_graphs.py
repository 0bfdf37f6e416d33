"""Static-shape decode, verify and draft steps (serve.engine.step_graphs): the padded static forward computes what the
eager forward computes, torch.compile traces it (and a draft head's step) whole (fullgraph) and decodes
greedily what eager decodes, plain and speculative; static draft steps draft what eager ones draft. The tests
marked `cuda` run their static steps as the engine does on a GPU where there is one (captured CUDA graphs),
else in mode compile with the untraced function standing in for the compiled one."""

import pytest
import torch

from draftsmith.errors import DraftsmithError
from draftsmith.models.kv_cache import ForwardBatch
from draftsmith.models.loader import load_target
from draftsmith.serve import LLM, SamplingParams
from draftsmith.serve.engine.step_graphs import (
    DraftStepRunner,
    StepRunner,
    compile_step,
    resolve_step_mode,
    row_buckets,
    static_draft_step,
    static_forward,
)
from helpers import (
    CODE_PROMPTS,
    DEMO_MODEL,
    KERNEL_DEVICE,
    make_tiny_checkpoint,
    model_device,
    slot_kernel_or_skip,
    spec_config,
)

EAGLE3_HEAD = DEMO_MODEL.parent / "demo-code-7m-eagle3"
# the mode a `cuda` test's static steps run in: the engine's own on CUDA; on CPU compile, untraced (`_static`)
STATIC_MODE = "cuda-graph" if KERNEL_DEVICE == "cuda" else "compile"


def _static(runner):
    """`runner` ready to step: in mode compile, its function untraced stands in for torch.compile's (what
    compile and capture start from: tracing is the compile tests' business); a CUDA graph runner as it is."""
    if runner.mode == "compile":
        runner._compiled = runner.fn
    return runner


def _prefilled(model, lengths, slots, num_slots=6, max_len=96, seed=0):
    """A cache whose `slots` hold prompts of `lengths` random tokens (eager prefill)."""
    cache = model.make_cache(num_slots, max_len)
    generator = torch.Generator().manual_seed(seed)
    for slot, n in zip(slots, lengths):
        ids = torch.randint(model.config.vocab_size, (1, n), generator=generator).to(model_device(model))
        batch = ForwardBatch.build([slot], [0], [n], cache, model.config.sliding_window, model_device(model))
        with torch.inference_mode():
            model(ids, cache=cache, batch=batch, compute_logits=False)
    return cache


def _step_inputs(model, slots, starts, q_lens, width, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(model.config.vocab_size, (len(slots), width), generator=generator).to(model_device(model))


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["llama", "mistral-window"])
def test_static_forward_computes_what_the_eager_forward_does(tmp_path, family, monkeypatch):
    """Rows of unequal queries (a verify of 0, 3 and 1 drafts) in scattered slots, padded to a bucket of 4
    rows: every real query's logits and hidden states equal the eager forward's, the real keys and values
    land where eager puts them, and nothing outside the rows' new positions changes (padding writes go to
    the scratch slot). The sliding-window family checks the window in the static mask (PyTorch's attention:
    test_slot_kernel_static_forward_under_the_interpreter runs the kernel's)."""
    monkeypatch.setenv("DRAFTSMITH_ATTENTION", "torch")
    make_tiny_checkpoint(family, tmp_path / family)
    model = load_target(tmp_path / family, dtype="float32", device=KERNEL_DEVICE)
    slots, starts, q_lens, width = [4, 0, 2], [30, 7, 19], [1, 4, 2], 4
    eager_cache = _prefilled(model, starts, slots)
    static_cache = _prefilled(model, starts, slots)
    ids = _step_inputs(model, slots, starts, q_lens, width)
    batch = ForwardBatch.build(slots, starts, q_lens, eager_cache, model.config.sliding_window, KERNEL_DEVICE,
                               pack=True)
    with torch.inference_mode():
        want = model(ids, cache=eager_cache, batch=batch, feature_layers=(1, 3))
    runner = _static(StepRunner(model, static_cache, max_rows=6, feature_layers=(1, 3), mode=STATIC_MODE))
    got = runner.forward(ids, slots, starts, q_lens)
    assert got.logits.shape == (3, width, model.config.vocab_size)
    for row, n in enumerate(q_lens):
        torch.testing.assert_close(got.logits[row, :n], want.logits[row, :n], rtol=1e-5, atol=1e-5)
        for layer in (1, 3):
            torch.testing.assert_close(got.hidden_states[layer][row, :n], want.hidden_states[layer][row, :n],
                                       rtol=1e-5, atol=1e-5)
    for eager_layer, static_layer in zip(eager_cache.k + eager_cache.v, static_cache.k + static_cache.v):
        live = slice(0, eager_cache.num_slots)  # the scratch slot differs: padding wrote there
        torch.testing.assert_close(static_layer[live], eager_layer[live], rtol=1e-5, atol=1e-6)


def test_row_buckets_and_modes():
    assert row_buckets(1) == [1] and row_buckets(6) == [1, 2, 4, 6] and row_buckets(8) == [1, 2, 4, 8]
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_step_mode("auto", False, cpu) == "eager" and resolve_step_mode("auto", False, cuda) == "cuda-graph"
    assert resolve_step_mode("auto", True, cuda) == "eager" and resolve_step_mode("compile", False, cpu) == "compile"
    with pytest.raises(DraftsmithError, match="needs a CUDA device"):
        resolve_step_mode("cuda-graph", False, cpu)
    with pytest.raises(DraftsmithError, match="cannot be combined"):
        resolve_step_mode("compile", True, cpu)
    with pytest.raises(DraftsmithError, match="one of auto, eager"):
        resolve_step_mode("graphs", False, cpu)


def _compiled_llm(target, backend, **kwargs):
    """An engine whose decode and verify steps run torch.compile(fullgraph=True) with `backend`; -> the LLM
    and the list its runner's forwards are counted in."""
    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=3, max_model_len=256, target=target,
              **kwargs)
    engine = llm.engine
    runner = StepRunner(engine.model, engine.cache, 3, engine.feature_layers, "compile")
    runner._compiled = compile_step(static_forward, backend)
    calls, forward = [], runner.forward
    runner.forward = lambda *a: calls.append(a[0].shape) or forward(*a)
    engine.steps = runner
    if engine.proposer is not None:  # and the head's draft steps, in the same backend
        drafts = engine.proposer.use_static_steps(lambda head, cache: DraftStepRunner(head, cache, 3, "compile"))
        drafts._compiled = compile_step(static_draft_step, backend)
        step = drafts.step
        drafts.step = lambda *a: calls.append("draft") or step(*a)
    return llm, calls


@pytest.mark.slow
@pytest.mark.parametrize("speculation", [None, spec_config("eagle3", EAGLE3_HEAD, 4)])
def test_compiled_steps_decode_what_eager_decodes(target, greedy_reference, speculation):
    """The whole step traced as one graph (a break would raise under fullgraph=True), over a mixed batch
    whose rows join and leave (3 slots for 4 prompts) and, speculating, verify unequal numbers of drafts:
    greedy token ids equal the eager engine's. AOT-eager backend: Dynamo and AOTAutograd trace exactly as
    for Inductor, without its C++ compile."""
    torch._dynamo.reset()
    llm, calls = _compiled_llm(target, "aot_eager", speculative_config=speculation)
    outputs = llm.generate(CODE_PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == greedy_reference
    shapes = [c for c in calls if c != "draft"]
    assert {shape[0] for shape in shapes} >= {1, 3}
    if speculation is not None:
        assert max(shape[1] for shape in shapes) > 1 and llm.get_metrics()["num_accepted_tokens"] > 0
        assert "draft" in calls


def _count_rows(runner, rows: list) -> None:
    """Appends the real rows of each of the runner's draft steps to `rows`."""
    step = runner.step
    runner.step = lambda *a: rows.append(a[0].shape[0]) or step(*a)


def _record_confidence(proposer) -> list:
    """A list that receives each propose's running draft probabilities [rows, k]."""
    seen, propose = [], proposer.propose

    def recording(*args, **kwargs):
        out = propose(*args, **kwargs)
        seen.append(proposer.last_confidence.clone())
        return out

    proposer.propose = recording
    return seen


# longer than the head's pending ring (64 positions): its context starts mid-prompt, so draft steps read keys
# from a first key of their own (key_starts)
LONG_PROMPT = "def walk(tree):\n" + "".join(f"    visit(tree.child_{i})\n" for i in range(24)) + "    ret"


@pytest.mark.slow
@pytest.mark.cuda
@pytest.mark.parametrize("kernel", [False, True])
def test_static_draft_steps_draft_what_eager_steps_draft(kernel_target, monkeypatch, kernel):
    """EAGLE-3 drafts 2..4 through DraftStepRunner's static step (rows padded to a bucket, positions moved
    on in the buffer, a long prompt whose head context starts mid-sequence): the same drafts as eager steps,
    so the same tokens accepted out of as many drafted, and the same greedy output. With `kernel`, the step
    attends through the Triton slot kernel (interpreter on CPU) with each row's first key; every other
    forward, eager, through PyTorch's attention."""
    if kernel:
        slot_kernel_or_skip()
    monkeypatch.setenv("DRAFTSMITH_ATTENTION", "torch")
    prompts = [LONG_PROMPT, *CODE_PROMPTS[:2]]
    # a float32 head: bfloat16 matmuls round differently with the number of keys read
    spec = spec_config("eagle3", EAGLE3_HEAD, 4, draft_dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=24)
    runs = []
    for static in (False, True):
        # buckets of 1, 2, 4 and 5 rows: three rows run padded to four
        llm = LLM(DEMO_MODEL, dtype="float32", device=KERNEL_DEVICE, max_num_seqs=5, max_model_len=256,
                  target=kernel_target, enforce_eager=True, speculative_config=spec)
        proposer, steps = llm.engine.proposer, []
        if static:
            runner = proposer.use_static_steps(lambda head, cache: _static(DraftStepRunner(head, cache, 5, STATIC_MODE)))
            runner.slot_kernel = kernel
            _count_rows(runner, steps)
        confidences = _record_confidence(proposer)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        metrics = llm.get_metrics()
        runs.append(([o.outputs[0].token_ids for o in outputs], metrics["num_draft_tokens"],
                     metrics["num_accepted_tokens"], confidences))
        assert not static or (steps and max(steps) == 3), "the static steps did not run"
        if not static:
            assert max(proposer.pending.context_start) > 0, "no row's head context started mid-prompt"
    assert runs[1][:3] == runs[0][:3]
    # the drafts' probabilities, not only their argmax: a key read or missed shifts them
    assert len(runs[1][3]) == len(runs[0][3])
    for static, eager in zip(runs[1][3], runs[0][3]):
        torch.testing.assert_close(static, eager, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_inductor_compiles_a_step(target):
    """Inductor itself (C++ kernels on CPU) on one verify bucket of the demo model: the logits equal the
    eager static forward's."""
    torch._dynamo.reset()
    slots, starts, q_lens = [1, 0, 3], [12, 40, 5], [3, 1, 2]
    cache = _prefilled(target, starts, slots, num_slots=4, max_len=128)
    ids = _step_inputs(target, slots, starts, q_lens, 3)
    runner = StepRunner(target, cache, max_rows=4, feature_layers=(2,), mode="compile")
    got = runner.forward(ids, slots, starts, q_lens)
    runner._compiled = static_forward
    want = runner.forward(ids, slots, starts, q_lens)  # the same writes again: same keys, same places
    for row, n in enumerate(q_lens):
        torch.testing.assert_close(got.logits[row, :n], want.logits[row, :n], rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
def test_slot_kernel_static_forward_under_the_interpreter(monkeypatch, tmp_path):
    """What a captured CUDA graph runs (on a GPU, captured and replayed): the static forward through the Triton
    slot kernel, every row reading the whole cache's length bound by its own key count, equals the eager
    forward through PyTorch's attention."""
    slot_kernel_or_skip()
    monkeypatch.setenv("DRAFTSMITH_ATTENTION", "torch")
    make_tiny_checkpoint("llama", tmp_path / "llama")
    model = load_target(tmp_path / "llama", dtype="float32", device=KERNEL_DEVICE)
    slots, starts, q_lens = [3, 1], [21, 50], [2, 3]
    eager_cache, static_cache = _prefilled(model, starts, slots), _prefilled(model, starts, slots)
    ids = _step_inputs(model, slots, starts, q_lens, 3)
    batch = ForwardBatch.build(slots, starts, q_lens, eager_cache, device=KERNEL_DEVICE, pack=True)
    with torch.inference_mode():
        want = model(ids, cache=eager_cache, batch=batch)
    monkeypatch.setenv("DRAFTSMITH_ATTENTION", "triton")
    runner = _static(StepRunner(model, static_cache, max_rows=4, feature_layers=(), mode=STATIC_MODE))
    assert runner.slot_kernel
    got = runner.forward(ids, slots, starts, q_lens)
    for row, n in enumerate(q_lens):
        torch.testing.assert_close(got.logits[row, :n], want.logits[row, :n], rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (none on this machine)")
def test_cuda_graph_steps_decode_what_eager_decodes():
    prompts, params = CODE_PROMPTS, SamplingParams(temperature=0, max_tokens=32)
    eager = LLM(DEMO_MODEL, dtype="float32", device="cuda", max_num_seqs=4, enforce_eager=True)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    for speculation in (None, {"method": "eagle3", "model": str(EAGLE3_HEAD), "num_speculative_tokens": 4}):
        llm = LLM(DEMO_MODEL, dtype="float32", device="cuda", max_num_seqs=4, target=eager.model,
                  speculative_config=speculation)
        assert llm.engine.step_mode == "cuda-graph"
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want


def test_engine_flags_reach_the_engine(tmp_path, capsys):
    """--enforce-eager and --step-mode go from every engine command to LLM; a mode the device cannot run is
    one line on stderr, exit status 2."""
    from draftsmith.cli import build_parser, main
    from draftsmith.serve.apps.llm import engine_kwargs

    args = build_parser().parse_args(["serve", str(DEMO_MODEL), "--enforce-eager"])
    assert engine_kwargs(args)["enforce_eager"] is True and engine_kwargs(args)["step_mode"] == "auto"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def f("}\n')
    command = ["generate", "--model", str(DEMO_MODEL), "--prompts", str(prompts), "--output", str(tmp_path / "out.jsonl"),
               "--max-tokens", "2", "--temperature", "0", "--device", "cpu"]
    if not torch.cuda.is_available():
        assert main(command + ["--step-mode", "cuda-graph"]) == 2
        assert "step mode cuda-graph needs a CUDA device" in capsys.readouterr().err
    assert main(command + ["--step-mode", "compile", "--enforce-eager"]) == 2
    assert "cannot be combined with step mode 'compile'" in capsys.readouterr().err


def _counting_backend(graphs: list):
    """A torch.compile backend that keeps each graph Dynamo hands it and runs it as traced (no Inductor)."""
    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    return backend


@pytest.mark.parametrize("attention", ["torch", "cpp"])
def test_warm_up_leaves_key_counts_to_one_graph_per_bucket(target, monkeypatch, attention):
    """In mode compile, the warm-up runs its first bucket at two key counts, so Dynamo traces the count as a
    symbol from then on, and every bucket at 2 keys or more, for Dynamo specialises a count of 1: a step whose
    context is longer than the warm-up's, up to the cache's length, in any row bucket, runs the graph compiled
    at start-up instead of compiling another (10-20 s each on two cores, met while serving). Counted through
    AOTAutograd, as Inductor runs: its guards (on shapes and strides) recompile too. PyTorch's attention reads
    the keys up to the count; the C++ kernel reads each row's kv_lens, its graphs the cache's whole length."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from draftsmith.models.slot_attention_cpu import build_error

    if attention == "cpp" and build_error() is not None:
        pytest.skip(f"the CPU attention kernel did not build: {build_error()}")
    monkeypatch.setenv("DRAFTSMITH_ATTENTION", attention)
    torch._dynamo.reset()
    cache = _prefilled(target, [700, 700], [0, 1], num_slots=3, max_len=1024)
    runner = StepRunner(target, cache, max_rows=2, feature_layers=(), mode="compile")
    counter = CompileCounterWithBackend("aot_eager")
    runner._compiled = compile_step(static_forward, counter)
    assert runner.warm_up([1, 2]) == 4
    warmed = counter.frame_count
    # width 1 at two key counts (the second symbolic), then one graph for each other (rows, width)
    assert warmed <= 5
    # key counts far past the warm-up's, up to the cache's whole length (a request at max_model_len)
    for rows in (1, 2):
        for start, width in ((300, 2), (300, 1), (700, 2), (700, 1), (1022, 2), (1023, 1)):
            slots, starts, widths = list(range(rows)), [start] * rows, [width] * rows
            runner.forward(_step_inputs(target, slots, starts, widths, width), slots, starts, widths)
    assert counter.frame_count == warmed


def _tiny_llama(directory, seed: int):
    import transformers

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    return load_target(directory, dtype=torch.float32, device="cpu")


def test_runners_of_two_models_keep_their_own_graphs(tmp_path):
    """Compiled steps check no guard on the model (`compile_step`), so each runner keeps its graphs apart: a
    second model of the same shapes, compiled by the same backend, compiles a graph of its own (a graph holds
    its model's constants, such as the norms' epsilon, which no guard checks any more), and each computes what
    its eager step does."""
    torch._dynamo.reset()
    slots, starts, q_lens = [0, 1], [20, 9], [1, 1]
    graphs = []
    backend = _counting_backend(graphs)
    for seed in (0, 1):
        model = _tiny_llama(tmp_path / str(seed), seed)
        cache = _prefilled(model, starts, slots, num_slots=2, max_len=64)
        ids = _step_inputs(model, slots, starts, q_lens, 1)
        runner = StepRunner(model, cache, max_rows=2, feature_layers=(), mode="compile")
        runner._compiled = compile_step(static_forward, backend)
        compiled = runner.forward(ids, slots, starts, q_lens).logits
        runner._compiled = static_forward
        torch.testing.assert_close(compiled, runner.forward(ids, slots, starts, q_lens).logits, rtol=1e-4,
                                   atol=1e-4)
    assert len(graphs) == 2
