"""Prompts to token ids (vLLM's input preprocessing): text through the tokenizer, chat
messages through the chat template with its controls, token ids checked against the
vocabulary, and the result checked against max_model_len. Every refusal is a ValueError
naming the field."""
from __future__ import annotations

from typing import Any

Prompt = Any   # str | list[dict] (chat messages) | list[int] (token ids)


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, model_name: str):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.model_name = model_name

    def __call__(self, prompt: Prompt, *, add_generation_prompt: bool = True,
                 continue_final_message: bool = False, chat_template: str | None = None,
                 chat_template_kwargs: dict | None = None, add_special_tokens: bool | None = None,
                 truncate_prompt_tokens: int | None = None, tools: list[dict] | None = None,
                 check_length: bool = True) -> list[int]:
        """Text, chat messages (through the chat template) or token ids -> token ids.

        Chat messages are rendered by the tokenizer's chat template (or `chat_template`, a
        Jinja template text), with `add_generation_prompt` (open an assistant turn),
        `continue_final_message` (end on the last, assistant, message unclosed, so the model
        continues it) and `chat_template_kwargs` (extra template variables) and `tools` (function
        tools, for a template that renders them), as in HF's apply_chat_template. `add_special_tokens`: let the tokenizer add its special tokens
        (BOS...) while encoding; by default yes for text, no for rendered chat (the template
        writes them). `truncate_prompt_tokens`: keep only the last k tokens (-1: as many as
        max_model_len allows), a request's SamplingParams.truncate_prompt_tokens (checked
        there). `check_length`: refuse
        a prompt that leaves no room to generate (False: just count, as /tokenize does)."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            ids = self._need_tokenizer().encode(
                prompt, add_special_tokens=True if add_special_tokens is None else add_special_tokens)
        elif isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
            text = self._render_chat(list(prompt), add_generation_prompt, continue_final_message,
                                     chat_template, chat_template_kwargs, tools)
            ids = self._need_tokenizer().encode(text, add_special_tokens=bool(add_special_tokens))
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError("prompt: a list prompt must hold token ids (ints) or chat messages")
            vocab = self.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt: token id {bad[0]} is outside the vocabulary [0, {vocab})")
        else:
            raise ValueError(f"prompt: must be text, chat messages or token ids "
                             f"(got {type(prompt).__name__})")
        if truncate_prompt_tokens is not None:
            keep = self.max_model_len - 1 if truncate_prompt_tokens == -1 else truncate_prompt_tokens
            ids = ids[-keep:]
        if not ids:
            raise ValueError("prompt: must not be empty")
        if check_length and len(ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens, but max_model_len is "
                             f"{self.max_model_len} (prompt + at least one new token must fit)")
        return ids

    CHAT_RESERVED = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                               "add_generation_prompt", "continue_final_message", "tokenize",
                               "padding", "truncation", "max_length", "return_tensors",
                               "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})
    """apply_chat_template's own arguments: not template variables for chat_template_kwargs."""

    def _render_chat(self, messages: list[dict], add_generation_prompt: bool,
                     continue_final_message: bool, chat_template: str | None,
                     chat_template_kwargs: dict | None, tools: list[dict] | None = None) -> str:
        tok = self._need_tokenizer()
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ValueError("prompt: chat messages must be dicts with a string 'role'")
            if "content" not in m and not m.get("tool_calls"):
                raise ValueError("prompt: a chat message needs 'content' (or 'tool_calls')")
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message: cannot be combined with "
                             "add_generation_prompt (set that to false)")
        if continue_final_message and messages[-1]["role"] != "assistant":
            raise ValueError("continue_final_message: the last message must be the assistant's "
                             f"(got role {messages[-1]['role']!r})")
        if not isinstance(chat_template_kwargs or {}, dict):
            raise ValueError("chat_template_kwargs: must be a dict")
        kwargs = dict(chat_template_kwargs or {})
        clash = sorted(set(kwargs) & self.CHAT_RESERVED)
        if clash:
            raise ValueError(f"chat_template_kwargs: {clash[0]!r} is an argument of the "
                             "template call itself, not a template variable")
        if chat_template is not None and (not isinstance(chat_template, str) or not chat_template):
            raise ValueError("chat_template: must be a non-empty Jinja template text")
        if chat_template is None and getattr(tok, "chat_template", None) is None:
            raise ValueError(f"prompt: model {self.model_name!r} has no chat template")
        try:
            return tok.apply_chat_template(messages, tokenize=False, chat_template=chat_template,
                                           add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message,
                                           tools=tools, **kwargs)
        except Exception as e:
            from jinja2 import TemplateError
            if chat_template is not None and isinstance(e, TemplateError):
                raise ValueError(f"chat_template: {type(e).__name__}: {e}") from None
            if continue_final_message and isinstance(e, ValueError):
                # HF cannot find the final message in the rendered text.
                raise ValueError(f"continue_final_message: {e}") from None
            raise

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError(f"prompt: model {self.model_name!r} has no tokenizer; "
                             "pass token ids instead of text")
        return self.tokenizer
