"""``prefixcache warm``: the KV of known prompts (system prompts, a RAG corpus, chats)
prefilled into the cache's tiers before traffic arrives, through the server's own engine
or through a server (vLLM with the connector); see ``docs/warm.md``.

``inputs`` reads the prompts without the model; ``setup`` and ``local`` run the server's
engine; ``remote`` goes through a server; ``cli`` wires them to the command.
"""
