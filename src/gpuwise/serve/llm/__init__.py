"""The OpenAI front over any engine: `core.LLM` (the models a server serves), `decode`, `stream`, `metrics`,
`api` (the routes: a thin router over one serving path) and `protocol` (the wire types)."""
