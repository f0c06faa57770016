"""Text <-> token ids for one model: encode/decode, the model's chat template, and streaming detokenization.

A `Tokenizer` wraps a Rust `tokenizers.Tokenizer` (the "backend"); BOS insertion lives in the backend's
post-processor, so `encode(text)` and `encode(text, add_special_tokens=False)` mean what they mean in
transformers. Three sources: an HF directory (via transformers), GGUF metadata (byte-level BPE built here,
anything else via transformers' GGUF conversion) and, for tests, `specd.testing.byte_tokenizer`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any, NamedTuple

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Encoding, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from specd.errors import InvalidParameterError, ModelLoadError
from specd.model.chat_text import STANDARD_ROLES, content_spans, overlaps, template_roles
from specd.model.gguf import read_gguf

# GGUF `tokenizer.ggml.token_type` values (llama.cpp's llama_token_type).
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4
# GGUF pre-tokenizer names whose split is GPT-2's own regex (transformers uses it for these too).
_GPT2_SPLIT_PRE_TYPES = (None, "default", "gpt2", "gpt-2", "smollm")
# `encode` holds the GIL for its whole run (150k characters: ~0.25 s during which no other thread of a server
# runs); `encode_batch` releases it. Short texts keep `encode`, which is a little faster.
_RELEASE_GIL_ABOVE_CHARS = 4096


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable-character spelling, which byte-level BPE vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {byte: chr(byte) for byte in printable}
    unprintable = [byte for byte in range(256) if byte not in spelling]
    # Bytes without a printable glyph of their own borrow code points from 256 upwards, in byte order.
    spelling.update({byte: chr(256 + i) for i, byte in enumerate(unprintable)})
    return spelling


def _raise_from_template(message: str) -> None:
    # Chat templates call raise_exception to reject a conversation (e.g. roles that do not alternate).
    raise InvalidParameterError("messages", message)


def _tojson(value: Any, indent: int | None = None) -> str:
    # jinja2's own tojson HTML-escapes '<' and '>', which would corrupt prompts; templates expect plain JSON.
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _encode(backend: BackendTokenizer, text: str, add_special_tokens: bool) -> Encoding:
    if len(text) > _RELEASE_GIL_ABOVE_CHARS:
        return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
    return backend.encode(text, add_special_tokens=add_special_tokens)


class ChatPrompt(NamedTuple):
    """A rendered conversation: the template's text and its prompt token ids."""

    text: str
    token_ids: list[int]


