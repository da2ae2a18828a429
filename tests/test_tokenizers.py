"""A checkpoint's own tokenizer (paged_kv.models.hf_tokenizer): a real BPE trained with `tokenizers` on the
project's corpus and saved into a checkpoint folder (scripts/bpe_checkpoint.py) encodes, decodes,
streams and renders chat prompts as transformers' `PreTrainedTokenizerFast` does on the same files;
BOS/EOS ids and `add_bos_token` follow tokenizer_config.json / generation_config.json; EOS ids end
generation in the serving engine; the byte tokenizer stays for the built-in model.
"""

import json
import shutil

import numpy as np
import pytest
import transformers

from paged_kv.models import load_hf_checkpoint
from paged_kv.models.hf_tokenizer import HFTokenizer, load_tokenizer, render_chat_template, stream_decoder
from paged_kv.models.tokenizer import ByteTokenizer
from scripts import bpe_checkpoint
from scripts.train_tiny_llama import generate_corpus

TEXTS = [
    "Once upon a time there was a brave lion named Rosa.",
    "Q: What does the cow say? A: The cow says moo.",
    "Let us count: 12, 13, 14,",
    "",
    "  leading spaces and\ttabs\nnew lines  ",
    "Ünïcödé → 日本語 🦁 naïve café",  # bytes the corpus never had: byte-level fallback pieces
    "<|eot_id|> inside text",  # a special token's string is its id, as transformers encodes it
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return bpe_checkpoint.write_checkpoint(tmp_path_factory.mktemp("bpe"), vocab_size=400)


@pytest.fixture(scope="module")
def hf(ckpt):
    return transformers.PreTrainedTokenizerFast.from_pretrained(ckpt)


@pytest.fixture(scope="module")
def tok(ckpt):
    t, desc = load_tokenizer(ckpt)
    assert isinstance(t, HFTokenizer)
    assert desc == "tokenizer.json (BPE, 400 ids) through tokenizers"
    return t


def test_it_is_a_real_bpe(tok):
    corpus = " ".join(generate_corpus(7, 50))
    ids = tok.encode(corpus, add_bos=False)
    assert len(ids) < len(corpus.encode()) / 2  # merges learnt: far fewer ids than bytes
    assert len(set(ids)) > 150


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_agree_with_transformers(tok, hf, text):
    assert tok.encode(text) == hf(text)["input_ids"]
    assert tok.encode(text, add_bos=False) == hf(text, add_special_tokens=False)["input_ids"]
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id == hf.bos_token_id
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_corpus_round_trip_agrees(tok, hf):
    for doc in generate_corpus(11, 30):
        ids = tok.encode(doc)
        assert ids == hf(doc)["input_ids"]
        assert tok.decode(ids) == doc == hf.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_pieces_join_to_the_text(tok, text):
    """Token by token, multi-byte characters split over several byte-level pieces print once whole."""
    ids = tok.encode(text, add_bos=False)
    dec = tok.stream()
    pieces = [dec.push(i) for i in ids]
    assert "".join(pieces) + dec.finish() == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)
    # Cut inside a character: the held bytes come out at the end as decode shows them.
    for cut in range(1, len(ids)):
        dec = tok.stream()
        assert "".join(dec.push(i) for i in ids[:cut]) + dec.finish() == tok.decode(ids[:cut])


def test_byte_stream_decoder_holds_partial_characters():
    bt = ByteTokenizer()
    ids = bt.encode("é日🦁", add_bos=True) + [bt.eos_id]
    dec = stream_decoder(bt)
    pieces = [dec.push(i) for i in ids]
    assert pieces == ["", "", "é", "", "", "日", "", "", "", "🦁", ""]
    dec = stream_decoder(bt)
    assert [dec.push(i) for i in "日".encode()[:2]] == ["", ""] and dec.finish() == "\ufffd"


