"""A calibration table that was not measured for how an engine runs is logged loudly and labelled in
/metrics, on the endpoint served without Ray (``--no-ray``: LocalEngineClient + the ingress, real
uvicorn, the openai client); a matching table carries an empty label."""

from __future__ import annotations

import logging
import re

import httpx
import openai
from conftest import ENGINE_OPTIONS
from fleet_helpers import stale_table

from bole.engine.async_engine import AsyncEngine
from bole.llm import build_engine
from deployments.engine_client import LocalEngineClient
from deployments.ingress import openai_app


def table_info(url: str) -> dict:
    line = next(x for x in httpx.get(url + "/metrics").text.splitlines()
                if x.startswith("bole_calibration_table_info{"))
    return dict(re.findall(r'(\w+)="([^"]*)"', line))


def test_mismatched_table_warns_and_is_labelled(tiny_model, serve_app, tmp_path, caplog):
    wrong = stale_table(tmp_path / "wrong.yaml", tiny_model, "a100", dtype="bfloat16", tp_size=2)
    right = stale_table(tmp_path / "right.yaml", tiny_model, "cpu")
    engine = build_engine(tiny_model, **{**ENGINE_OPTIONS, "calibration_table": wrong})
    with caplog.at_level(logging.WARNING, logger="deployments.engine_client"):
        client = LocalEngineClient(AsyncEngine(engine))   # hardware class: detected, "cpu"
    assert "CALIBRATION TABLE MISMATCH" in caplog.text and "tp_size 2 (runs 1)" in caplog.text
    with serve_app(openai_app(client, "tiny", api_key="")) as srv:
        oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        assert oai.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=2).usage.completion_tokens >= 1
        info = table_info(srv.url)
        assert info["mismatch"] == "dtype,tp_size,hardware" and info["table_id"].startswith("a100/tiny/bfloat16/tp2")
        client.async_engine.set_calibration(engine.calibration.load(right))   # swapped between steps
        info = table_info(srv.url)
        assert info["mismatch"] == "" and info["table_id"].startswith("cpu/tiny/float32/tp1")
    client.async_engine.shutdown()
