"""`python -m serve_app.cli ...`: the same as `rayllm ...`."""
from serve_app.cli.main import console_main

console_main()
