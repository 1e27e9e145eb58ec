"""Feature-level draft heads (EAGLE): the target's features, heads in the published layouts, training that
matches serving, resumable training, and the `eagle` drafter's exactness.

CPU unit tests over the tiny random checkpoint (tests/tiny_model.py), except the lossless ones, which serve the real
default model with a random head (acceptance does not matter to exactness; speed is `spind bench`'s)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tiny_model import HIDDEN, LAYERS, write_tiny_checkpoint

from spind.config import ConfigError, from_dict
from spind.drafters.eagle import EagleDrafter, FeatureStore, prime_features
from spind.models.eagle import EagleConfig, EagleHead, HeadKV, default_aux_layers, load_eagle_head, save_eagle_head
from spind.models.llama import load_llama
from spind.models.runner import ForwardItem, ModelRunner
from spind.params import SamplingParams
from spind.train.data import Sequence, TargetFeatures
from spind.train.eagle import Trainer, TrainSettings, acceptance, new_head, pack, unrolled
from spind.drafters.base import DraftInput


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-eagle"))


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_llama(tiny_dir, "float32")


def runner_for(model, blocks: int = 64) -> ModelRunner:
    return ModelRunner(model, blocks, 16, "packed", max_batch=8)


def random_head(target, layers=(0, 1), draft_vocab: int = 40, seed: int = 0) -> EagleHead:
    torch.manual_seed(seed)
    vocab = torch.randperm(target.args.vocab_size)[:draft_vocab].sort().values
    head = new_head(target.args, vocab, layers)
    for p in head.parameters():  # larger than training's init: distinct argmaxes
        torch.nn.init.normal_(p, std=0.3)
    head.bind_target(target.embed_tokens, target.lm_head, 256)
    return head.eval().requires_grad_(False)


# ---- the target's features ----------------------------------------------------------------------------
def test_features_are_transformers_hidden_states(tiny_dir, tiny):
    transformers = pytest.importorskip("transformers")
    ref = transformers.LlamaForCausalLM.from_pretrained(tiny_dir, torch_dtype=torch.float32).eval()
    tokens = [3, 7, 11, 2, 9, 14, 5]
    with torch.no_grad():
        out = ref(torch.tensor([tokens]), output_hidden_states=True)
    runner = runner_for(tiny)
    runner.add_request("r")
    logits, feats = runner.forward_features([ForwardItem("r", tokens, len(tokens))], (0, 1, LAYERS))
    hs = out.hidden_states  # embeddings, after layer 0, ..., the final normed state
    want = torch.cat([hs[0][0], hs[1][0], hs[LAYERS][0]], -1)
    assert feats[0].shape == (len(tokens), 3 * HIDDEN)
    torch.testing.assert_close(feats[0], want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[0], out.logits[0], rtol=1e-4, atol=1e-4)


def test_recording_features_leaves_the_default_targets_logits_bit_identical(cfg, model_dir):
    """The quantized target runs its layers as one fused kernel call; recording features splits the call into
    segments, which must change nothing (greedy speculation compares logits bit for bit)."""
    from spind.config import resolve_dtype

    model = load_llama(model_dir, resolve_dtype(cfg, model_dir, "cpu"), "cpu")
    if model.fused_stack is None:
        pytest.skip("no fused CPU kernels on this machine")
    runner = ModelRunner(model, 32, 16, "invariant", max_batch=2)
    tokens = list(range(100, 140))
    for rid in ("plain", "feat"):
        runner.add_request(rid)
    plain = runner.forward([ForwardItem("plain", tokens, len(tokens))])[0]
    logits, feats = runner.forward_features([ForwardItem("feat", tokens, len(tokens))], (2, 15, 27))
    assert torch.equal(plain, logits[0])
    assert feats[0].shape == (len(tokens), 3 * model.args.hidden_size)
    # and a verify after the prompt sees the same KV
    a = runner.forward([ForwardItem("plain", [5, 6, 7], 3)])[0]
    b = runner.forward_features([ForwardItem("feat", [5, 6, 7], 3)], (27,))[0][0]
    assert torch.equal(a, b)


# ---- heads in the published layouts -------------------------------------------------------------------
def write_eagle3(path: Path, target, draft_vocab: int = 40, hidden: int = HIDDEN, vocab: int | None = None,
                 drop: str = "", d2t_shift: int = 0) -> Path:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    a = target.args
    g = torch.Generator().manual_seed(1)

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    hd = a.head_dim
    t = {"fc.weight": w(hidden, 3 * hidden), "midlayer.hidden_norm.weight": torch.ones(hidden),
         "midlayer.input_layernorm.weight": torch.ones(hidden),
         "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
         "midlayer.self_attn.q_proj.weight": w(a.num_heads * hd, 2 * hidden),
         "midlayer.self_attn.k_proj.weight": w(a.num_kv_heads * hd, 2 * hidden),
         "midlayer.self_attn.v_proj.weight": w(a.num_kv_heads * hd, 2 * hidden),
         "midlayer.self_attn.o_proj.weight": w(hidden, a.num_heads * hd),
         "midlayer.mlp.gate_proj.weight": w(a.intermediate_size, hidden),
         "midlayer.mlp.up_proj.weight": w(a.intermediate_size, hidden),
         "midlayer.mlp.down_proj.weight": w(hidden, a.intermediate_size),
         "norm.weight": torch.ones(hidden), "lm_head.weight": w(draft_vocab, hidden)}
    ids = torch.arange(draft_vocab) + 5  # draft id i is target id i + 5
    t["d2t"] = ids - torch.arange(draft_vocab) + d2t_shift
    t2d = torch.zeros(a.vocab_size, dtype=torch.bool)
    t2d[ids.clamp(max=a.vocab_size - 1)] = True
    t["t2d"] = t2d
    t.pop(drop, None)
    save_file(t, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": a.intermediate_size, "num_hidden_layers": 1, "num_attention_heads": a.num_heads,
        "num_key_value_heads": a.num_kv_heads, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 2048, "vocab_size": vocab or a.vocab_size, "draft_vocab_size": draft_vocab,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 1]}}))
    return path


def write_eagle1(path: Path, target) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    a = target.args
    g = torch.Generator().manual_seed(2)

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    hd, h = a.head_dim, a.hidden_size
    t = {"fc.weight": w(h, 2 * h), "fc.bias": w(h), "embed_tokens.weight": w(a.vocab_size, h),
         "layers.0.self_attn.q_proj.weight": w(a.num_heads * hd, h),
         "layers.0.self_attn.k_proj.weight": w(a.num_kv_heads * hd, h),
         "layers.0.self_attn.v_proj.weight": w(a.num_kv_heads * hd, h),
         "layers.0.self_attn.o_proj.weight": w(h, a.num_heads * hd),
         "layers.0.mlp.gate_proj.weight": w(a.intermediate_size, h),
         "layers.0.mlp.up_proj.weight": w(a.intermediate_size, h),
         "layers.0.mlp.down_proj.weight": w(h, a.intermediate_size),
         "layers.0.post_attention_layernorm.weight": torch.ones(h)}
    torch.save(t, path / "pytorch_model.bin")  # EAGLE-1's published heads are torch .bin files
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": h, "intermediate_size": a.intermediate_size, "num_hidden_layers": 1,
        "num_attention_heads": a.num_heads, "num_key_value_heads": a.num_kv_heads, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 2048, "vocab_size": a.vocab_size}))
    return path


def drafter_over(target, head: EagleHead, name: str = "eagle") -> tuple[EagleDrafter, ModelRunner, FeatureStore]:
    layers = tuple(sorted(set(head.cfg.feature_layers)))
    store = FeatureStore(layers, len(layers) * target.args.hidden_size)
    head.bind_target(target.embed_tokens, target.lm_head, 256)
    runner = runner_for(target)
    return EagleDrafter(name, head, store, 256, target_runner=runner), runner, store


def test_published_layouts_load_and_draft(tmp_path, tiny):
    e3 = load_eagle_head(write_eagle3(tmp_path / "e3", tiny), tiny.args)
    assert e3.cfg.layout == "eagle3" and e3.cfg.feature_layers == (0, 1, 1) and e3.cfg.draft_vocab_size == 40
    assert e3.d2t.tolist() == list(range(5, 45))
    e1 = load_eagle_head(write_eagle1(tmp_path / "e1", tiny), tiny.args)
    assert e1.cfg.layout == "eagle1" and e1.cfg.feature_layers == (LAYERS,) and e1.fc.bias is not None
    for head in (e3, e1):
        drafter, runner, store = drafter_over(tiny, head)
        prompt = [3, 7, 11, 2, 9, 14, 5, 8]
        prime_features(store, runner, "r", prompt[:-1])
        drafter.add_request("r", SamplingParams())
        draft = drafter.propose([DraftInput("r", prompt, 4)])[0]
        assert len(draft.tokens) == 4
        if head.cfg.layout == "eagle3":
            assert all(5 <= t < 45 for t in draft.tokens)  # only ids of its draft vocabulary


def test_the_start_up_profile_times_a_head_on_the_probes_features(tiny):
    from spind.worker.profile import PROBE, probe_prompt, time_draft_tokens

    drafter, _, store = drafter_over(tiny, random_head(tiny))
    ms = time_draft_tokens({"eagle": drafter}, probe_prompt(40, tiny.args.vocab_size), 4, 3)["eagle"]
    assert ms is not None and ms > 0
    assert store.length(PROBE) == 0 and not drafter.probes  # the probe's features are freed with it


@pytest.mark.parametrize("case, message", [
    ({"hidden": 32}, "hidden size 32 is not the target's 64"),
    ({"vocab": 77}, "vocabulary (77) is not the target's"),
    ({"drop": "midlayer.mlp.up_proj.weight"}, "gate_up_proj.weight missing"),
    ({"d2t_shift": 40}, "d2t maps draft ids outside the target's vocabulary"),
])
def test_a_head_that_does_not_fit_is_a_clear_error(tmp_path, tiny, case, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_eagle_head(write_eagle3(tmp_path / "bad", tiny, **case), tiny.args)


def test_not_a_head_is_a_clear_error(tmp_path, tiny, tiny_dir):
    with pytest.raises(ValueError, match="not an EAGLE head: no fc.weight"):
        load_eagle_head(tiny_dir, tiny.args)  # a whole model is not a head
    with pytest.raises(ValueError, match="no config.json"):
        load_eagle_head(tmp_path, tiny.args)


def test_saved_head_loads_back_the_same(tmp_path, tiny):
    head = random_head(tiny)
    save_eagle_head(head, tmp_path / "h", torch.float32)
    back = load_eagle_head(tmp_path / "h", tiny.args)
    assert back.cfg.feature_layers == head.cfg.feature_layers and torch.equal(back.d2t, head.d2t)
    for (name, a), (_, b) in zip(head.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name


def test_an_int8_head_loads_back_within_its_rounding(tmp_path, tiny):
    head = random_head(tiny)
    save_eagle_head(head, tmp_path / "h8", torch.int8)
    back = load_eagle_head(tmp_path / "h8", tiny.args)
    assert torch.equal(back.d2t, head.d2t)
    for (name, a), (_, b) in zip(head.state_dict().items(), back.state_dict().items()):
        if a.dim() == 2:  # per-row int8: within half a step of the row's largest weight / 127
            assert float((a - b).abs().amax(1).div(a.abs().amax(1)).max()) <= 0.5 / 127 + 1e-3, name


def test_config_checks_eagle_entries():
    with pytest.raises(ConfigError, match="needs path"):
        from_dict({"drafters": [{"name": "e", "kind": "eagle", "worker": "target"}]})
    with pytest.raises(ConfigError, match="runs on the target's worker"):
        from_dict({"drafters": [{"name": "e", "kind": "eagle", "path": "x", "worker": "draft"}]})


# ---- training composes the same layer as serving ------------------------------------------------------
def answered(prompt: list[int], answer: list[int], key: str = "s") -> Sequence:
    return Sequence(key, prompt, answer, False)


def test_training_forward_is_what_serving_computes(tiny):
    """The unrolled training forward (teacher-forced step 0, the head's own argmax chain after) gives, at every
    position, the draft the serving drafter proposes there: same entries, positions and attention."""
    head = random_head(tiny, layers=(1, LAYERS))
    other = answered([6, 6, 1], [13, 2, 40, 3])
    seq = answered([3, 7, 11, 2], [9, 14, 5, 8, 21, 30, 12, 4, 17], "t")
    runner = runner_for(tiny)
    feats = TargetFeatures(runner, head.cfg.feature_layers)
    p = pack([other, seq], feats.get([other, seq]))  # packed after another sequence, as training packs them
    with torch.no_grad():
        steps = unrolled(head, p, 3, greedy=True)
    drafter, runner, store = drafter_over(tiny, head)
    for n in range(2, len(seq.tokens) - 1):  # the head drafts after committed tokens 0..n
        tokens = seq.tokens[:n + 1]
        prime_features(store, runner, f"r{n}", tokens[:-1])
        drafter.add_request(f"r{n}", SamplingParams())
        draft = drafter.propose([DraftInput(f"r{n}", tokens, 3)])[0].tokens
        row = len(other.tokens) + n - 1  # unrolled row r is entry r + 1 of the packed stream
        want = [int(head.to_target_ids(logits[row].argmax())) for logits, _ in steps]
        assert draft == want, n


def test_serving_rolls_back_its_own_entries(tiny):
    """After a verify the head's draft entries are replaced by entries over the target's features: drafting from
    a grown sequence in one go or slot by slot (with rejected drafts in between) proposes the same."""
    head = random_head(tiny, layers=(0, LAYERS))
    tokens = [3, 7, 11, 2, 9, 14, 5, 8, 21, 30, 12]
    drafter, runner, store = drafter_over(tiny, head)
    prime_features(store, runner, "a", tokens)
    prime_features(store, runner, "b", tokens)
    drafter.add_request("a", SamplingParams())
    drafter.add_request("b", SamplingParams())
    for n in (4, 6, 7, 10):  # slot by slot: each call drafts 4 and the "verify" keeps what it keeps
        drafter.propose([DraftInput("a", tokens[:n + 1], 4)])
    one_go = drafter.propose([DraftInput("b", tokens, 4)])[0].tokens
    assert drafter.propose([DraftInput("a", tokens, 4)])[0].tokens == one_go


def test_training_lowers_the_loss_and_resumes_exactly(tmp_path, tiny):
    seqs = [answered([3, 7, 11, 2 + i], [9, 14, 5, 8, 21, 30, 12, 4, 17, 9, 14, 5][i % 3:], f"s{i}")
            for i in range(12)]
    layers = (0, 1, LAYERS)

    def trainer(out: Path, steps: int) -> Trainer:
        torch.manual_seed(0)
        head = new_head(tiny.args, torch.arange(tiny.args.vocab_size), layers)
        head.bind_target(tiny.embed_tokens, tiny.lm_head, 256)
        s = TrainSettings(steps=steps, lr=3e-3, warmup=2, tokens_per_step=64, unroll=3, save_every=3,
                          eval_every=1000)
        return Trainer(head, seqs, TargetFeatures(runner_for(tiny), layers), out, s, log=lambda m: None)

    straight = trainer(tmp_path / "a", 8)
    first = float(straight.loss(seqs[:4])[0])
    straight.run()
    assert float(straight.loss(seqs[:4])[0]) < 0.7 * first
    interrupted = trainer(tmp_path / "b", 8)
    interrupted.s.steps = 3
    interrupted.run()  # stops at step 3, checkpointed
    resumed = trainer(tmp_path / "b", 8)
    assert resumed.resume() and resumed.step == 3
    resumed.run()
    for (name, a), (_, b) in zip(straight.head.state_dict().items(), resumed.head.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)
    acc = acceptance(resumed.head, seqs[:4], TargetFeatures(runner_for(tiny), layers), 3)
    assert len(acc) == 3 and 1 >= acc[0] >= acc[1] >= acc[2] >= 0


# ---- the eagle drafter through the engine: exact at every k ---------------------------------------------
TINY_PROMPTS = [[3, 5, 7, 9, 3, 5, 7], [11, 13, 2, 8], [21, 22, 23, 24, 25, 26], [30, 4, 30, 4, 19]]


@pytest.fixture(scope="module")
def tiny_trained_head(tiny_dir, tiny, tmp_path_factory) -> Path:
    """A head trained on the tiny target's own greedy answers to TINY_PROMPTS (it memorises them: enough for its
    drafts to be accepted, which is what exercises the accepted-draft paths)."""
    from spind.train.data import greedy_answers

    runner = runner_for(tiny)
    answers = greedy_answers(runner, TINY_PROMPTS, 40, set())
    seqs = [answered(p, a, f"t{i}") for i, (p, a) in enumerate(zip(TINY_PROMPTS, answers))]
    layers = (0, 1, LAYERS)
    torch.manual_seed(0)
    head = new_head(tiny.args, torch.arange(tiny.args.vocab_size), layers)
    head.bind_target(tiny.embed_tokens, tiny.lm_head, 256)
    settings = TrainSettings(steps=150, lr=1e-2, warmup=5, tokens_per_step=200, unroll=3, save_every=10 ** 6,
                             eval_every=10 ** 6)
    trainer = Trainer(head, seqs, TargetFeatures(runner, layers), tmp_path_factory.mktemp("ckpt"), settings,
                      log=lambda m: None)
    trainer.run()
    assert acceptance(head, seqs, TargetFeatures(runner_for(tiny), layers), 3)[0] > 0.5
    out = tmp_path_factory.mktemp("head")
    save_eagle_head(head, out, torch.float32)
    return out


def test_eagle_drafts_through_the_engine_exactly_at_every_k(tiny_dir, tiny_trained_head, tmp_path):
    from spind.coordinator.transport.local import GenRequest, LocalEngine

    cfg = from_dict({
        "model": {"target": str(tiny_dir), "dtype": "float32", "max_model_len": 128, "cache_dir": str(tmp_path)},
        "runtime": {"attention": "packed", "kv_block_size": 16, "max_batch_size": 8, "profile": "off"},
        "speculation": {"k": 4}, "selection": {"policy": "lbss", "k_set": [2, 4]},
        "drafters": [{"name": "eagle", "kind": "eagle", "path": str(tiny_trained_head), "worker": "target"}],
        "workers": [{"name": "target", "device": "cpu"}]})
    engine = LocalEngine.load(cfg)
    try:
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        plain = engine.generate([GenRequest(f"p{i}", p, params) for i, p in enumerate(TINY_PROMPTS)])
        for k in (1, 4, 8):
            got = engine.generate([GenRequest(f"e{k}-{i}", p, params, "eagle", k) for i, p in enumerate(TINY_PROMPTS)],
                                  max_batch=len(TINY_PROMPTS))
            assert [r.token_ids for r in got] == [r.token_ids for r in plain], k
            assert sum(r.num_accepted for r in got) > sum(r.num_drafted for r in got) / 2, k
        # sampled: each request's stream is seeded, so a rerun is the same, and drafts are still accepted
        sampled = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.7, seed=3)
        runs = [engine.generate([GenRequest(f"s{r}-{i}", p, sampled, "eagle", 4) for i, p in enumerate(TINY_PROMPTS)])
                for r in range(2)]
        assert [x.token_ids for x in runs[0]] == [x.token_ids for x in runs[1]]
        assert sum(x.num_accepted for x in runs[0]) > 0
    finally:
        engine.close()


def test_the_shipped_head_and_suffix_over_the_default_target_are_lossless(cfg, model_dir, prompt_ids):
    """The real default model (its fused 4-bit kernels recording features in segments) with the head shipped for it
    (path = "default") and the suffix drafter, in one batch of prompts from 4 to ~290 tokens: greedy output is plain
    decoding's at k = 1, 4 and 8, and the head's drafts are accepted (it is trained on this target)."""
    import dataclasses

    from spind.config import DrafterConfig
    from spind.coordinator.transport.local import GenRequest, LocalEngine

    drafters = (DrafterConfig(name="eagle", kind="eagle", path="default", worker="target"),
                DrafterConfig(name="suffix", kind="suffix", worker="target"))
    engine = LocalEngine.load(dataclasses.replace(cfg, drafters=drafters))
    try:
        params = [SamplingParams(max_tokens=20 + 4 * (i % 3), ignore_eos=i % 2 == 1) for i in range(len(prompt_ids))]
        reqs = [GenRequest(f"p{i}", p, q) for i, (p, q) in enumerate(zip(prompt_ids, params))]
        runs = [(d, k) for d in ("eagle", "suffix") for k in (1, 4, 8)]
        for d, k in runs:
            reqs += [GenRequest(f"{d}{k}-{i}", p, q, d, k) for i, (p, q) in enumerate(zip(prompt_ids, params))]
        out = engine.generate(reqs, max_batch=len(reqs))
        n = len(prompt_ids)
        plain = [r.token_ids for r in out[:n]]
        for j, (d, k) in enumerate(runs, 1):
            got = out[j * n:(j + 1) * n]
            assert [r.token_ids for r in got] == plain, (d, k)
            assert sum(r.num_accepted for r in got) > 0, (d, k)
    finally:
        engine.close()


def test_the_shipped_head_fits_the_default_model(model_dir):
    """The head committed for the default model: one file under 10 MB, its model card beside it, and it loads onto
    the default target's shape."""
    from spind.drafters import DEFAULT_HEAD_DIR
    from spind.models.layers import LlamaArgs

    weights = DEFAULT_HEAD_DIR / "model.safetensors"
    assert weights.stat().st_size <= 10_000_000
    assert "## Measured acceptance" in (DEFAULT_HEAD_DIR / "MODEL_CARD.md").read_text()
    args = LlamaArgs.from_hf(json.loads((model_dir / "config.json").read_text()))
    head = load_eagle_head(DEFAULT_HEAD_DIR, args)
    assert head.eagle3 and head.cfg.feature_layers == default_aux_layers(args.num_layers)
    assert len(set(head.d2t.tolist())) == head.cfg.draft_vocab_size and int(head.d2t.max()) < args.vocab_size


