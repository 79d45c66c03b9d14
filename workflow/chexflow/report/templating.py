"""The Jinja2 templates (package data under ``templates/``) and the small formatters they use."""
from __future__ import annotations

import json
import math
from importlib import resources
from typing import Any

import jinja2
import numpy as np
import yaml

TEMPLATE_NAME = "report.html.j2"
MODEL_CARD_TEMPLATE = "model_card.md.j2"


def hms(seconds: float | None) -> str:
    if seconds is None or math.isnan(seconds):
        return "n/a"
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"



def mean_of(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return float(np.mean(vals)) if vals else None



def config_yaml(config: dict[str, Any]) -> str:
    plain = json.loads(json.dumps(config, default=str))  # Paths etc. -> str
    return yaml.safe_dump(plain, sort_keys=False, default_flow_style=False, allow_unicode=True)


def fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        return f"{value:.{digits}f}"
    return str(value)


def signed(value: Any, digits: int = 4) -> str:
    return "n/a" if value is None else f"{value:+.{digits}f}"


def interval(value: Any, digits: int = 3) -> str:
    """A CI as "low-high": ``value`` a [low, high] pair, or a record entry with ``ci`` (and ``too_few``: the
    small-count rule's words, shown instead); "n/a" where there is none. Never a made-up interval."""
    if isinstance(value, dict):
        if value.get("too_few"):
            return str(value["too_few"])
        value = value.get("ci")
    if not value or value[0] is None:
        return "n/a"
    return f"{value[0]:.{digits}f}-{value[1]:.{digits}f}"


def environment() -> jinja2.Environment:
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True,
                             lstrip_blocks=True, loader=jinja2.PackageLoader("chexflow.report", "templates"))
    env.filters["fmt"] = fmt
    env.filters["signed"] = signed
    env.filters["interval"] = interval
    return env


def template(name: str = TEMPLATE_NAME, *, html: bool = True) -> jinja2.Template:
    template_file = resources.files("chexflow.report").joinpath("templates").joinpath(name)
    source = template_file.read_text(encoding="utf-8")
    env = environment()
    env.autoescape = html          # the model card is Markdown: no HTML escaping
    return env.from_string(source)

