"""What a slow, idle or hostile client may cost a server: the network limits of the
worker and the router alike (`limits`: the flags), enforced by a protocol around
aiohttp's (`connection`: header, write and keep-alive deadlines, the connection cap),
a middleware (`bodies`: the body deadline and the cap on bodies read at once), the
listening site that uses them (`site`) and the metric of every refusal (`metrics`)."""

from pdserve.workers.compiled import search_compiled

search_compiled(__name__, __path__)
