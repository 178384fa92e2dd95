"""Data preparation: JSONL records into the token file and loss mask a job's `data` reads.

    python -m trainyard.data prepare --tokenizer DIR --input FILE.jsonl --out PREFIX
    (or the console script: trainyard-data prepare ...)

DIR is a Hugging Face tokenizer folder (tokenizer.json, and tokenizer_config.json for the EOS
token and a chat template), read with the `tokenizers` library; nothing is downloaded. Each line
of FILE.jsonl is one record, of one of the kinds TRL's trainers take:

    {"text": "..."}                                   text: every token is trained on
    {"prompt": "...", "completion": "..."}            instruction: only the completion's tokens
    {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}, ...]}
                                                      chat: only the assistant turns' tokens

Text is encoded with the tokenizer's special tokens (a BOS where its post-processor adds one); a
completion follows its prompt without them; chat records are rendered with tokenizer_config.json's
chat_template (Jinja, as transformers' apply_chat_template renders it) and each assistant turn is
the part its rendering adds to the conversation before it. Every record ends with the tokenizer's
EOS token (appended unless the record already ends with it, trained on), so documents are
separated by it.

Writes PREFIX.tokens (little-endian uint16, or uint32 when the vocabulary needs it) and
PREFIX.mask (one byte per token: 1 where the token is a target the loss counts, 0 for prompt
tokens), each complete or not at all, and prints the records, tokens and trained tokens written
and the `data:` lines of a job spec. A record that cannot be read stops it with an error naming
the file and the line; nothing is written then.
"""
import argparse
import contextlib
import json
import os
import pathlib
import sys
import tempfile
from array import array

MAX_LINE_BYTES = 16 << 20  # one record
MAX_TOKENIZER_BYTES = 64 << 20
KINDS = ("auto", "text", "instruction", "chat")
ROLES = ("system", "user", "assistant", "tool")


class DataError(Exception):
    """A record or an input that cannot be used; the message names where."""


def _token_content(value):
    """tokenizer_config.json's token entries: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class Prepared:
    """What prepare() wrote."""

    def __init__(self, records, tokens, trained, dtype, tokens_path, mask_path):
        self.records = records
        self.tokens = tokens
        self.trained = trained
        self.dtype = dtype
        self.tokens_path = tokens_path
        self.mask_path = mask_path


class Encoder:
    """A tokenizer folder: the tokenizer, its EOS token and its chat template."""

    def __init__(self, folder, eos=None):
        from tokenizers import Tokenizer

        folder = pathlib.Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise DataError(f"--tokenizer: {folder} has no tokenizer.json")
        if path.stat().st_size > MAX_TOKENIZER_BYTES:
            raise DataError(f"--tokenizer: {path} is larger than 64 MiB")
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # the library's own message says what is wrong
            raise DataError(f"--tokenizer: {path}: {e}") from None
        config = {}
        config_path = folder / "tokenizer_config.json"
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError) as e:
                raise DataError(f"--tokenizer: {config_path}: not JSON ({e})") from None
            if not isinstance(config, dict):
                raise DataError(f"--tokenizer: {config_path}: not a JSON object")
        self.config = config
        eos = eos or _token_content(config.get("eos_token"))
        if eos is None:
            raise DataError(f"--eos: {folder} names no eos_token in tokenizer_config.json; "
                            "give the EOS token with --eos")
        self.eos_id = self.tokenizer.token_to_id(eos)
        if self.eos_id is None:
            raise DataError(f"--eos: {eos!r} is not in {path}'s vocabulary")
        self.eos = eos
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self._template = None

    def encode(self, text, special):
        return self.tokenizer.encode(text, add_special_tokens=special).ids

    def render(self, messages, add_generation_prompt):
        """The chat template rendered as transformers' apply_chat_template renders it."""
        if self._template is None:
            template = self.config.get("chat_template")
            if isinstance(template, list):  # named templates: the default one
                template = next((t.get("template") for t in template
                                 if isinstance(t, dict) and t.get("name") == "default"), None)
            if not isinstance(template, str):
                raise DataError("chat records need a chat_template in tokenizer_config.json")
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise TemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(template)
        specials = {k: _token_content(self.config.get(k)) or ""
                    for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **specials)


