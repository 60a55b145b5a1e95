"""Gradio browser chat on the lvx engine."""