def test_special_ids_follow_the_checkpoint(tok, ckpt):
    gen = json.loads((ckpt / "generation_config.json").read_text())
    assert tok.eos_ids == tuple(gen["eos_token_id"]) == (1, 2)  # <|end_of_text|>, <|eot_id|>
    assert tok.bos_id == 0 and tok.add_bos_token is None


def test_eos_fallbacks_config_then_tokenizer_config(ckpt, tmp_path):
    d = tmp_path / "c"
    shutil.copytree(ckpt, d)
    (d / "generation_config.json").unlink()
    assert HFTokenizer.load(d).eos_ids == (1, 2)  # config.json's eos_token_id list
    cfg = json.loads((d / "config.json").read_text())
    cfg["eos_token_id"] = None
    (d / "config.json").write_text(json.dumps(cfg))
    assert HFTokenizer.load(d).eos_ids == (1,)  # tokenizer_config's eos_token string


@pytest.mark.parametrize("flag", [True, False])
def test_add_bos_token_has_the_last_word(ckpt, tmp_path, flag):
    d = tmp_path / "c"
    shutil.copytree(ckpt, d)
    tcfg = json.loads((d / "tokenizer_config.json").read_text())
    tcfg["add_bos_token"] = flag
    (d / "tokenizer_config.json").write_text(json.dumps(tcfg))
    t = HFTokenizer.load(d)
    plain = t.encode("The cow says", add_bos=False)
    assert t.encode("The cow says") == ([0] + plain if flag else plain)


