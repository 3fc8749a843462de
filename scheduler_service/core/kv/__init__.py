"""KV metadata: the page pool, who holds which page (a request's table, the
radix cache), the radix tree and its parts, and the KV events it emits."""
