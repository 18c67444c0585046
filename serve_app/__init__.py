"""The serving graph: an OpenAI-compatible Ray Serve application in front of the engine.

    serve run deploy/config.yaml            (or: serve_app.app:build_app key=value ...)
"""