def _kind_of(record, kind):
    if kind != "auto":
        return kind
    if "messages" in record:
        return "chat"
    if "prompt" in record or "completion" in record:
        return "instruction"
    if "text" in record:
        return "text"
    raise ValueError("expected a \"text\", \"prompt\" and \"completion\", or \"messages\" field")


def _string(record, field):
    value = record.get(field)
    if not isinstance(value, str):
        raise ValueError(f"\"{field}\": expected a string, got {json.dumps(value)[:60]}")
    return value


def encode_record(encoder, record, kind="auto"):
    """(tokens, mask) of one record (a dict), EOS-terminated; ValueError naming the field."""
    if not isinstance(record, dict):
        raise ValueError("expected a JSON object")
    kind = _kind_of(record, kind)
    if kind == "text":
        tokens = encoder.encode(_string(record, "text"), special=True)
        mask = [1] * len(tokens)
    elif kind == "instruction":
        prompt = encoder.encode(_string(record, "prompt"), special=True)
        completion = encoder.encode(_string(record, "completion"), special=False)
        tokens = prompt + completion
        mask = [0] * len(prompt) + [1] * len(completion)
    else:
        messages = record.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("\"messages\": expected a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES or \
                    not isinstance(m.get("content"), str):
                raise ValueError(f"\"messages\"[{i}]: expected {{\"role\": one of "
                                 f"{', '.join(ROLES)}, \"content\": a string}}")
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError("\"messages\": no assistant turn to train on")
        from jinja2.exceptions import TemplateError

        tokens, mask = [], []
        try:
            for i, m in enumerate(messages):
                if m["role"] != "assistant":
                    continue
                # The conversation up to this turn, prompted for it; then with it.
                before = encoder.encode(encoder.render(messages[:i], True), special=False)
                upto = encoder.encode(encoder.render(messages[:i + 1], False), special=False)
                if upto[:len(before)] != before or upto[:len(tokens)] != tokens:
                    raise ValueError(f"\"messages\"[{i}]: the chat template does not render the "
                                     "conversation as a prefix of its continuation")
                mask += [0] * (len(before) - len(tokens)) + [1] * (len(upto) - len(before))
                tokens = upto
            full = encoder.encode(encoder.render(messages, False), special=False)
        except TemplateError as e:  # raise_exception's message, or the template's mistake
            raise ValueError(f"the chat template failed: {e}") from None
        if full[:len(tokens)] != tokens:
            raise ValueError("\"messages\": the chat template does not render the conversation "
                             "as a prefix of its continuation")
        mask += [0] * (len(full) - len(tokens))
        tokens = full
    if not tokens or tokens[-1] != encoder.eos_id:
        tokens = tokens + [encoder.eos_id]
        mask = mask + [1]
    return tokens, mask


def prepare(tokenizer, input_path, out_prefix, kind="auto", dtype="auto", eos=None):
    """Writes out_prefix.tokens and out_prefix.mask from input_path; DataError naming the line."""
    if kind not in KINDS:
        raise DataError(f"--kind: {kind!r} is not one of {', '.join(KINDS)}")
    encoder = Encoder(tokenizer, eos)
    if dtype == "auto":
        dtype = "uint16" if encoder.vocab_size <= 1 << 16 else "uint32"
    if dtype not in ("uint16", "uint32"):
        raise DataError(f"--dtype: {dtype!r} is not auto, uint16 or uint32")
    if dtype == "uint16" and encoder.vocab_size > 1 << 16:
        raise DataError(f"--dtype: uint16 cannot hold the {encoder.vocab_size} tokens of the "
                        "vocabulary; use uint32")
    try:
        source = open(input_path, "rb")
    except OSError as e:
        raise DataError(f"--input: cannot read {input_path}: {e.strerror}") from None
    out_prefix = str(out_prefix)
    paths = (out_prefix + ".tokens", out_prefix + ".mask")
    folder = os.path.dirname(os.path.abspath(out_prefix))
    # Streamed into files beside their places, renamed once complete: each file is complete or
    # absent, and memory holds one chunk whatever the input's size.
    temps = []
    try:
        for _ in paths:
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".prepare-")
            temps.append((os.fdopen(fd, "wb"), tmp))
        (tokens_file, _), (mask_file, _) = temps
        counts = _encode_file(encoder, source, input_path, kind, dtype, tokens_file, mask_file)
        for f, tmp in temps:
            f.flush()
            os.fsync(f.fileno())
            f.close()
            os.chmod(tmp, 0o644)
        for (_, tmp), path in zip(temps, paths):
            os.replace(tmp, path)
    except OSError as e:
        raise DataError(f"--out: cannot write {out_prefix}: {e.strerror or e}") from None
    finally:
        source.close()
        for f, tmp in temps:
            # A full disk fails the close too (its buffer's write): the file goes all the same.
            with contextlib.suppress(OSError):
                f.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    return Prepared(*counts, dtype, *paths)


