"""Offline batch jobs on Ray Data: the engine in actors, the guardrail's JSON validation after it.

    python -m serve_app.batch --model DIR --input docs.jsonl --output out/ --template t.j2

or from Python: `build_processor(BatchConfig(...))(dataset)`, `run_job(config, input, output)`.
docs/batch.md has the walk-through.
"""
from serve_app.batch.config import BatchConfig
from serve_app.batch.inputs import read_input, with_position_ids
from serve_app.batch.job import JobSummary, run_job
from serve_app.batch.processor import Processor, build_processor

__all__ = ["BatchConfig", "JobSummary", "Processor", "build_processor", "read_input", "run_job",
           "with_position_ids"]