def test_bad_special_token_files_are_one_line_errors(ckpt, tmp_path):
    d = tmp_path / "c"
    shutil.copytree(ckpt, d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 400]}))
    with pytest.raises(ValueError, match=r"generation_config.json eos_token_id=\[1, 400\]: every id must be an int "
                                         r"in \[0, vocab_size=400\)"):
        HFTokenizer.load(d)
    (d / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json' is not readable JSON"):
        HFTokenizer.load(d)
    (d / "generation_config.json").unlink()
    (d / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nope"}}' + " " * 70_000)
    with pytest.raises(ValueError, match="tokenizer.json' is not a tokenizers file"):
        load_tokenizer(d)


def test_byte_tokenizer_stays_for_the_builtin_model(tmp_path):
    from paged_kv.apps.cli import BUILTIN_CHECKPOINT

    t, desc = load_tokenizer(BUILTIN_CHECKPOINT)
    assert isinstance(t, ByteTokenizer) and desc == "byte-level (tokenizer.json of type 'byte')"
    t, desc = load_tokenizer(tmp_path)  # no tokenizer.json at all
    assert isinstance(t, ByteTokenizer) and "has no tokenizer.json" in desc
    loaded = load_tokenizer(BUILTIN_CHECKPOINT)  # a NamedTuple: by name as well as unpacked
    assert isinstance(loaded.tokenizer, ByteTokenizer) and loaded.description == desc.replace(desc, loaded[1])


def test_decode_skips_the_padding_of_a_generated_row():
    """`generate` pads each answer's row with -1 after its end: both tokenizers decode such a row
    as is (the padding is not text), and still refuse an id beyond the vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    byte = ByteTokenizer()
    row = byte.encode("moo") + [byte.eos_id, -1, -1]
    assert byte.decode(row) == "moo" and byte.decode(np.array(row)) == "moo"
    backend = Tokenizer(models.WordLevel({"<unk>": 0, "the": 1, "cow": 2, "moo": 3}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = HFTokenizer(backend, bos_id=None, eos_ids=())
    ids = tok.encode("the cow moo", add_bos=False)
    assert ids == [1, 2, 3] and tok.decode(ids + [-1, -1]) == tok.decode(ids)
    for t in (byte, tok):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            t.decode([1, t.vocab_size])


# ---------------------------------------------------------------------------- chat templates
MESSAGES = [{"role": "system", "content": "  Answer in one line. "},
            {"role": "user", "content": "What does the cow say?"},
            {"role": "assistant", "content": "Moo."},
            {"role": "user", "content": "And the owl? ü"}]
# Written for this test: loop controls, trim/lstrip of blocks, tojson of non-ASCII, raise_exception,
# special-token variables and the generation prompt.
TEMPLATE = """{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] | trim %}{% set messages = messages[1:] %}{% else %}{% set system = 'none' %}{% endif %}
{{ bos_token }}[sys {{ system | tojson }}]
{% for m in messages %}
    {% if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}
    {% if loop.index0 > 5 %}{% break %}{% endif %}
<{{ m['role'] }}>{{ m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}

{% endfor %}
{% if add_generation_prompt %}<assistant>{% endif %}"""  # noqa: E501 (a newline would change the output)


@pytest.mark.parametrize("gen_prompt", [True, False])
def test_chat_template_renders_as_transformers(tok, hf, gen_prompt):
    ours = render_chat_template(TEMPLATE, MESSAGES, add_generation_prompt=gen_prompt,
                                special_tokens=tok.special_tokens)
    theirs = hf.apply_chat_template(MESSAGES, chat_template=TEMPLATE, tokenize=False,
                                    add_generation_prompt=gen_prompt)
    assert ours == theirs
    assert ours.startswith("<|begin_of_text|>[sys \"Answer in one line.\"]\n<user>")
    assert ours.endswith("<assistant>") == gen_prompt
    ids = hf.apply_chat_template(MESSAGES, chat_template=TEMPLATE, tokenize=True,
                                 add_generation_prompt=gen_prompt)["input_ids"]
    assert tok.encode(ours, add_bos=False) == list(ids)  # the template carries its own BOS


def test_checkpoint_chat_template(tok, hf):
    msgs = MESSAGES[1:2]
    assert tok.render_chat(msgs) == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def test_chat_template_errors_are_value_errors(tok):
    with pytest.raises(ValueError, match="chat_template: bad role tool"):
        render_chat_template(TEMPLATE, [{"role": "tool", "content": "x"}], special_tokens=tok.special_tokens)
    with pytest.raises(ValueError, match="messages must be a list"):
        render_chat_template(TEMPLATE, "hello")
    with pytest.raises(ValueError, match="chat_template: .*unsafe|access to attribute"):
        render_chat_template("{{ messages.__class__.__mro__ }}", MESSAGES)  # the sandbox holds


# ---------------------------------------------------------------------------- EOS ends generation
def test_any_eos_id_of_the_list_ends_generation(ckpt):
    """The second EOS id of generation_config's list ends a sample, and decoding stops there."""
    import paged_kv as pk
    from paged_kv.engine import SamplingParams
    from paged_kv.engine.serving import Request, ServingConfig, ServingEngine

    t = HFTokenizer.load(ckpt)
    model = load_hf_checkpoint(ckpt)
    cfg = ServingConfig(pk.ManagerConfig(num_blocks=32, block_size=8, max_seqs=2, max_blocks_per_seq=8),
                        chunk_size=16, max_prefill_rows=2)
    prompt = t.encode("Once upon a time there was a")
    free = next(ServingEngine(model, cfg).run([Request(prompt, SamplingParams(max_new_tokens=12))]))
    assert free.finish_reasons == ["length"]
    first = free.tokens[0]
    # Make a later greedy token (its first occurrence) the second EOS id of the list.
    k = next(k for k in range(2, len(first)) if first[k] not in first[:k])
    stop = first[k]
    params = SamplingParams(max_new_tokens=12, eos_token_ids=(t.eos_ids[0], stop))
    out = next(ServingEngine(model, cfg).run([Request(prompt, params)]))
    assert out.tokens[0] == first[:k + 1] and out.finish_reasons == ["eos"]
    t.eos_ids = (t.eos_ids[0], stop)
    assert t.decode(out.tokens[0], stop_at_eos=True) == t.decode(first[:k])
