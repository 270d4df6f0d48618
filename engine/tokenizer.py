"""Tokenizer and chat template from a model directory. Torch-free: the gateway
tokenizes with it."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's spelling of bytes (GPT-2's), inverted: a printable
    byte other than space is its own character; the k-th of the other 68
    bytes is chr(256 + k)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    spelling = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in spelling.values()]
    spelling.update({chr(256 + k): b for k, b in enumerate(others)})
    return spelling


_BYTE_LEVEL = _byte_level_alphabet()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{model_dir} has no tokenizer.json")
        self._tok = HFTokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.chat_template: str | None = cfg.get("chat_template")
        if isinstance(self.chat_template, list):  # [{name, template}, ...]
            self.chat_template = next(
                (t["template"] for t in self.chat_template if t.get("name") == "default"), None
            )
        self._template = None
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.special_ids = {
            i for i, t in self._tok.get_added_tokens_decoder().items() if t.special
        }
        eos_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.eos_token_id: int | None = eos_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # NOTE: encode_batch, not encode: the same ids, but it lets go of the
        # GIL while it works, so a long prompt tokenized on the gateway's
        # tokenizer threads does not stop its event loop (and every other
        # request's stream) for the whole encode.
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, also where they are only part of
        a character (its decoded text alone is then U+FFFD): OpenAI's
        logprob ``bytes``, with which a client joins split characters back."""
        text = self.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text.encode()
        piece = self.id_to_token(token_id) or ""
        if (byte := _BYTE_PIECE.fullmatch(piece)) is not None:  # SentencePiece's <0xF0>
            return bytes([int(byte.group(1), 16)])
        if piece and all(ch in _BYTE_LEVEL for ch in piece):  # GPT-2's byte alphabet
            return bytes(_BYTE_LEVEL[ch] for ch in piece)
        return text.encode()

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest token's spelling in the vocabulary, in characters: no
        token decodes to more (a byte-level or byte-fallback spelling is at
        least as long as its text), so a text of ``k * max_token_chars``
        characters takes more than ``k`` tokens, normalizers aside."""
        return max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)

    # ---- a few of Hugging Face's tokenizer calls, for code written against them ----

    def __len__(self) -> int:
        return self.vocab_size

    def __call__(self, text: str | list[str], add_special_tokens: bool = True) -> Encoding:
        """``{"input_ids": ..., "attention_mask": ...}`` of a text or a list of
        them, also as attributes (``tok(text).input_ids``, as Hugging Face's)."""
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens)
            return Encoding(input_ids=ids, attention_mask=[1] * len(ids))
        ids = [e.ids for e in self._tok.encode_batch(list(text),
                                                     add_special_tokens=add_special_tokens)]
        return Encoding(input_ids=ids, attention_mask=[[1] * len(i) for i in ids])

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | None | list[str | None]:
        return self.id_to_token(ids) if isinstance(ids, int) else [self.id_to_token(i) for i in ids]

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None, **options: Any) -> list[int]:
        """A conversation as the model's prompt: its chat template applied,
        then encoded (the template writes the special tokens itself).
        ``tools``: OpenAI tool definitions, given to the template as ``tools``;
        ``options``: ``apply_chat_template``'s."""
        if tools is not None:
            options["tools"] = tools
        return self.apply_chat_template(messages, add_generation_prompt, tokenize=True, **options)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *,
        template: str | None = None, continue_final_message: bool = False,
        tokenize: bool = False, chat_template: str | None = None, **extra: Any
    ) -> str | list[int]:
        """The conversation rendered by the model's chat template (or
        ``template``, or Hugging Face's name for it, ``chat_template``: it
        was taken for a template variable and ignored); ``extra``: more
        variables for the template.
        ``continue_final_message``: the text ends where the last message's
        content does, so that the model goes on with it. ``tokenize``: its
        token ids instead (NOTE: text by default, unlike Hugging Face's)."""
        template = template or chat_template
        if not (template or self.chat_template):
            raise ValueError("this model has no chat template; send a plain prompt instead")
        _check_messages(messages)
        compiled = self._compiled_template() if template is None else _compile(template)
        text = compiled.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra,
        )
        if continue_final_message:
            text = _up_to_final_message(text, messages[-1]["content"])
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _compiled_template(self):
        """Compiled on first use and kept: not once per chat request."""
        if self._template is None:
            self._template = _compile(self.chat_template)
        return self._template


class Encoding(dict):
    """What calling a tokenizer returns: a dict whose keys are attributes too."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


@dataclasses.dataclass(frozen=True)
class ChatOptions:
    """How a conversation is rendered: vLLM's chat arguments."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    variables: dict[str, Any] = dataclasses.field(default_factory=dict)  # more for the template

    @classmethod
    def of(cls, add_generation_prompt: bool = True, continue_final_message: bool = False,
           chat_template_kwargs: dict[str, Any] | None = None) -> ChatOptions:
        """The options of a chat call. ``chat_template_kwargs`` may carry the
        first two as well (they are template variables too, and vLLM takes
        them from there). ValueError for a variable the rendering sets
        itself, or for both ways of ending the text at once."""
        variables = dict(chat_template_kwargs or {})
        add_generation_prompt = variables.pop("add_generation_prompt", add_generation_prompt)
        continue_final_message = variables.pop("continue_final_message", continue_final_message)
        taken = sorted(set(variables) & _RENDERING_OWN)
        if taken:
            raise ValueError(f"chat_template_kwargs: {taken} are set by the chat rendering itself")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message goes on with the last message: it needs "
                             "add_generation_prompt false")
        return cls(bool(add_generation_prompt), bool(continue_final_message), variables)

    def variables_with(self, tools: list[dict[str, Any]] | None) -> dict[str, Any]:
        """The template's variables, with ``tools`` where there are any."""
        return self.variables if tools is None else {**self.variables, "tools": tools}


# Template variables and arguments the rendering sets: not for chat_template_kwargs.
_RENDERING_OWN = frozenset({"messages", "tools", "template", "tokenize", "bos_token",
                            "eos_token"})


def _compile(template: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _up_to_final_message(text: str, content: str) -> str:
    """``text`` cut after its last copy of ``content`` (the final message's),
    its leading and, where the template kept it, trailing space included."""
    core = content.strip()
    at = text.rfind(core) if core else -1
    if at < 0:
        raise ValueError("continue_final_message: the chat template does not write the "
                         "final message's content as it is")
    kept = content.lstrip()
    return text[: at + len(kept)] if text.startswith(kept, at) else text[: at + len(core)]


def content_text(content: Any) -> str:
    """A chat message's content as text: a string, None (""), or OpenAI's
    list of text parts, one per line (as vLLM joins them); ValueError for
    any other part (an image)."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" \
                or not isinstance(part.get("text"), str):
            raise ValueError("only text parts are supported in a message's content")
        texts.append(part["text"])
    return "\n".join(texts)


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a string 'role'")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}].content must be a string")


def _raise(message: str) -> None:
    raise ValueError(message)


def _token_text(token: Any) -> str | None:
    if isinstance(token, dict):
        return token.get("content")
    return token
