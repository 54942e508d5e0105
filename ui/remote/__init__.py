"""Remote mode (``app.py --backend-url``): the page in front of an OpenAI-compatible deployment (vLLM, SGLang,
a router, or this project's own server), with no model in this process.

- :mod:`ui.remote.client`: chats streamed over httpx, this page's request log, the load generator;
- :mod:`ui.remote.errors`: what an HTTP or network failure probably means, as a sentence before the technical text;
- :mod:`ui.remote.backend`: the chat's backend for :class:`ui.chat.ChatHandlers` and the backend's state
  (reachable, model) that the header and the notice follow;
- :mod:`ui.remote.metrics`: ``/metrics`` of every URL, in vLLM's, SGLang's or our names;
- :mod:`ui.remote.kv`: ZMQ subscribers of vLLM-format KV cache events and the KV map by block hash;
- :mod:`ui.remote.figures`: the counters table, the request timeline, the KV map;
- :mod:`ui.remote.page`: the page.
"""
