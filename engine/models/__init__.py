"""Model graphs written against the backend op table: the Llama graph and each family's quirks."""
