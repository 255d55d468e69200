"""Serve config overlays: one topology file, other settings for another place.

``make serve-mixed`` runs ``cluster_configs/mixed.yaml`` (the real A100 / GB10 fleet) on one CPU
machine through ``cluster_configs/overlays/mixed-cpu.yaml``, so the simulation cannot drift from the
fleet: only what the overlay names changes. ``load_config(base, [overlay, ...])`` merges:

  mappings           key by key, recursively; a key set to null in the overlay is removed
  lists of mappings  whose every item has a ``name`` (applications, groups, ``deployments:``) item by
                     item, matched by name; overlay items with a new name are appended
  anything else      the overlay's value replaces the base's (bundle lists, scalars)

The result is validated as Serve's ``ServeDeploySchema`` and every application's ``args`` as
``deployments.app.AppConfig``, the same checks ``serve run`` / ``make serve`` apply;
``serve_schema=False`` (``--no-ray``, which serves the first group in-process on a machine that may
lack Ray) checks the ``args`` only. Ray resources of
the replica deployments are best overridden in the application's ``deployments:`` section, Serve's
own per-deployment override mechanism (it takes precedence over what ``build_app`` sets).
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

_DELETE = None


def _named_list(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) and "name" in v for v in value)


def merge(base: Any, overlay: Any) -> Any:
    """``overlay`` applied to ``base`` (neither is modified); see the module docstring."""
    if isinstance(base, dict) and isinstance(overlay, dict):
        out = copy.deepcopy(base)
        for k, v in overlay.items():
            if v is _DELETE:
                out.pop(k, None)
            elif k in out:
                out[k] = merge(out[k], v)
            else:
                out[k] = copy.deepcopy(v)
        return out
    if _named_list(base) and _named_list(overlay):
        out = [copy.deepcopy(b) for b in base]
        index = {b["name"]: i for i, b in enumerate(out)}
        for item in overlay:
            if item["name"] in index:
                out[index[item["name"]]] = merge(out[index[item["name"]]], item)
            else:
                out.append(copy.deepcopy(item))
        return out
    return copy.deepcopy(overlay)


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"{path}: cannot read the Serve config ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a Serve config must be a mapping, got {type(data).__name__}")
    return data


def load_config(path: str, overlays: list[str] | tuple[str, ...] = (), serve_schema: bool = True) -> dict:
    """The Serve config at ``path`` with ``overlays`` applied in order, validated; a plain dict."""
    from deployments.app import AppConfig

    cfg = _read(path)
    for o in overlays:
        cfg = merge(cfg, _read(o))
    where = " + ".join([path, *overlays])
    try:
        if serve_schema:
            from ray.serve.schema import ServeDeploySchema

            ServeDeploySchema.model_validate(cfg)
        for app in cfg.get("applications") or []:
            AppConfig(**(app.get("args") or {}))
    except ValueError as e:  # pydantic's ValidationError is a ValueError
        raise ValueError(f"{where}: {e}") from None
    return cfg
