"""Tokenizer and chat template from a model directory. Torch-free: the gateway
tokenizes with it."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


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
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        """A conversation as the model's prompt: its chat template applied,
        then encoded (the template writes the special tokens itself).
        ``tools``: OpenAI tool definitions, given to the template as ``tools``."""
        extra = {} if tools is None else {"tools": tools}
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **extra),
                           add_special_tokens=False)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        _check_messages(messages)
        return self._compiled_template().render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra,
        )


    def _compiled_template(self):
        """Compiled on first use and kept: not once per chat request."""
        if self._template is not None:
            return self._template
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(self.chat_template)
        return self._template


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
