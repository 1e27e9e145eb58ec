"""A completion prompt gets BOS exactly where the model's own tokenizer adds it (AutoTokenizer(dir)(text)): where
tokenizer.json's post-processor template puts it; transformers 5 drops tokenizer_config.json's add_bos_token and
add_eos_token when a tokenizer.json exists. Tiny tokenizers built here with `tokenizers`, and a LLaMA-class one saved
by transformers itself (LLaMA-2's shape); nothing downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spind.tokenizer import Tokenizer

WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "<s>"]  # "<s>" in a text is text, never BOS
TEXT = "the cat sat on the mat"
BOS_TEMPLATE = ("<s> $A", "<s> $A <s> $B")  # LLaMA-3's shape: the template adds BOS
BOS_EOS_TEMPLATE = ("<s> $A </s>", "<s> $A </s> <s> $B </s>")


def make_tokenizer(path: Path, template: tuple[str, str] | None, byte_level: bool = False, **flags) -> Path:
    from tokenizers import Tokenizer as Tk
    from tokenizers import models, pre_tokenizers, processors

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS[:-1])}}
    tk = Tk(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.add_special_tokens(["<unk>", "<s>", "</s>"])
    if template is not None:
        post = processors.TemplateProcessing(single=template[0], pair=template[1],
                                             special_tokens=[("<s>", 1), ("</s>", 2)])
        tk.post_processor = processors.Sequence([processors.ByteLevel(trim_offsets=False), post]) if byte_level \
            else post
    path.mkdir()
    tk.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        **flags}))
    return path


CASES = {  # name -> (template, byte-level post-processor, tokenizer_config flags, BOS expected)
    "template-bos": (BOS_TEMPLATE, False, {}, True),
    "template-bos-in-a-sequence": (BOS_TEMPLATE, True, {}, True),
    "template-bos-and-eos": (BOS_EOS_TEMPLATE, False, {}, True),
    "no-special-tokens": (None, False, {}, False),  # SmolLM2's and Qwen2's shape
    # the flags are dropped: tokenizer.json decides
    "template-bos-flag-off": (BOS_TEMPLATE, False, {"add_bos_token": False}, True),
    "no-template-flag-on": (None, False, {"add_bos_token": True, "add_eos_token": True}, False),
}


def check_like_transformers(path: Path, bos: bool) -> None:
    from transformers import AutoTokenizer

    ours, theirs = Tokenizer(path), AutoTokenizer.from_pretrained(path)
    for text in (TEXT, "a <s> dog"):
        want = theirs(text).input_ids
        if want[-1] == 2:  # a prompt to continue never ends in EOS
            want = want[:-1]
        assert ours.encode_prompt(text) == want
        assert (ours.encode_prompt(text)[:1] == [1]) == bos
        assert ours.encode(text) == theirs(text, add_special_tokens=False).input_ids  # encode itself never adds any


@pytest.mark.parametrize("name", CASES)
def test_completion_prompts_get_bos_as_transformers_gives_it(name: str, tmp_path: Path) -> None:
    template, byte_level, flags, bos = CASES[name]
    check_like_transformers(make_tokenizer(tmp_path / name, template, byte_level, **flags), bos)


@pytest.mark.parametrize("add_bos", [True, False])
def test_a_llama_class_tokenizer_saved_by_transformers(add_bos: bool, tmp_path: Path) -> None:
    """LLaMA-2's shape: a LlamaTokenizer (BPE over Metaspace), its tokenizer_config.json carrying add_bos_token."""
    from transformers import LlamaTokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{t: i + 3 for i, t in enumerate(
        ["▁", "t", "h", "e", "c", "a", "o", "n", "▁t", "▁c", "▁th", "▁the", "▁ca", "▁cat", "▁o", "▁on"])}}
    merges = [("▁", "t"), ("▁", "c"), ("▁t", "h"), ("▁th", "e"), ("▁c", "a"), ("▁ca", "t"), ("▁", "o"), ("▁o", "n")]
    LlamaTokenizer(vocab=vocab, merges=merges, add_bos_token=add_bos).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": add_bos}))
    check_like_transformers(tmp_path, add_bos)


# ---- token bytes (logprobs report each token's exact bytes) ---------------------------------------------------

BYTES_TEXT = "naïve café — 日本 🙂 the cat"


def test_byte_level_token_bytes_join_to_the_texts_bytes(tmp_path: Path) -> None:
    """GPT-2 / LLaMA-3 / SmolLM's shape: a token may hold part of a UTF-8 character; its bytes are still exact."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["the cat sat on the mat", "naïve café"], vocab_size=300, min_frequency=1,
                            special_tokens=["<|end|>"])
    tmp_path.mkdir(exist_ok=True)
    bpe.save(str(tmp_path / "tokenizer.json"))
    tk = Tokenizer(tmp_path)
    ids = tk.encode(BYTES_TEXT)
    pieces = [tk.token_bytes(i) for i in ids]
    assert b"".join(pieces) == BYTES_TEXT.encode()
    assert any(len(p) == 1 and p[0] >= 0x80 for p in pieces)  # a lone byte of a character: its text is U+FFFD
    assert tk.token_text(ids[pieces.index(next(p for p in pieces if p[0] >= 0xF0))]) == "\ufffd"
    end = tk.tk.token_to_id("<|end|>")
    assert tk.token_bytes(end) == b"<|end|>" and tk.token_text(end) == "<|end|>"


def test_sentencepiece_token_bytes_map_the_space_mark_and_byte_fallbacks(tmp_path: Path) -> None:
    """LLaMA-2 / Mistral's shape: "\u2581" for a space, characters outside the vocabulary as <0xNN> pieces."""
    from tokenizers import Tokenizer as Tk
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": b + 1 for b in range(256)}}
    for piece in ("\u2581", "t", "h", "e", "c", "a", "\u2581t", "\u2581th", "\u2581the", "\u2581c", "\u2581ca",
                  "\u2581cat"):
        vocab[piece] = len(vocab)
    merges = [("\u2581", "t"), ("\u2581t", "h"), ("\u2581th", "e"), ("\u2581", "c"), ("\u2581c", "a"),
              ("\u2581ca", "t")]
    tk = Tk(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    tmp_path.mkdir(exist_ok=True)
    tk.save(str(tmp_path / "tokenizer.json"))
    ours = Tokenizer(tmp_path)
    ids = ours.encode("the cat é")
    assert [ours.token_bytes(i) for i in ids][:2] == [b" the", b" cat"]
    assert b"".join(ours.token_bytes(i) for i in ids) == " the cat é".encode()
    assert ours.token_bytes(vocab["<0xC3>"]) == b"\xc3" and ours.token_text(vocab["<0xC3>"]) == "\ufffd"
