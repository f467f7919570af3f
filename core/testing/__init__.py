"""Testing support: models shared by tests and the conformance suite, and its pytest plugin."""

__all__: list[str] = []
