"""trainyard-data prepare (trainyard/data.py) with a tokenizer built here (the `tokenizers`
library; nothing downloaded): the tokens and masks it writes equal those written out by hand and
those the library gives for each piece; bad records are refused naming the line, and nothing is
written then. (test_sdk.py trains a job on what it writes.)"""
import json
import os
import subprocess
import sys
from array import array

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from trainyard import data

VOCAB = ["<unk>", "<s>", "</s>", "user", "assistant", "system", ":", "hello", "world", "how", "are",
         "you", "fine", "thanks", "say", "hi", "be", "brief"]
ID = {word: i for i, word in enumerate(VOCAB)}
BOS, EOS = ID["<s>"], ID["</s>"]
TEMPLATE = ("{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
            "{% if add_generation_prompt %}<s> assistant :{% endif %}")


def ids(text):
    return [ID[w] for w in text.split()]


def make_tokenizer(folder):
    """A word-level tokenizer in `folder` whose post-processor adds BOS, as Llama's does."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": TEMPLATE}))
    return folder


@pytest.fixture()
def tokenizer_dir(tmp_path):
    return make_tokenizer(tmp_path / "tokenizer")


RECORDS = [
    {"text": "hello world"},
    {"prompt": "say hi", "completion": "hi"},
    {"messages": [{"role": "user", "content": "how are you"},
                  {"role": "assistant", "content": "fine thanks"}]},
    {"messages": [{"role": "system", "content": "be brief"},
                  {"role": "user", "content": "say hi"},
                  {"role": "assistant", "content": "hi"},
                  {"role": "user", "content": "how are you"},
                  {"role": "assistant", "content": "fine"}]},
    {"text": "hello </s>"},  # ends with EOS already: none appended
]

# Written out by hand: each record's tokens and, for each, whether the loss counts it.
BY_HAND = [
    (ids("<s> hello world </s>"), [1, 1, 1, 1]),
    (ids("<s> say hi hi </s>"), [0, 0, 0, 1, 1]),
    (ids("<s> user : how are you </s> <s> assistant : fine thanks </s>"), [0] * 10 + [1] * 3),
    (ids("<s> system : be brief </s> <s> user : say hi </s> <s> assistant : hi </s> "
         "<s> user : how are you </s> <s> assistant : fine </s>"),
     [0] * 15 + [1] * 2 + [0] * 10 + [1] * 2),
    (ids("<s> hello </s>"), [1, 1, 1]),
]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def read(prefix, code="H"):
    tokens = array(code)
    tokens.frombytes(open(f"{prefix}.tokens", "rb").read())
    return list(tokens), list(open(f"{prefix}.mask", "rb").read())


def test_tokens_and_masks_are_those_written_by_hand_and_the_librarys(tmp_path, tokenizer_dir):
    write_jsonl(tmp_path / "in.jsonl", RECORDS)
    done = data.prepare(tokenizer_dir, tmp_path / "in.jsonl", tmp_path / "out")
    tokens, mask = read(tmp_path / "out")
    assert tokens == [t for r in BY_HAND for t in r[0]]
    assert mask == [m for r in BY_HAND for m in r[1]]
    assert (done.records, done.tokens, done.trained, done.dtype) == \
        (5, len(tokens), sum(mask), "uint16")
    # The library itself, piece by piece: text with its special tokens, a completion without.
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    assert tokens[:4] == tok.encode("hello world").ids + [EOS]
    assert tokens[4:9] == tok.encode("say hi").ids + tok.encode("hi", add_special_tokens=False).ids \
        + [EOS]
    # uint32 on request: the same tokens.
    data.prepare(tokenizer_dir, tmp_path / "in.jsonl", tmp_path / "wide", dtype="uint32")
    assert read(tmp_path / "wide", "I") == (tokens, mask)


def test_written_in_chunks_the_files_are_the_same_and_a_late_bad_record_leaves_none(
        tmp_path, tokenizer_dir, monkeypatch):
    # Memory holds one chunk whatever the input's size: here chunks of 3 tokens, which the
    # records' ends do not line up with.
    write_jsonl(tmp_path / "in.jsonl", RECORDS * 7)
    whole = data.prepare(tokenizer_dir, tmp_path / "in.jsonl", tmp_path / "whole")
    monkeypatch.setattr(data, "_CHUNK_TOKENS", 3)
    writes = []
    real_fdopen = os.fdopen

    class Counted:  # the output files, their writes counted
        def __init__(self, f):
            self.f = f

        def write(self, b):
            writes.append(len(b))
            return self.f.write(b)

        def __getattr__(self, name):
            return getattr(self.f, name)

    monkeypatch.setattr(data.os, "fdopen", lambda *a, **k: Counted(real_fdopen(*a, **k)))
    chunked = data.prepare(tokenizer_dir, tmp_path / "in.jsonl", tmp_path / "chunked")
    monkeypatch.setattr(data.os, "fdopen", real_fdopen)
    assert len(writes) > 2 * 35 / 2  # two files, a write each at least every other record
    assert read(tmp_path / "chunked") == read(tmp_path / "whole")
    per_pass = (sum(len(t) for t, _ in BY_HAND), sum(sum(m) for _, m in BY_HAND))
    assert (chunked.records, chunked.tokens, chunked.trained) == \
        (whole.records, whole.tokens, whole.trained) == (35, 7 * per_pass[0], 7 * per_pass[1])
    # A bad record after several chunks were written: no output, no temporary file.
    (tmp_path / "bad.jsonl").write_text((tmp_path / "in.jsonl").read_text() + "{not json\n")
    with pytest.raises(data.DataError) as e:
        data.prepare(tokenizer_dir, tmp_path / "bad.jsonl", tmp_path / "bad")
    assert str(e.value).startswith(f"{tmp_path / 'bad.jsonl'}:36: not JSON")
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl", "chunked.mask", "chunked.tokens",
                                            "in.jsonl", "tokenizer", "whole.mask", "whole.tokens"]


def test_the_command_line_prints_what_it_wrote_and_the_spec_lines(tmp_path, tokenizer_dir):
    write_jsonl(tmp_path / "in.jsonl", RECORDS[:2])
    out = subprocess.run([sys.executable, "-m", "trainyard.data", "prepare", "--tokenizer",
                          str(tokenizer_dir), "--input", str(tmp_path / "in.jsonl"), "--out",
                          str(tmp_path / "out")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "wrote 2 records, 9 tokens (6 trained)" in out.stdout
    assert f"path: {tmp_path / 'out.tokens'}" in out.stdout
    assert "format: uint16" in out.stdout
    assert f"loss_mask: {tmp_path / 'out.mask'}" in out.stdout


@pytest.mark.parametrize("line, message", [
    ("{not json", "not JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"title": "x"}', 'expected a "text", "prompt" and "completion", or "messages" field'),
    ('{"text": 5}', '"text": expected a string, got 5'),
    ('{"prompt": "say", "completion": null}', '"completion": expected a string'),
    ('{"messages": []}', '"messages": expected a non-empty list'),
    ('{"messages": [{"role": "robot", "content": "hi"}]}', '"messages"[0]: expected {"role"'),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant turn to train on"),
])
def test_a_bad_record_is_refused_naming_the_line_and_nothing_is_written(tmp_path, tokenizer_dir,
                                                                       line, message):
    (tmp_path / "in.jsonl").write_text('{"text": "hello"}\n\n' + line + "\n")
    with pytest.raises(data.DataError) as e:
        data.prepare(tokenizer_dir, tmp_path / "in.jsonl", tmp_path / "out")
    assert str(e.value).startswith(f"{tmp_path / 'in.jsonl'}:3: ")
    assert message in str(e.value)
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "tokenizer"]


def test_a_full_disk_is_named_and_leaves_no_temporary_file(tmp_path, tokenizer_dir,
                                                           monkeypatch):
    write_jsonl(tmp_path / "in.jsonl", RECORDS)
    real_fdopen = os.fdopen

    class Full:  # writes fail as on a full disk, closing too (the buffer's write)
        def __init__(self, f):
            self.f = f

        def write(self, b):
            raise OSError(28, "No space left on device")

        def close(self):
            self.f.close()
            raise OSError(28, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.f, name)

    monkeypatch.setattr(data.os, "fdopen", lambda *a, **k: Full(real_fdopen(*a, **k)))
    with pytest.raises(data.DataError) as e:
        data.prepare(tokenizer_dir, tmp_path / "in.jsonl", tmp_path / "out")
    assert str(e.value) == f"--out: cannot write {tmp_path / 'out'}: No space left on device"
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "tokenizer"]


def test_what_the_tokenizer_lacks_is_named(tmp_path, tokenizer_dir):
    write_jsonl(tmp_path / "in.jsonl", RECORDS[2:3])
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(data.DataError, match=r"in.jsonl:1: chat records need a chat_template"):
        data.prepare(tokenizer_dir, tmp_path / "in.jsonl", tmp_path / "out")
    del config["eos_token"]
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(data.DataError, match=r"--eos: .* names no eos_token"):
        data.prepare(tokenizer_dir, tmp_path / "in.jsonl", tmp_path / "out")
    with pytest.raises(data.DataError, match=r"--eos: 'EOS' is not in"):
        data.prepare(tokenizer_dir, tmp_path / "in.jsonl", tmp_path / "out", eos="EOS")
    with pytest.raises(data.DataError, match=r"--tokenizer: .* has no tokenizer.json"):
        data.prepare(tmp_path, tmp_path / "in.jsonl", tmp_path / "out")
    with pytest.raises(data.DataError, match=r"--input: cannot read"):
        data.prepare(tokenizer_dir, tmp_path / "missing.jsonl", tmp_path / "out", eos="</s>")
