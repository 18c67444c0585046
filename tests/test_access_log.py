"""The Ingress's access log (serve_app/http/access_log.py): one INFO line per finished request,
with method, route, status, tokens and latency, and never the prompt's or the output's text.

The Ingress runs as in tests/test_serve_ingress.py: over raw ASGI with a fake engine (no Ray).
"""
import asyncio
import contextlib
import logging
import re

import pytest

from serve_app.http.access_log import logger as access_logger
from tests.test_serve_ingress import FakeEngine, _post, start_ingress  # noqa: F401 - the fixture

pytestmark = pytest.mark.filterwarnings("ignore:coroutine '.*__del__' was never awaited:RuntimeWarning")

PROMPT = "Hello"  # what _post sends; its text must never be logged
LINE = re.compile(r"^POST /v1/completions (\d{3}) prompt_tokens=(\S+) completion_tokens=(\S+) "
                  r"latency=(\d+\.\d{3})s id=(\S+)$")


@pytest.fixture
def access_lines(caplog):
    """The access log's records."""
    with caplog.at_level(logging.INFO, logger=access_logger.name):
        yield lambda: [r for r in caplog.records if r.name == access_logger.name]


def _fields(record) -> tuple:
    assert record.levelno == logging.INFO and PROMPT not in record.getMessage() and "Hi" not in record.getMessage()
    m = LINE.match(record.getMessage())
    assert m, record.getMessage()
    return int(m[1]), m[2], m[3], m[5]


@pytest.mark.parametrize("stream", [False, True])
def test_a_finished_request_is_one_line_with_its_tokens(start_ingress, access_lines, stream):
    async def run():
        engine = FakeEngine()
        engine.finish = True  # one token ("Hi"), then finished
        ingress = await start_ingress(engine)
        await _post(ingress, {"stream": stream})
        return ingress

    ingress = asyncio.run(run())
    (record,) = access_lines()
    status, prompt_tokens, completion_tokens, request_id = _fields(record)
    num_prompt_tokens = len(ingress.tokenizer(PROMPT)["input_ids"])
    assert (status, prompt_tokens, completion_tokens) == (200, str(num_prompt_tokens), "1")
    assert request_id.startswith("cmpl-")
    assert record.msg.count("%") >= 5 and record.args  # lazy %-style: formatted only if emitted


def test_a_client_gone_mid_stream_is_a_499_line(start_ingress, access_lines):
    async def run():
        ingress = await start_ingress(FakeEngine())
        await _post(ingress, {"stream": True}, client_gone="mid_stream")

    asyncio.run(run())
    (record,) = access_lines()
    status, prompt_tokens, completion_tokens, _ = _fields(record)
    assert (status, completion_tokens) == (499, "1") and int(prompt_tokens) > 0


def test_an_error_answer_is_one_line(start_ingress, access_lines):
    async def run():
        ingress = await start_ingress(FakeEngine())
        with contextlib.suppress(Exception):
            await _post(ingress, {"temperature": -1})  # refused by validation: 400

    asyncio.run(run())
    (record,) = access_lines()
    assert _fields(record) == (400, "-", "-", "-")


def test_nothing_is_logged_below_info(start_ingress, caplog):
    async def run():
        engine = FakeEngine()
        engine.finish = True
        await _post(await start_ingress(engine), {"stream": True})

    with caplog.at_level(logging.WARNING, logger=access_logger.name):
        asyncio.run(run())
    assert not [r for r in caplog.records if r.name == access_logger.name]