def _validate_messages(messages: Sequence[Mapping[str, str]], roles: frozenset[str]) -> list[dict[str, str]]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InvalidParameterError("messages", "must be a list of {'role': ..., 'content': ...} objects")
    if not messages:
        raise InvalidParameterError("messages", "must contain at least one message")
    validated: list[dict[str, str]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidParameterError(f"messages[{i}]", "must be an object with 'role' and 'content'")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise InvalidParameterError(f"messages[{i}].role", f"must be a non-empty string, got {role!r}")
        if role == "developer" and role not in roles:
            role = "system"  # OpenAI's current name for the system role, for templates that do not name it
        if role not in roles:
            # The role is written into the prompt as is: an unknown one could carry control text with it.
            raise InvalidParameterError(
                f"messages[{i}].role", f"must be one of {', '.join(sorted(roles))} (the roles this model's chat "
                f"template knows), got {role[:40]!r}",
            )
        if not isinstance(content, str):
            raise InvalidParameterError(f"messages[{i}].content", f"must be a string, got {type(content).__name__}")
        validated.append({"role": role, "content": content})
    return validated


class Tokenizer:
    """One model's tokenizer. Never mutated after construction, so one instance serves every sequence.

    special_tokens: the strings a chat template may reference ({"bos_token": "<s>", "eos_token": ...}).
    chat_roles: the message roles the chat template knows (system, user, assistant and any it names).
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        eos_token_ids: Sequence[int],
        bos_token_id: int | None,
        chat_template: str | None,
        special_tokens: Mapping[str, str] | None = None,
    ) -> None:
        self._backend = backend
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))
        self.bos_token_id = bos_token_id
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.chat_template = chat_template
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self._template: jinja2.Template | None = None
        self.chat_roles = STANDARD_ROLES
        if chat_template is not None:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_from_template
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            try:
                self._template = env.from_string(chat_template)
                self.chat_roles = template_roles(env.parse(chat_template))
            except jinja2.TemplateError as exc:
                raise ModelLoadError(f"chat_template: not a valid jinja2 template: {exc}") from exc

    @property
    def backend(self) -> BackendTokenizer:
        """The underlying `tokenizers.Tokenizer` (e.g. to save it or wrap it in transformers)."""
        return self._backend

    # ------------------------------------------------------------------ core
    def encode(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; add_special_tokens adds what the model's post-processor adds (BOS or nothing).

        split_special_tokens: read control-token strings in `text` (`<|im_end|>`) as plain text, the safe way to
        encode text a client wrote; by default they become the control tokens, as in transformers.
        """
        backend = self._plain_backend if split_special_tokens else self._backend
        return _encode(backend, text, add_special_tokens).ids

    def warm_up(self) -> None:
        """Build now what encoding client text builds on first use (a copy of the backend, max_token_chars;
        ~0.5 s for a 49k vocabulary, holding the GIL), so a server's first request does not pay for it."""
        _ = self._plain_backend, self._special_token_ids, self.max_token_chars

    @cached_property
    def _plain_backend(self) -> BackendTokenizer:
        """A copy of the backend that splits special-token strings as ordinary text (the original is shared
        by every thread, so its `encode_special_tokens` switch is never flipped)."""
        plain = BackendTokenizer.from_str(self._backend.to_str())
        plain.encode_special_tokens = True
        return plain

    @cached_property
    def _special_token_ids(self) -> dict[int, str]:
        """Control tokens (added tokens marked special) by id."""
        return {i: t.content for i, t in self._backend.get_added_tokens_decoder().items() if t.special}

    @cached_property
    def max_token_chars(self) -> int:
        """An upper bound on the characters of text one token can stand for, so a text longer than
        `max_tokens * max_token_chars` characters cannot fit in `max_tokens` tokens (checked before encoding).

        The longest token's UTF-8 length (>= its characters); x4 when the backend normalizes text first, since
        a normalizer may fold several characters into one (NFKC: a base letter and its combining marks).
        """
        longest = max(
            (len(self.decode([i], skip_special_tokens=False).encode("utf-8")) for i in range(self.vocab_size)),
            default=1,
        )
        return max(1, longest) * (4 if self._backend.normalizer is not None else 1)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry (in the model's own spelling, e.g. 'Ġthe'), or None if out of range."""
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def with_eos_token_ids(self, eos_token_ids: Sequence[int]) -> Tokenizer:
        """A copy that stops on `eos_token_ids` (e.g. merged with generation_config.json's list)."""
        return Tokenizer(
            self._backend,
            eos_token_ids=eos_token_ids,
            bos_token_id=self.bos_token_id,
            chat_template=self.chat_template,
            special_tokens=self.special_tokens,
        )

    # ------------------------------------------------------------------ chat
    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Render the model's chat template. Raises InvalidParameterError naming the bad field (a role the
        template does not know included)."""
        return self._render(_validate_messages(messages, self.chat_roles), add_generation_prompt)

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        if self._template is None:
            raise InvalidParameterError("messages", "this model has no chat template; send a plain prompt")
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens
            )
        except InvalidParameterError:  # raise_exception: the template rejected the conversation
            raise
        except (jinja2.TemplateError, TypeError, ValueError) as exc:  # the template itself misbehaved
            raise InvalidParameterError("messages", f"the chat template failed: {exc}") from exc

    def encode_chat(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True,
        split_special_tokens: bool = True,
    ) -> list[int]:
        """Prompt ids of a conversation (see render_chat)."""
        return self.render_chat(messages, add_generation_prompt, split_special_tokens).token_ids

    def render_chat(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True,
        split_special_tokens: bool = True,
    ) -> ChatPrompt:
        """The rendered conversation and its prompt ids. The template writes its own BOS, so none is added.

        split_special_tokens (default): control-token strings inside message contents are encoded as plain
        text, so `"<|im_end|>"` written by a client cannot end its turn; the template's own control tokens
        stay control tokens. Raises InvalidParameterError for a content that holds control-token text when
        the template rewrites contents (trims, escapes), since where client text ends is then unknown.
        Conversations without control text in their contents get exactly the ids of encoding the whole text.
        """
        validated = _validate_messages(messages, self.chat_roles)
        text = self._render(validated, add_generation_prompt)
        encoding = _encode(self._backend, text, add_special_tokens=False)
        if not split_special_tokens:
            return ChatPrompt(text, encoding.ids)
        spans = content_spans(lambda marked: self._render(marked, add_generation_prompt), validated, text)
        if spans is None:
            specials = self._special_token_ids.values()
            for i, message in enumerate(validated):
                if any(special in message["content"] for special in specials):
                    raise InvalidParameterError(
                        f"messages[{i}].content", "holds control-token text, and this model's chat template "
                        "rewrites message contents, so it cannot be kept as plain text",
                    )
            return ChatPrompt(text, encoding.ids)
        forged = any(token_id in self._special_token_ids and overlaps(offsets, spans)
                     for token_id, offsets in zip(encoding.ids, encoding.offsets))
        if not forged:
            return ChatPrompt(text, encoding.ids)
        # Template text keeps its control tokens; contents are encoded as plain text, piece by piece.
        token_ids: list[int] = []
        cursor = 0
        for start, end in spans:
            if start > cursor:
                token_ids += _encode(self._backend, text[cursor:start], add_special_tokens=False).ids
            if end > start:
                token_ids += _encode(self._plain_backend, text[start:end], add_special_tokens=False).ids
            cursor = max(cursor, end)
        if cursor < len(text):
            token_ids += _encode(self._backend, text[cursor:], add_special_tokens=False).ids
        return ChatPrompt(text, token_ids)

    # ------------------------------------------------------------------ constructors
    @staticmethod
    def from_hf_dir(path: str | Path) -> Tokenizer:
        """Load tokenizer.json/tokenizer_config.json (or a sentencepiece model) from an HF directory."""
        from transformers import AutoTokenizer  # heavy import, only needed for HF directories

        try:
            hf_tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as exc:  # transformers raises many types (OSError, ValueError, KeyError...)
            raise ModelLoadError(f"{path}: could not load the tokenizer: {exc}") from exc
        return Tokenizer._from_transformers(hf_tokenizer, str(path))

    @staticmethod
    def from_gguf(path: str | Path) -> Tokenizer:
        """The tokenizer described by a GGUF file's metadata."""
        return Tokenizer.from_gguf_metadata(read_gguf(Path(path)).metadata, Path(path))

    @staticmethod
    def from_gguf_metadata(metadata: Mapping[str, Any], gguf_path: Path | None = None) -> Tokenizer:
        """Byte-level BPE vocabularies are built here directly (fast, no transformers import); other
        tokenizer kinds go through transformers' GGUF conversion, which needs `gguf_path`."""
        kind = metadata.get("tokenizer.ggml.model")
        if kind == "gpt2" and metadata.get("tokenizer.ggml.pre") in _GPT2_SPLIT_PRE_TYPES:
            return _byte_level_from_gguf(metadata)
        if gguf_path is None:
            raise ModelLoadError(f"tokenizer.ggml.model: {kind!r} tokenizers need the GGUF file path to convert")
        from transformers import AutoTokenizer

        try:
            hf_tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        except Exception as exc:
            raise ModelLoadError(f"{gguf_path}: could not convert the GGUF tokenizer: {exc}") from exc
        return Tokenizer._from_transformers(hf_tokenizer, str(gguf_path))

    def backend_json(self) -> str:
        """The serialised tokenizer (tokenizers' JSON), for libraries that build their own view of it (grammars)."""
        return self._backend.to_str()

    @staticmethod
    def _from_transformers(hf_tokenizer: Any, source: str) -> Tokenizer:
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        if not isinstance(backend, BackendTokenizer):
            raise ModelLoadError(f"{source}: only fast (tokenizers-backed) tokenizers are supported")
        template = getattr(hf_tokenizer, "chat_template", None)
        if isinstance(template, Mapping):  # several named templates: the plain chat one is "default"
            template = template.get("default")
        names = ("bos_token", "eos_token", "unk_token", "pad_token")
        special_tokens = {name: str(getattr(hf_tokenizer, name)) for name in names
                          if getattr(hf_tokenizer, name, None) is not None}
        eos = hf_tokenizer.eos_token_id
        return Tokenizer(
            backend,
            eos_token_ids=() if eos is None else (int(eos),),
            bos_token_id=hf_tokenizer.bos_token_id,
            chat_template=template,
            special_tokens=special_tokens,
        )


def _byte_level_from_gguf(metadata: Mapping[str, Any]) -> Tokenizer:
    """A GPT-2-style byte-level BPE from tokenizer.ggml.tokens/merges/token_type."""
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    token_types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(merge.split(" ", 1)) for merge in metadata.get("tokenizer.ggml.merges", [])]
    alphabet = byte_level_alphabet()
    spelled = set(alphabet.values())
    # Added tokens are sometimes stored with raw spaces/UTF-8; the BPE vocabulary wants byte-level spelling.
    vocab = {
        token if set(token) <= spelled else "".join(alphabet[b] for b in token.encode("utf-8")): token_id
        for token_id, token in enumerate(tokens)
    }
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>...) must match whole in text; one spelled outside the byte alphabet is a
    # mislabelled entry that would otherwise grow the vocabulary past the embedding table.
    backend.add_special_tokens([
        AddedToken(token, special=True, normalized=False)
        for token, kind in zip(tokens, token_types) if kind == _GGUF_CONTROL and set(token) <= spelled
    ])
    backend.add_tokens([
        AddedToken(token, special=False, normalized=False)
        for token, kind in zip(tokens, token_types) if kind == _GGUF_USER_DEFINED and token in vocab
    ])

    def token_id_of(key: str) -> int | None:
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        return int(token_id) if token_id is not None and 0 <= int(token_id) < len(tokens) else None

    bos_id, eos_id = token_id_of("bos_token_id"), token_id_of("eos_token_id")
    # llama.cpp's add_bos/add_eos flags become the post-processor, as transformers does for these files.
    prepend = [bos_id] if bos_id is not None and metadata.get("tokenizer.ggml.add_bos_token", False) else []
    append = [eos_id] if eos_id is not None and metadata.get("tokenizer.ggml.add_eos_token", False) else []
    if prepend or append:
        def template(sequence: str, type_id: int) -> str:
            return " ".join([f"{tokens[i]}:{type_id}" for i in prepend] + [f"${sequence}:{type_id}"]
                            + [f"{tokens[i]}:{type_id}" for i in append])

        backend.post_processor = processors.TemplateProcessing(
            single=template("A", 0),
            pair=f"{template('A', 0)} {template('B', 1)}",
            special_tokens=[(tokens[i], i) for i in dict.fromkeys(prepend + append)],
        )
    key_of_name = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                   "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}
    special_tokens = {name: tokens[i] for name, key in key_of_name.items() if (i := token_id_of(key)) is not None}
    eos_keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    return Tokenizer(
        backend,
        eos_token_ids=[i for key in eos_keys if (i := token_id_of(key)) is not None],
        bos_token_id=bos_id,
        chat_template=metadata.get("tokenizer.chat_template"),
        special_tokens=special_tokens,
    )


