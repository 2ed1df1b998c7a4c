"""The OpenAI-compatible HTTP front end over the engine (`quantspec serve`).

`server.py` loads the model and runs uvicorn; `loop.py` steps the engine in its own thread and
takes requests in at step boundaries; `app.py` holds the routes, `protocol.py` the request
schemas, `jobs.py` a request's checks and engine jobs, `tools.py` forced tool calls, `text.py`
prompts and streamed text, `metrics.py` the Prometheus metrics.
"""

from quantspec.serve.server import ServeConfig, build, load, run

__all__ = ["ServeConfig", "build", "load", "run"]
