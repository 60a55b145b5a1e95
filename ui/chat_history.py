"""The page's chat box, which refuses a history it never sent in one line.

Gradio checks a Chatbot's incoming history against its own model before any handler runs; a history
the page never sends (a made-up role, a number for a message) failed there with a validation error
and its traceback in the server's log on every call. This Chatbot takes any value in, checks it
itself and refuses a bad one with one `gr.Error` line (no traceback); the browser sees the same
component (a template of gradio's Chatbot).
"""

from __future__ import annotations

from typing import Any

import gradio as gr
from gradio.components.chatbot import ChatbotDataMessages
from gradio.data_classes import GradioRootModel
from pydantic import ValidationError

REFUSED = "the chat history is not one the page sent; clear the chat and ask again"


class AnyHistory(GradioRootModel):
    """Whatever a client sent as the history, checked by `PageChatbot.preprocess`."""

    root: Any = None


class PageChatbot(gr.Chatbot):
    """gr.Chatbot whose bad incoming history is one line."""

    is_template = True  # gradio's own Chatbot in the browser
    data_model = AnyHistory

    def preprocess(self, payload: Any) -> Any:
        raw = payload.root if isinstance(payload, GradioRootModel) else payload
        if raw is None:
            return super().preprocess(None)
        try:
            history = ChatbotDataMessages.model_validate(raw, context={"validate_meta": True})
        except ValidationError:
            raise gr.Error(REFUSED, print_exception=False) from None
        return super().preprocess(history)