# Tokens gathered before a write: 4 MiB of uint32.
_CHUNK_TOKENS = 1 << 20


def _encode_file(encoder, source, input_path, kind, dtype, tokens_file, mask_file):
    """Encodes every record of `source` into the two files; (records, tokens, trained)."""
    code = "H" if dtype == "uint16" else "I"
    tokens, mask = array(code), bytearray()
    records = total = trained = 0

    def flush():
        if sys.byteorder != "little":
            tokens.byteswap()
        tokens_file.write(tokens.tobytes())
        mask_file.write(bytes(mask))
        del tokens[:]
        del mask[:]

    number = 0
    while True:
        try:
            line = source.readline(MAX_LINE_BYTES + 1)
        except OSError as e:
            raise DataError(f"--input: cannot read {input_path}: {e.strerror or e}") from None
        if not line:
            break
        number += 1
        where = f"{input_path}:{number}"
        if len(line) > MAX_LINE_BYTES:
            raise DataError(f"{where}: a record longer than 16 MiB")
        if not line.strip():
            continue
        try:
            record = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError:
            raise DataError(f"{where}: not UTF-8") from None
        except ValueError as e:
            raise DataError(f"{where}: not JSON ({e})") from None
        try:
            t, m = encode_record(encoder, record, kind)
        except (ValueError, DataError) as e:
            raise DataError(f"{where}: {e}") from None
        tokens.extend(t)
        mask.extend(m)
        records += 1
        total += len(m)
        trained += sum(m)
        if len(tokens) >= _CHUNK_TOKENS:
            flush()
    if records == 0:
        raise DataError(f"--input: {input_path} holds no records")
    flush()
    return records, total, trained


def main(argv=None):
    parser = argparse.ArgumentParser(prog="trainyard-data", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="JSONL records into a token file and a loss mask")
    p.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer folder")
    p.add_argument("--input", required=True, help="JSONL: text, prompt/completion or messages")
    p.add_argument("--out", required=True, help="writes OUT.tokens and OUT.mask")
    p.add_argument("--kind", default="auto", choices=KINDS,
                   help="the records' kind (default: by each record's fields)")
    p.add_argument("--dtype", default="auto", choices=("auto", "uint16", "uint32"))
    p.add_argument("--eos", help="the EOS token (default: tokenizer_config.json's eos_token)")
    args = parser.parse_args(argv)
    try:
        done = prepare(args.tokenizer, args.input, args.out, args.kind, args.dtype, args.eos)
    except DataError as e:
        print(f"trainyard-data: {e}", file=sys.stderr)
        return 2
    print(f"wrote {done.records} records, {done.tokens} tokens ({done.trained} trained) to "
          f"{done.tokens_path} and {done.mask_path}")
    print("data:")
    print(f"  path: {os.path.abspath(done.tokens_path)}")
    print(f"  format: {done.dtype}")
    print(f"  loss_mask: {os.path.abspath(done.mask_path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
