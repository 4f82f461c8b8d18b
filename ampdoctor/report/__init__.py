"""Reporters: backends that turn a Report (or step records) into something a person reads.

Each backend is one module with its heavy import inside it: `html` (jinja2, one self-contained file),
`plots` (matplotlib PNGs), `tensorboard` (SummaryWriter scalars, live or after the fact), `text` (terminal).
`panels` holds the data shaping they share (number coercion, worst-value downsampling).
"""
from __future__ import annotations

from .html import render_html, write_html
from .plots import render_plots, write_plots
from .tensorboard import TensorBoardSink, write_tensorboard
from .text import render_text

__all__ = ["write_html", "render_html", "write_plots", "render_plots", "TensorBoardSink", "write_tensorboard",
           "render_text"]
