"""The application with a test-only EngineDeployment that can be made to fail.

`fault_app(args)` builds the app as serve_app.app.build_app does, with FaultyEngineDeployment
in place of the EngineDeployment (same name, options and placement): the fault tests
(tests/test_serve_faults.py) reach the real failure paths through it, and the production
class has no test entry points. Its replicas import this module by name: the repository root
is on their PYTHONPATH (serve_app/local.py).
"""
from __future__ import annotations

import functools
import os
from typing import Any
from unittest import mock

from ray import serve

import serve_app.app
from engine.entrypoints.async_llm import AsyncLLM
from serve_app.replica.engine_deployment import EngineDeployment
from tests.faults import StepFaultEngineCore, fail_next_step


@serve.deployment(name=EngineDeployment.name)
class FaultyEngineDeployment(EngineDeployment.func_or_class):
    def __init__(self, *args: Any, **kwargs: Any):
        # Its engine runs a step loop that fail_next_step can reach, in the engine process too. The
        # class is patched, not the module's name: Ray ships the deployment's classes by value, the
        # functions with copies of their module's globals.
        faulty_init = functools.partialmethod(AsyncLLM.__init__, engine_core_class=StepFaultEngineCore)
        with mock.patch.object(AsyncLLM, "__init__", faulty_init):
            super().__init__(*args, **kwargs)

    async def pids(self) -> dict[str, Any]:
        """This replica's pid, its engine process's and its TP workers'."""
        return {"replica": os.getpid(), "engine": self.llm.engine_pid, "tp_workers": self.llm.worker_pids}

    async def fail_next_step(self) -> None:
        """The engine's step loop raises at its next step, as a bug there would."""
        await fail_next_step(self.llm, RuntimeError("fault injected by a test"))


def fault_app(args: dict[str, Any]) -> serve.Application:
    """build_app(args) with FaultyEngineDeployment as the engine deployment."""
    original = serve_app.app.EngineDeployment
    serve_app.app.EngineDeployment = FaultyEngineDeployment
    try:
        return serve_app.app.build_app(args)
    finally:
        serve_app.app.EngineDeployment = original
