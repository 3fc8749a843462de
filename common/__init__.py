"""What both services (and the client library) share that is neither
observability nor the wire protocol: settings declared once, the tokenizer
bundle's format, and the simulated model's token rule. Pure Python: it
imports neither torch nor grpc."""
