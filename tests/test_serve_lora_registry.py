"""serve_app/lora/registry.py: names to LoRARequests, and ids that never mean two adapters."""
import pytest

from engine import LoRARequest
from serve_app.lora.registry import AdapterNotFoundError, LoRARegistry


def test_lora_modules_get_ids_in_order_and_the_base_model_none():
    registry = LoRARegistry("base", {"sql": "/a/sql", "chat": "/a/chat"})
    assert registry.resolve("sql") == LoRARequest("sql", 1, "/a/sql")
    assert registry.resolve("chat") == LoRARequest("chat", 2, "/a/chat")
    assert registry.resolve("base") is None
    with pytest.raises(AdapterNotFoundError):
        registry.resolve("nope")
    # Every replica builds its registry from the same args: the same ids.
    assert LoRARegistry("base", {"sql": "/a/sql", "chat": "/a/chat"}).adapters() == registry.adapters()


def test_an_id_is_never_reused_after_an_unload():
    registry = LoRARegistry("base", {"sql": "/a/sql"})
    registry.add(registry.new_adapter("x", "/a/x"))
    assert registry.remove("sql") == LoRARequest("sql", 1, "/a/sql")
    registry.add(registry.new_adapter("sql", "/a/sql-v2"))  # the same name again: a new adapter
    assert [(a.lora_name, a.lora_int_id) for a in registry.adapters()] == [("x", 2), ("sql", 3)]
    with pytest.raises(AdapterNotFoundError):
        registry.remove("gone")


def test_a_name_taken_or_the_base_models_is_refused():
    registry = LoRARegistry("base", {"sql": "/a/sql"})
    for name, message in (("sql", "The lora adapter 'sql' has already been loaded."),
                          ("base", "is the base model's name"), ("", "non-empty")):
        with pytest.raises(ValueError, match=message):
            registry.new_adapter(name, "/a/x")
    lora = registry.new_adapter("late", "/a/late")
    registry.add(registry.new_adapter("late", "/a/other"))  # another load of the name got there first
    with pytest.raises(ValueError, match="already been loaded"):
        registry.add(lora)
    with pytest.raises(ValueError, match="base model's name"):
        LoRARegistry("base", {"base": "/a/b"})
