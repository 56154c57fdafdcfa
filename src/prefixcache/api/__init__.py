"""The OpenAI-facing HTTP layer that ``serve`` (``server/``) and ``route`` (``fleet/``)
both put in front of their work, so that a client meets one API whichever it reaches::

    client ──HTTP──> BodyLimit ──> Auth (key -> tenant) ──> schemas ──> prompts (tokens)
                     errors.py     auth.py, sessions.py     schemas.py   prompts.py
    apidoc.py: the OpenAPI document        transport.py: how uvicorn runs the app

Nothing here imports ``server/`` or ``fleet/`` but the settings schema (``server.settings``,
which both read); ``tests/test_layers.py`` keeps it so.
"""
