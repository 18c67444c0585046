"""serve_app/lora/adapters.py: the forms of lora_modules, an adapter directory's files, the allowed
directory of runtime loads (no Ray, no model)."""
import json
import os
import struct

import pytest

from serve_app.lora.adapters import check_adapter_dir, parse_lora_modules, resolve_under

EXPECTED = {"sql": "/a/sql", "chat": "/a/chat"}


def write_adapter_files(directory, config: dict | str | None = None, header: bytes | None = b"{}") -> str:
    """An adapter directory with the two files PEFT writes (header only: no tensors); None leaves a file out."""
    os.makedirs(directory, exist_ok=True)
    if config is not None:
        text = config if isinstance(config, str) else json.dumps(config)
        (directory / "adapter_config.json").write_text(text)
    if header is not None:
        (directory / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    return str(directory)


@pytest.mark.parametrize("value", [
    EXPECTED,                                                                   # a Serve config's mapping
    ["sql=/a/sql", "chat=/a/chat"],                                             # --lora-modules words
    ['{"name": "sql", "path": "/a/sql"}', '{"name": "chat", "path": "/a/chat", "base_model_name": "b"}'],
    [{"name": "sql", "path": "/a/sql"}, "chat=/a/chat"],
    "sql=/a/sql chat=/a/chat",                                                  # serve run ... lora_modules=...
    json.dumps(EXPECTED),
    json.dumps([{"name": "sql", "path": "/a/sql"}, {"name": "chat", "path": "/a/chat"}]),
])
def test_every_form_of_lora_modules_gives_names_in_order(value):
    modules = parse_lora_modules(value)
    assert modules == EXPECTED and list(modules) == ["sql", "chat"]


def test_one_json_object_is_one_adapter_not_a_mapping():
    assert parse_lora_modules({"name": "sql", "path": "/a/sql"}) == {"sql": "/a/sql"}


@pytest.mark.parametrize("value, named", [
    (["sql"], "lora_modules entry 'sql' is invalid: expected name=path"),
    (["=/a/sql"], "adapter name '' is invalid"),
    (["sql="], "adapter 'sql' has no path"),
    (["sql=/a", "sql=/b"], "adapter 'sql' is given twice"),
    (['{"name": "sql"}'], "expected {\"name\": ..., \"path\": ...}"),
    ("[oops", "is not valid JSON"),
    (7, "lora_modules=7 is invalid"),
])
def test_a_bad_entry_is_named(value, named):
    with pytest.raises(ValueError) as info:
        parse_lora_modules(value)
    assert named in str(info.value)


def test_bad_entries_name_the_flag_they_came_from():
    with pytest.raises(ValueError, match="--lora entry 'sql' is invalid"):
        parse_lora_modules(["sql"], "--lora")


def test_adapter_directory_problems_name_the_file(tmp_path):
    check_adapter_dir(write_adapter_files(tmp_path / "good", {"r": 8}))
    cases = {
        "missing": (None, "is not a directory"),
        "no-config": (write_adapter_files(tmp_path / "no-config", None), "adapter_config.json cannot be read"),
        "bad-json": (write_adapter_files(tmp_path / "bad-json", "{r: 8"), "adapter_config.json is not valid JSON"),
        "list": (write_adapter_files(tmp_path / "list", "[1]"), "adapter_config.json is not a JSON object"),
        "no-weights": (write_adapter_files(tmp_path / "no-weights", {"r": 8}, header=None),
                       "adapter_model.safetensors cannot be read"),
        "not-safetensors": (write_adapter_files(tmp_path / "not-safetensors", {"r": 8}, header=b"nope"),
                            "adapter_model.safetensors is not a safetensors file"),
    }
    for name, (path, message) in cases.items():
        with pytest.raises(ValueError) as info:
            check_adapter_dir(path or str(tmp_path / name))
        assert message in str(info.value) and name in str(info.value), name


def test_paths_resolve_inside_the_allowed_directory_or_are_refused(tmp_path):
    allowed = tmp_path / "adapters"
    (allowed / "sql").mkdir(parents=True)
    (tmp_path / "secret").mkdir()
    os.symlink(tmp_path / "secret", allowed / "link-out")
    os.symlink(allowed / "sql", tmp_path / "link-in")
    assert resolve_under("sql", str(allowed)) == str(allowed / "sql")            # relative: to the directory
    assert resolve_under(str(allowed / "sql"), str(allowed)) == str(allowed / "sql")
    assert resolve_under(str(tmp_path / "link-in"), str(allowed)) == str(allowed / "sql")  # lands inside
    for outside in ("../secret", str(tmp_path / "secret"), "link-out", "sql/../../secret", "/etc"):
        with pytest.raises(ValueError, match="outside the directory adapters may be loaded from"):
            resolve_under(outside, str(allowed))
    # a sibling whose name starts with the allowed directory's is outside too
    (tmp_path / "adapters-other").mkdir()
    with pytest.raises(ValueError, match="outside"):
        resolve_under(str(tmp_path / "adapters-other"), str(allowed))