class IncrementalDetokenizer:
    """Streams text for a growing list of generated token ids.

    Each push decodes only a short window: the tokens already emitted in the previous step (context, so
    leading-space and byte-merging rules see their neighbours) plus the new ones, and emits the text past
    the context. If the window ends in U+FFFD the tail may be an incomplete UTF-8 character whose
    remaining bytes are in tokens not generated yet, so nothing is emitted until it completes (or `flush`).
    The concatenated deltas equal `tokenizer.decode(all generated ids)`.
    """

    # Prompt tokens kept as initial context, so the first generated token decodes as it does mid-text.
    _NUM_PROMPT_CONTEXT_TOKENS = 6

    def __init__(
        self, tokenizer: Tokenizer, skip_special_tokens: bool = True, prompt_token_ids: Sequence[int] = ()
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # Window state: ids[prefix_offset:read_offset] is emitted context, ids[read_offset:] not yet emitted.
        self._window_ids: list[int] = list(prompt_token_ids)[-self._NUM_PROMPT_CONTEXT_TOKENS:]
        self._prefix_offset = 0
        self._read_offset = len(self._window_ids)
        self._parts: list[str] = []

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._parts)

    def push(self, new_token_ids: Sequence[int]) -> str:
        """Add generated ids; return the newly complete text (possibly "")."""
        self._window_ids.extend(new_token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """Emit whatever is held back (a dangling partial character becomes U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        decode = self._tokenizer.decode
        skip = self._skip_special_tokens
        prefix_text = decode(self._window_ids[self._prefix_offset:self._read_offset], skip)
        new_text = decode(self._window_ids[self._prefix_offset:], skip)
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not final):
            return ""
        delta = new_text[len(prefix_text):]
        # The just-emitted tokens become the next window's context; older ids are no longer needed.
        del self._window_ids[:self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._window_ids)
        self._parts.append(delta)
        return delta
