"""The HTTP and WebSocket surface: the only package that imports aiohttp.web.

Handlers orchestrate: resolve the chain → expand → send upstream → relay → record.
They hold no state of their own beyond a request; errors become OpenAI JSON once, in
middleware.
"""
