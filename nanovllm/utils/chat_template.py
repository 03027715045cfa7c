"""The one place a conversation becomes prompt token ids: the tokenizer's chat template (or a
request's own), rendered to text and encoded. LLM.chat, the async engine and the server's chat and
/tokenize routes all call render_chat; every way it can fail is a ValueError saying why."""
from typing import Any


def render_chat(tokenizer: Any, conversation: list[dict], *, tools: list[dict] | None = None,
                documents: list[dict] | None = None, chat_template: str | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                add_special_tokens: bool = False, template_kwargs: dict | None = None) -> list[int]:
    """The token ids of conversation through the chat template. add_special_tokens: also the
    tokenizer's own (a BOS the template may already write; transformers' tokenize=True leaves them out)."""
    from jinja2 import TemplateError

    if tokenizer is None:
        raise ValueError("this model has no tokenizer: only token ids are understood, not messages")
    if getattr(tokenizer, "chat_template", None) is None and chat_template is None:
        raise ValueError("this model's tokenizer has no chat template; give plain prompts instead of messages")
    if continue_final_message and conversation[-1].get("role") != "assistant":
        raise ValueError("continue_final_message needs the last message to be the assistant's, got role "
                         f"{conversation[-1].get('role')!r}")
    try:
        text = tokenizer.apply_chat_template(
            conversation, tools=tools, documents=documents, chat_template=chat_template,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            tokenize=False, **(template_kwargs or {}))
    except TemplateError as e:  # e.g. the template's own raise_exception("roles must alternate")
        raise ValueError(f"chat template failed on these messages: {e}") from e
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
