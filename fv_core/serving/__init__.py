"""HTTP serving: an OpenAI-compatible FastAPI app over the asyncio engine, with a durable job store.

Needs the `serve` extra (`pip install fv-core[serve]`): import `fv_core.serving.app.create_app`.
"""