def test_bench_acceptance_by_position_is_the_trainers(tiny, tiny_trained_head):
    """`spind bench drafters`' per-position acceptance (the served drafter proposing from every point of the
    target's own output) and the trainer's (one unrolled forward) measure the same thing: position 1 agrees."""
    from spind.bench.drafters import acceptance_by_position
    from spind.train.data import greedy_answers

    head = load_eagle_head(tiny_trained_head, tiny.args)
    drafter, runner, _ = drafter_over(tiny, head)
    prompts = [[3, 5, 7, 9, 3, 5, 7], [7, 7, 8, 1, 2]]  # one trained on, one not
    outs = greedy_answers(runner, prompts, 30, set())
    bench = acceptance_by_position(drafter, list(zip(prompts, outs)), 3)
    trainer = acceptance(head, [answered(p, o, f"x{i}") for i, (p, o) in enumerate(zip(prompts, outs))],
                         TargetFeatures(runner, head.cfg.feature_layers), 3)
    assert bench["num_chains"] == sum(len(o) - 1 for o in outs)
    assert bench["by_position"][0] == pytest.approx(trainer[0], abs=1e-9)
    assert 0 < bench["by_position"][0] <= 1 and bench["tau"] == pytest.approx(1 + sum(bench["by_position"]))


def test_train_drafter_command_writes_a_head_and_resumes(tiny_dir, tiny, tmp_path, capsys):
    from spind.cli import main

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([f"t{i} t{i + 1} t{i + 2}" for i in range(3, 30)]))
    args = ["train-drafter", "--model", str(tiny_dir), "--dtype", "float32", "--out", str(tmp_path / "work"),
            "--prompts", str(prompts), "--max-tokens", "12", "--draft-vocab", "24", "--tokens-per-step", "64",
            "--save-every", "2", "--threads", "1"]
    assert main([*args, "--steps", "2"]) == 0
    first = capsys.readouterr()
    assert 'kind = "eagle"' in first.out and "generate: 27/27 prompts" in first.err
    head = load_eagle_head(tmp_path / "work" / "head", tiny.args)
    assert head.cfg.draft_vocab_size == 24 and head.cfg.layout == "eagle3"
    assert main([*args, "--steps", "4"]) == 0  # the same command, further: nothing regenerated, training resumed
    second = capsys.readouterr().err
    assert "generate:" not in second and "resumed from ckpt-0000002.pt (step 2)" in second
    assert "step 4/4" in second and "step 1/4" not in second
    report = json.loads((tmp_path / "work" / "head" / "training.json").read_text())
    assert report["steps"] == 4 and report["draft_vocab"] == 24


def test_train_drafter_refuses_bad_arguments(tmp_path, capsys):
    from spind.cli import main

    assert main(["train-drafter", "--out", str(tmp_path), "--steps", "0"]) == 2
    assert "--steps must be >= 1" in capsys.readouterr().err
    assert main(["train-drafter", "--out", str(tmp_path), "--datasets-dir", str(tmp_path / "none")]) == 2
    assert "datasets folder not found" in capsys.readouterr().err
