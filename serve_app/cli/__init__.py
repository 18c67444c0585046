"""`rayllm`: the command line of the project, one module per verb.

    rayllm serve MODEL [--max-num-seqs 64 ...]   serve a model (serve.py)
    rayllm chat | complete PROMPT | models      talk to a running server (chat.py, complete.py, models.py)
    rayllm bench ... | batch ...                the load test and the batch job (bench.py, batch.py)
"""
