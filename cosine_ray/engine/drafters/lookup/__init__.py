"""Model-free drafters: continuations looked up in text already seen (the context, a datastore, what the server generated)."""
