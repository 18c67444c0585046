"""serve_app/http/served_models.py: a request's `model` resolved, the model list, and vLLM's runtime
load / unload of adapters with their statuses and messages (no Ray: a fake engine checks adapters)."""
import asyncio
import json

import pytest

from engine import LoRARequest
from serve_app.args import AppArgs
from serve_app.http.errors import OpenAIError
from serve_app.http.served_models import ServedModels
from tests.test_serve_lora_adapters import write_adapter_files


class FakeEngine:
    """The engine client's check_lora: refuses the adapters named in `refuse`, with the engine's words."""

    def __init__(self, refuse: dict[str, str] | None = None):
        self.refuse = refuse or {}
        self.checked: list[LoRARequest] = []

    async def check_lora(self, lora: LoRARequest) -> str | None:
        self.checked.append(lora)
        return self.refuse.get(lora.lora_name)


@pytest.fixture
def adapter_dir(tmp_path):
    root = tmp_path.resolve() / "adapters"  # as resolve_under gives it back, symlinks resolved
    write_adapter_files(root / "sql", {"r": 8})
    write_adapter_files(root / "chat", {"r": 4})
    return root


def _models(adapter_dir, engine=None, **args) -> ServedModels:
    args = {"model": "/models/base", "served_model_name": "base", "allow_runtime_lora_updating": True,
            "lora_adapter_dir": str(adapter_dir), **args}
    return ServedModels(AppArgs(**args), engine or FakeEngine())


def _call(coro) -> str | OpenAIError:
    try:
        return asyncio.run(coro)
    except OpenAIError as e:
        return e


def _load(models, **body):
    return _call(models.load(json.dumps(body).encode()))


def _unload(models, **body):
    return _call(models.unload(json.dumps(body).encode()))


def test_model_list_and_resolution(adapter_dir):
    models = _models(adapter_dir, lora_modules={"sql": str(adapter_dir / "sql")})
    cards = models.cards(max_model_len=512)
    assert [(c["id"], c["parent"], c["root"]) for c in cards] == [
        ("base", None, "/models/base"), ("sql", "base", str(adapter_dir / "sql"))]
    assert all(c["object"] == "model" and c["max_model_len"] == 512 for c in cards)
    assert models.card("sql", 512) == cards[1]
    assert models.resolve("base") is None and models.resolve("sql").lora_int_id == 1
    with pytest.raises(OpenAIError) as info:
        models.card("nope", 512)
    assert (info.value.status_code, info.value.body()["error"]) == (404, {
        "message": "The model `nope` does not exist.", "type": "NotFoundError", "param": "model", "code": 404})


def test_load_then_requests_run_it_and_unload_then_404(adapter_dir):
    engine = FakeEngine()
    models = _models(adapter_dir, engine, lora_modules={"chat": str(adapter_dir / "chat")})
    assert _load(models, lora_name="sql", lora_path="sql") == "Success: LoRA adapter 'sql' added successfully."
    lora = models.resolve("sql")
    assert lora == LoRARequest("sql", 2, str(adapter_dir / "sql")) and engine.checked == [lora]
    assert [c["id"] for c in models.cards(64)] == ["base", "chat", "sql"]
    assert _unload(models, lora_name="sql") == "Success: LoRA adapter 'sql' removed successfully."
    with pytest.raises(OpenAIError, match="does not exist"):
        models.resolve("sql")
    assert _load(models, lora_name="sql", lora_path=str(adapter_dir / "sql")).startswith("Success")
    assert models.resolve("sql").lora_int_id == 3  # loaded again: a new adapter to every engine cache
    assert _unload(models, lora_name="chat").startswith("Success")  # lora_modules' adapters too


def _error(result) -> tuple[int, str, str | None]:
    assert isinstance(result, OpenAIError), result
    return result.status_code, result.message, result.param


def test_refusals_have_vllms_statuses_and_name_what_is_wrong(adapter_dir, tmp_path):
    write_adapter_files(adapter_dir / "no-config", None)
    write_adapter_files(adapter_dir / "big", {"r": 64})
    (tmp_path / "elsewhere").mkdir()
    models = _models(adapter_dir, FakeEngine(refuse={"big": "LoRA adapter 'big': r=64 exceeds max_lora_rank=16"}),
                     lora_modules={"sql": str(adapter_dir / "sql")})
    assert _error(_load(models, lora_name="sql", lora_path="chat")) == (
        400, "The lora adapter 'sql' has already been loaded.", "lora_name")
    status, message, param = _error(_load(models, lora_name="base", lora_path="chat"))
    assert (status, param) == (400, "lora_name") and "base model's name" in message
    status, message, param = _error(_load(models, lora_name="x", lora_path=str(tmp_path / "elsewhere")))
    assert (status, param) == (400, "lora_path") and "outside the directory" in message
    assert _error(_load(models, lora_name="x", lora_path="../elsewhere"))[0] == 400
    status, message, param = _error(_load(models, lora_name="x", lora_path="no-config"))
    assert (status, param) == (400, "lora_path") and "adapter_config.json" in message
    assert _error(_load(models, lora_name="big", lora_path="big")) == (
        400, "LoRA adapter 'big': r=64 exceeds max_lora_rank=16", "lora_path")
    assert _error(_load(models, lora_name="x"))[2] == "lora_path"  # missing: named by the validation error
    assert _error(_load(models, lora_name="x", lora_path="chat", load_inplace=True))[2] == "load_inplace"
    status, message, _ = _error(_unload(models, lora_name="nope"))
    assert (status, message) == (404, "The lora adapter 'nope' cannot be found.")
    assert [c["id"] for c in models.cards(64)] == ["base", "sql"]  # nothing refused got registered


def test_runtime_updating_is_off_unless_the_app_allows_it(adapter_dir):
    models = _models(adapter_dir, allow_runtime_lora_updating=False)
    status, message, _ = _error(_load(models, lora_name="sql", lora_path="sql"))
    assert status == 404 and "allow_runtime_lora_updating" in message
    assert _error(_unload(models, lora_name="sql"))[0] == 404
