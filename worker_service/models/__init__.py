"""Model implementations (the Llama family) and the registry by architecture."""
